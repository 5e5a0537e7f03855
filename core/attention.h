// Paged attention on the CPU (SEMANTICS §6-§7): reshape_and_cache writes a
// step's new K/V into the paged cache, PagedAttention computes attention of
// the step's queries over each row's cached context.
//
// Rows are described by AttentionRows: row r owns query tokens
// [query_start[r], query_start[r+1]) at the last positions of its seq_len
// (decode: one token at seq_len - 1; a prefill chunk: causal over the cached
// context plus the chunk). Rows from num_real on are padding: their output
// is zero. Keys j <= p of a query at position p get
//   logit_j = scale * dot(q, k_j) + slope_h * (j - p)
// (only j > p - window with a sliding window), an exact softmax (divided by
// the plain sum), and out = sum softmax_j * v_j, accumulated in fp32 and
// stored in the query dtype. Slots past seq_len are never read, so unwritten
// (even NaN) cache bytes cannot reach the output. An Inf or NaN in a written
// slot reaches it as IEEE arithmetic gives it, provided the layer is flagged
// (KvCache::MayHoldNonFinite): ReshapeAndCache flags what it writes; a writer
// that stores into the cache bytes directly must flag them itself.
//
// Work is split by (row, KV head): the query heads of a GQA group share each
// K/V block read. In the NHD layout, rows of few query tokens are split by
// row instead, each block's token rows read whole (AttentionParams::
// nhd_rows); in the vLLM layout, decode rows are split by row too, their
// keys read a block (every KV head) at a time (AttentionParams::
// vllm_rows). The partitioned kernel (vLLM v2) also splits long
// contexts into partitions reduced by max/exp-sum, for parallelism when
// there are few rows. Decode calls of long rows (BestLongRowRanges) take
// whole rows a thread instead, each in 1024-key ranges whose every KV
// head runs before the next range. Calls smaller than params.parallel_min_bytes
// run on the calling thread only. Thread-compatible: the caller serializes
// writers of the cache.
#ifndef KVSTEP_CORE_ATTENTION_H_
#define KVSTEP_CORE_ATTENTION_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/kv_cache.h"
#include "core/tensor.h"
#include "core/thread_pool.h"

namespace kvstep {

struct AttentionParams {
  double scale = 0;                 // 0: 1 / sqrt(head_size)
  std::vector<float> alibi_slopes;  // empty, or one per query head
  int64_t sliding_window = 0;       // 0: none
  float k_scale = 1;                // fp8 caches: stored = saturate(x / scale)
  float v_scale = 1;
  // kAuto: the partitioned kernel where a call's items are fewer than
  // twice its threads and its rows span several partitions, unless it has
  // prefill rows (more than one query token), which the single pass then
  // takes in pieces of query tokens over the threads (session 71); and, where
  // BestLongRowRanges (not on AMD), decode calls of per-KV-head items in
  // the vLLM layout (16-bit and fp32 caches, the AVX-512 build) whose rows
  // of 2 MiB of K/V a KV head or more (at head 128: 4096 16-bit keys, 2048
  // fp32; keys within the sliding window) hold at least half the call's
  // keys and, on more than one thread, whose rows balance as whole rows a
  // thread (or that are one row, whose ranges the threads then split): a
  // single pass over each row in 1024-key ranges, every KV head's range
  // before the next, merged as they come (on the Intel Xeon
  // of session 50 the plain single pass took 1.03-1.13x the time there;
  // docs/attention.md). The single pass otherwise. partition_size: the keys a
  // partition under kPartitioned and the first kAuto case.
  enum class Kernel { kAuto, kSinglePass, kPartitioned };
  Kernel kernel = Kernel::kAuto;
  int64_t partition_size = 512;
  // Calls that read less K/V than this (bytes, times the query tokens of
  // each row; fp8 bytes count twice, their arithmetic being a 16-bit
  // element's) run on the calling thread alone, pool or not: below it a
  // woken thread cost more than it saved (docs/attention.md). 0: always
  // use the pool (tests of the threaded paths).
  int64_t parallel_min_bytes = int64_t{4} << 20;
  // The slice touch (vLLM layout, every cache dtype): an item of at
  // least touch_min_blocks blocks, in a call that reads at least
  // touch_min_bytes of K/V, first prefetches one line of each of its key
  // and value slices, all at once; a decode row read over every KV head
  // at once (the vLLM layout's row passes) instead prefetches one line in
  // every 32 KB of each of its blocks' keys and values, under the same
  // gates (since session 33: bf16 and fp16 rows of 1024-8192 keys then
  // took 0.95-0.98x the time on one thread, fp32 0.98-0.99x, 0.99-1.00x on
  // two, where calls cycle over 1 GiB of layers). It changes no result.
  // -1 (the default): this CPU's measured choice. On AMD (and Hygon) CPUs every
  // item of every call (0 and 0): on Zen 5, call by call, calls of 256 MiB and
  // more took 0.85-0.95x the time of no touch for bf16 and fp16 and 0.92-
  // 0.98x for fp32, calls of 4-64 MiB 0.94-1.02x, within noise (session
  // 14); fp8 caches, since their K and V passes by VDPBF16PS (session
  // 17), 0.75-0.81x for calls of 64 MiB and more and 0.95-0.99x for
  // 2-16 MiB. Elsewhere 512 MiB and 128 blocks: on the Intel Xeon
  // 0.94-0.98x the time for items of 512 blocks, but 1.04x for items of
  // 64-128 blocks (session 10, when decode rows were read by the 8-wide
  // passes and 512 blocks was the gate); with session 47's kernel, calls of
  // 1-4 GB took 0.94-0.97x the time with items of 256 blocks touched, 0.97-
  // 0.99x with items of 128 (one and two threads, bf16, fp16 and fp32),
  // items of 64 0.98-1.01x; calls under 512 MiB 0.97-1.01x
  // (docs/attention.md). The long rows' 1024-key ranges (kernel) are gated
  // as their rows are: each range touched (1-4 GB calls 0.97-0.98x the
  // time of none, session 50). 0 and 0: always (tests).
  int64_t touch_min_bytes = -1;
  int64_t touch_min_blocks = -1;
  // kBest runs the widest kernel this CPU has: AVX-512 (F, BW, VL, DQ and
  // BF16, as on Zen 4/5 and Sapphire Rapids), else AVX2+FMA+F16C, else
  // portable x86-64. The others force one, for tests and benchmarks of that
  // path; PagedAttention answers FAILED_PRECONDITION when the CPU lacks it
  // (see IsaSupported).
  enum class Isa { kBest, kAvx512, kAvx2, kPortable };
  Isa isa = Isa::kBest;
  // The hint of the AVX-512 passes' software prefetches of K/V, lines each
  // call reads once. Which is faster depends on the CPU, by far: on Zen 5
  // prefetchnta (kNta) took 3-10% less time than prefetcht0 (kT0) for
  // 16-bit caches (session 5, before the cold-cache method) and 15-34% less
  // than prefetcht1/t2; on an Intel Xeon with AMX (Granite
  // Rapids class) kNta took 1.5-2.1x the time of prefetcht1 (kT1), and kT0
  // 1-9% more than kT1 (docs/attention.md, session 8). With kT0 and kT1
  // the passes also start the core's L2 streamer on the blocks 4 ahead
  // (2-10% less time there). kAuto: kT1 except on AMD (and Hygon) CPUs,
  // and for 16-bit caches in the vLLM layout on Intel family 6 model 207
  // (Emerald Rapids, the KVM guest of sessions 51-52; session 52, call by
  // call: bf16 and fp16 decode at block sizes 8 and 16 took 0.93-0.98x
  // the time with kT0 and its second prefetch into L2, one and two
  // threads, 1k-8k keys, batches 1-64; block size 32 0.98-1.00x; fp32
  // 1.00-1.03x, fp8 1.01x, the NHD layout 1.17x keep kT1; the Xeon guest
  // of sessions 47-50, model 167, had kT0 at 1.015-1.033x), which take
  // kT0: on Zen 5, fp32 calls took 0.94-0.97x the time with kT0
  // in 8 of 8 cases and kNta 0.98-1.07x of kT0's in the reverse order
  // (session 15), and since session 22 every cache dtype: vLLM-layout
  // decode calls took 0.86-0.97x the time with kT0 than with kNta on one
  // thread for bf16 and fp16, 0.94-0.98x on two, fp8 0.91-1.00x, NHD and
  // prefill calls 0.998-1.003x (in session 14 bf16 had been mixed and fp16
  // had taken 1.06-1.07x with kT0, before session 18 left kT0 its key
  // stream starts only). The others force one, for benchmarks (attention_bench
  // --vs=prefetch=...) and for kvstep-server --attention_prefetch. The
  // 8-wide passes (the AVX2 build; MHA and fp8 caches in the AVX-512 one)
  // take prefetcht1 for kT1 and prefetcht0 otherwise. The hint changes
  // timing only, never a result.
  enum class Prefetch { kAuto, kNta, kT0, kT1 };
  Prefetch prefetch = Prefetch::kAuto;
  // How the AVX-512 K pass multiplies bf16 keys by a bf16 query. kDot:
  // VDPBF16PS on the unscaled query (exact products, fp32 sums, the scale
  // applied to the sums; it takes subnormal bf16 inputs, under 2^-126 in
  // magnitude, as zeros: a product then moves by less than 2^-126 times its
  // other factor). kWiden: the keys split into even and odd dims as exact
  // floats (a shift and a mask) against the scaled fp32 query, two FMAs per
  // vector. kWiden took less time from cold caches, as a server's layers read
  // K/V, on both CPUs measured: on the Intel Xeon (a zmm VDPBF16PS issues every
  // 2 cycles against 2 FMAs a cycle) 2-5% less, 13-14% warm (session 8); on
  // Zen 5 kDot took 1.01-1.09x kWiden's time cold in 19 of 24 cases and
  // 0.975-1.009x in the largest calls (context 8192 at batch 16, 4096 at 64),
  // though 2% less warm (session 14; docs/attention.md); in NHD rows (nhd_rows)
  // kDot took 1.055-1.075x the time cold, 0.9x warm (session 19); in vLLM
  // rows 1.024-1.052x cold whether its keys are prefetched 8, 12 or 16 KB ahead
  // (session 34), so it is not held back by a prefetch tuned for the slower
  // pass. Prefill chunks in the vLLM layout (2 or more query tokens,
  // per-KV-head K passes), which are bound by their arithmetic, not the
  // memory: on Zen 5 kWiden
  // took 1.15-1.19x kDot's time (block sizes 8-32, chunks of 16-512 tokens at
  // 2048 keys, one and two threads, MHA; session 39); the Intel Xeon's
  // VDPBF16PS issues at half the FMAs' rate, so there kWiden stays (session
  // 47: kDot took 1.17-1.21x the time in NHD chunks of 512 and 16 tokens
  // and in vLLM-layout ones without AMX). NHD
  // prefill chunks (items per KV head): kDot took 0.80-0.90x kWiden's time
  // in rows of 512 tokens, but in rows of one or two chunks (16 or 32
  // tokens) at 8192 keys up to 1.45x, unsteadily from run to run (session
  // 45). kAuto: kWiden for decode; for vLLM-layout prefill chunks,
  // and NHD ones of rows of more than 32 query tokens, kDot on AMD, kWiden
  // elsewhere (BestBf16Keys); other NHD chunks kWiden. Other queries and
  // caches are unaffected.
  enum class Bf16Keys { kAuto, kDot, kWiden };
  Bf16Keys bf16_keys = Bf16Keys::kAuto;
  // Whether the AVX-512 build may use AMX (AMX-BF16: TDPBF16PS) where the
  // CPU and OS have it (AmxSupported), for prefill chunks (2 or more query
  // tokens) of bf16 and fp16 caches in the vLLM layout, block sizes 16 and
  // 32 (fp16: not on a layer flagged as possibly holding Inf or NaN). Keys,
  // head sizes that are multiples of 32 up to 256: exact products and fp32
  // sums (an fp16 key or query element goes in as two bf16 parts, an fp32
  // query element as three, each part against each). Values, head sizes
  // that are multiples of 16: fp16 values as two exact parts, the fp32
  // weights as the sum of two bf16 parts (about 2^-17 of relative error
  // each). A 512-token chunk at context 4096 took 3.2x less time for bf16
  // (session 12) and 1.9-2x less for fp16 (session 13; docs/attention.md).
  // false: the FMA passes (tests, benchmarks).
  bool amx = true;
  // Whether the AVX-512 build runs fp8 caches (vLLM layout, head sizes
  // that are multiples of 16) against a bf16 query by VDPBF16PS where the
  // CPU has AVX512-VBMI (Fp8DotSupported): two byte lookups (VPERMI2B)
  // turn 64 fp8 elements into their exact bf16 values. Keys: against the
  // unscaled query, exact products and fp32 sums, as in the converting
  // pass. Values (block sizes 16 and 32): against the softmax weights
  // rounded to bf16, which moves an output by at most 2^-9 of the row's
  // largest |value|, about a bf16 output's own rounding (vLLM's GPU kernel
  // rounds the weights to the model's dtype too). Per 64 bytes and 4 heads
  // the arithmetic drops from 12 integer ops and 16 FMAs to 5 and 8 VDPBF16PS;
  // on Zen 5 fp8 calls took 0.68-0.86x the time (docs/attention.md, session
  // 17). On the Intel Xeon guest of session 59 (model 207), where a zmm
  // VDPBF16PS holds both FMA pipes for about 2 cycles (session 51), the
  // converting passes took 0.70-0.91x the time of these in every case
  // measured (e4m3 and e5m2; 1k-8k keys, batches 1-256, one and two
  // threads, cold and warm; block size 32; NHD rows' keys; prefill chunks
  // of 16 and 512 tokens) but 1.18-1.41x at block size 8 in the vLLM
  // layout, whose fast paths (decode rows over every KV head, key tiles
  // over two blocks) exist for these passes only. fp16 and fp32 queries, and
  // every query where this resolves to false or the CPU lacks VBMI, take
  // the converting passes (LogitsFp8Z, ValuesFp8Z): an fp16 query's keys by
  // two exact bf16 parts took 1.12-1.17x their time. NHD rows (nhd_rows)
  // take it for keys only: their values by it took 0.98-1.01x the exact
  // pass's time, their keys 0.92-0.94x on Zen 5 (session 19). kAuto: this
  // CPU's choice (BestFp8Dot): on AMD (and Hygon) always; elsewhere only
  // vLLM-layout caches at block size 8. kOn: wherever the CPU runs it
  // (tests, benchmarks); kOff: never (the converting passes). Outputs of
  // bf16 queries differ between the two by the weights' rounding above.
  enum class Fp8Dot { kAuto, kOn, kOff };
  Fp8Dot fp8_dot = Fp8Dot::kAuto;
  // Whether the AVX-512 build reads an NHD cache ([blocks, block, KV heads,
  // head]) a row at a time: one item per row over all its KV heads, each
  // block's token rows read whole, in calls whose rows have few query
  // tokens (up to 128 virtual heads a row: decode, speculative decode).
  // Otherwise (longer rows; fp8 caches on a layer flagged as possibly
  // holding Inf or NaN, or of head sizes not a multiple of 64) an item per
  // (row, KV head) reads head_size of every num_kv_heads * head_size
  // elements of a token row: on Zen 5 those calls took 1.15-1.87x the time
  // for 16-bit and fp32 caches and 1.87-2.70x for fp8 (before fp8 rows
  // took their keys by VDPBF16PS; docs/attention.md, session 19). false:
  // for A/B runs and tests.
  bool nhd_rows = true;
  // Whether the AVX-512 build takes a vLLM-layout cache's decode rows (one
  // query token) a row at a time, where the block size is a multiple of
  // 16 or is 8: one item per row whose K pass reads each block's keys of
  // every KV head (head_size * block_size elements a head, one after
  // another: a contiguous run) in address order, before each KV head's
  // softmax and V pass; an item per (row, KV head) reads one head's slice
  // of each block and leaves the rest to later items. The V pass stays per
  // KV head: its lanes (16 KB a head) would leave L1 over all heads. On
  // Zen 5 (random tables, call by call): fp32 calls took 0.89-0.96x the
  // time at 1k-16k keys, batches 4-32, one and two threads; bf16
  // 0.96-0.98x and fp16 0.93-0.96x at 1k-2k keys, batches 16-32, one thread
  // (two threads 0.99-1.01x), but bf16 1.00-1.04x at 4k-8k keys, where the
  // logits of every head of a row, written before any V pass reads them,
  // pass 256 KB. So 16-bit caches take it where a row's logits (query heads
  // x keys x 4 bytes) fit 256 KB (session 23), up to 2 MB in calls of at
  // most 8 rows (session 28) or on one thread (session 33: 0.92-0.99x the
  // time at 4k-16k keys, batches 16-256, since rows touch their blocks
  // first), or at any length where the rows' tables run in consecutive
  // blocks (session 30; docs/attention.md). 8-token blocks (8-token key
  // tiles) since session 36: calls took 0.84-0.93x the time on one thread
  // (bf16, fp16, fp32; 1k and 4k keys, batches 1-64), 16-bit ones
  // 0.92-1.01x on two, but fp32 1.00-1.04x on two at batches 16 and 64, so
  // fp32 takes them on one thread only. fp8 caches (session 37) where
  // their keys and values take VDPBF16PS (fp8_dot, a bf16 query, head
  // sizes in steps of 16), under the 16-bit caches' limits on the logits.
  // Prefill rows: an item per (row, KV head).
  //
  // Which CPU gains is measured, not derived. On the Intel Xeon of session
  // 47 (Granite Rapids class, read 16 GB/s a core) the items took 0.93-
  // 0.97x the rows' time for 16-bit caches at block size 16 (1k-8k keys,
  // batches 1-256, one thread; 0.94-1.00x on two), 0.96-0.99x for fp32,
  // 0.90-0.97x for fp8 and every cache at block size 32, 0.95-0.96x on
  // runs tables; at block size 8 the rows still won for 16-bit and fp8
  // caches on one thread (items 1.03-1.08x; on two 1.00x), not for fp32
  // (items 0.94x). kAuto: this CPU's choice (BestVllmRows): on AMD (and
  // Hygon) every call the gates above admit; elsewhere only caches of 8-
  // and 16-bit elements at block size 8. kOn: every call the gates admit
  // (tests, benchmarks); kOff: never. It changes no result.
  enum class VllmRows { kAuto, kOn, kOff };
  VllmRows vllm_rows = VllmRows::kAuto;
  // Whether the AVX-512 passes over a vLLM-layout cache prefetch each
  // line twice where they prefetch with prefetcht0 (prefetch kAuto on
  // AMD, or kT0): into L1 about 8 KB ahead of their reads, as always
  // (16-bit keys on Intel one block, 4 KB at block size 16, since session
  // 53: 0.975-1.003x the time on model 207), and
  // into L2 (prefetcht1) a little further: 16-bit keys (16-token tiles)
  // one slice further, 16-bit values (by pairs) one sweep of two blocks
  // further, fp32 values 4 KB further. With random block tables neither
  // the L1 prefetches alone (each holds one of the core's few L1 miss
  // slots until its line comes from memory) nor the L2 ones alone keep
  // enough lines in flight; the L2 one brings the line close first, so
  // the L1 one waits less. On Zen 5, call by call: bf16 and fp16 calls
  // took 0.92-0.97x the time (1k-16k keys, batches 1-32, one and two
  // threads, row and per-head items; the K pass of decode rows alone
  // 0.89-0.92x), fp32 calls 0.96-0.97x (docs/attention.md, session 24).
  // Not with kT1 (already into L2) or kNta; not for fp32 keys (1.03-
  // 1.05x the time), fp8 caches or the NHD layout (1.01-1.09x). It
  // changes no result. false: for A/B runs.
  bool prefetch_l2 = true;
};

// This CPU as CPUID names it, read once: the vendor string
// ("AuthenticAMD", "GenuineIntel"; empty off x86), the displayed family
// and model (the extended fields added as CPUID defines them), and the
// brand string (empty where CPUID has none). The kernel's per-CPU choices
// key on the vendor and model; attention_bench prints it all.
struct CpuIdentity {
  std::string vendor;
  std::string brand;
  unsigned family = 0;
  unsigned model = 0;
};
const CpuIdentity& ThisCpu();
// Whether this CPU runs `isa` (kBest and kPortable: always), its name, and
// what kBest runs here.
bool IsaSupported(AttentionParams::Isa isa);
const char* IsaName(AttentionParams::Isa isa);
AttentionParams::Isa BestIsa();
// What kAuto prefetches with on this CPU for a cache of dtype `cache` in
// `layout` (never kAuto), and a hint's name.
AttentionParams::Prefetch BestPrefetch(DType cache, CacheLayout layout);
const char* PrefetchName(AttentionParams::Prefetch prefetch);
// "auto", "nta", "t0" or "t1" into *out (flags); false for anything else.
bool ParsePrefetch(absl::string_view name, AttentionParams::Prefetch* out);
// Whether this CPU and OS run AMX-BF16 (AttentionParams::amx).
bool AmxSupported();
// Whether this CPU runs the fp8 VDPBF16PS passes (AttentionParams::
// fp8_dot): the AVX-512 build and AVX512-VBMI.
bool Fp8DotSupported();
// Whether kAuto runs fp8 caches in `layout` at `block_size` tokens a block
// by VDPBF16PS on this CPU (AttentionParams::fp8_dot): false where the CPU
// lacks it (Fp8DotSupported).
bool BestFp8Dot(CacheLayout layout, int64_t block_size);
// What kAuto's fp8 VDPBF16PS passes cover in decode calls with a bf16
// query over a cache of config c on this CPU, the other AttentionParams at
// their defaults (nhd_rows on), as the server passes them (GetServerInfo's
// attention_kernel reports this): kNone where c is not fp8, BestFp8Dot is
// false, or c's shape has no such pass: in NHD head sizes that are not a
// multiple of 64, or one KV head (its rows are read per KV head). NHD rows
// take keys only, their values converted (AttentionParams::fp8_dot); the
// vLLM layout both (its fp8 head sizes are multiples of 16). Per call, an
// fp16 or fp32 query, and in NHD a layer flagged for Inf or NaN, take the
// converting passes whatever this says.
enum class Fp8DotScope { kNone, kKeysAndValues, kKeys };
Fp8DotScope BestFp8DotScope(const CacheConfig& c);
// What kAuto multiplies bf16 keys with on this CPU (never kAuto): in
// decode (and NHD prefill chunks of rows of at most 32 query tokens), or
// with `chunks` in vLLM-layout prefill chunks and NHD ones of longer rows.
AttentionParams::Bf16Keys BestBf16Keys(bool chunks = false);
// Whether kAuto lets vLLM-layout decode rows over every KV head run on this
// CPU (AttentionParams::vllm_rows) for a cache of dtype `cache` and
// `block_size` tokens a block; the gates that kOn keeps still apply.
bool BestVllmRows(DType cache, int64_t block_size);
// Whether kAuto takes decode calls of long rows in 1024-key ranges, every
// KV head's range before the next, on this CPU for a cache of
// dtype `cache` in `layout` (see AttentionParams::kernel): the vLLM
// layout, 16-bit and fp32 caches, where the best build is AVX-512; not on
// AMD: on the Zen 5 of session 61 the ranges (which need per-KV-head
// items) took 1.01-1.06x the time of the rows over every KV head for
// 16-bit caches on one thread (4k-8k keys, batches 1-64) and 1.00-1.05x
// on two, 1.09-1.11x for fp32 on both (docs/attention.md).
bool BestLongRowRanges(DType cache, CacheLayout layout);

struct AttentionRows {
  std::vector<int64_t> query_start;   // [n + 1], from 0 to num_tokens
  std::vector<int64_t> seq_lens;      // [n]
  std::vector<int64_t> block_tables;  // [n * width]
  int64_t width = 0;
  int64_t num_real = 0;  // rows >= num_real are padding
};

// Writes key and value ([num_tokens, num_kv_heads, head_size], float32,
// float16 or bfloat16) into `layer` at `slots` (one per token; -1 skips the
// token). Checks everything first: INVALID_ARGUMENT for shapes and dtypes,
// OUT_OF_RANGE for a slot outside the pool; nothing is written on error.
// Storing an Inf or NaN (fp16 overflow included) flags the layer
// (KvCache::NoteNonFinite).
absl::Status ReshapeAndCache(const KvCache& cache, int64_t layer,
                             const Tensor& key, const Tensor& value,
                             absl::Span<const int64_t> slots, float k_scale,
                             float v_scale);

// Checks query ([num_tokens, num_heads, head_size], float32/16, bfloat16),
// the rows and the params against the cache; errors name the row.
absl::Status ValidateAttention(const CacheConfig& cache, const Tensor& query,
                               const AttentionRows& rows,
                               const AttentionParams& params);

// Computes attention into *out ([num_tokens, num_heads, head_size] in the
// query dtype): in place when *out is already such a tensor in host memory,
// else a new one. Validates first (an error leaves *out untouched). `pool`
// may be null.
absl::Status PagedAttention(const KvCache& cache, int64_t layer,
                            const Tensor& query, const AttentionRows& rows,
                            const AttentionParams& params, ThreadPool* pool,
                            Tensor* out);

namespace internal {
// ReshapeAndCache's stores as its per-element loop made them before they
// were done row by row (the same checks; never flags the layer): for the
// test that both leave the same bytes in the cache.
absl::Status ReshapeAndCacheReference(const KvCache& cache, int64_t layer,
                                      const Tensor& key, const Tensor& value,
                                      absl::Span<const int64_t> slots,
                                      float k_scale, float v_scale);
// The kernel's vector conversion of n cache elements of `dtype` (times
// `scale` for fp8) to floats, for tests.
void ConvertCacheElements(DType dtype, const void* src, int64_t n, float scale,
                          AttentionParams::Isa isa, float* out);
// The AVX-512 build's split of fp16 pairs into floats (SplitHalvesZ in
// core/attention_kernel.inc) over n halves, n a multiple of 32, back in
// order and undone (times 2^112): false if its Inf/NaN check fired. Only
// where IsaSupported(kAvx512).
bool SplitHalvesForTest(const uint16_t* src, int64_t n, float* out);
// The AMX passes' split of n query elements (a multiple of 32) of `dtype`
// into bf16 parts (rows of n at out, part after part; fp16 keys and values
// are split alike): returns how many (bf16 1, fp16 2, fp32 3). Only where
// IsaSupported(kAvx512): the split needs AVX-512 BF16, not AMX.
int64_t AmxQueryPartsForTest(DType dtype, const void* src, int64_t n,
                             uint16_t* out);
// The fp8 VDPBF16PS pass's conversion (Fp8ToBf16Z in
// core/attention_kernel.inc) of n bytes (a multiple of 64) of an fp8
// `dtype` to bf16 bits, in order: false (nothing written) where the CPU
// lacks it (Fp8DotSupported) or dtype is not fp8.
bool Fp8ToBf16ForTest(DType dtype, const uint8_t* src, int64_t n,
                      uint16_t* out);
// ReshapeAndCache's AVX-512 conversion of n activations of dtype `act`
// (float32, float16, bfloat16) at src, divided by `scale`, into the fp8
// `cache` dtype: false (nothing written) where the CPU has no AVX-512 or
// the dtypes are not such a pair.
bool ActivationsToFp8ForTest(DType cache, DType act, const void* src, int64_t n,
                             float scale, uint8_t* out);
// The softmax's exp (FastExp in attention.cc: x <= 0, 0 at or below -87
// and for NaN) over n floats (n a multiple of 16) by the vector loop of
// `isa`'s build (callers check IsaSupported), and the scalar one, for a
// test of how closely the builds agree.
void ExpForTest(AttentionParams::Isa isa, const float* x, int64_t n,
                float* out);
float ScalarExpForTest(float x);
// The 16-lane K passes' choice of which tile of a block prefetches which
// lines of each key chunk of the slice ahead (KeyTilePrefetchLines in
// attention.cc), for a test that a block's tiles cover every line once.
bool KeyTilePrefetchLinesForTest(int64_t bs, bool burst, int64_t tb,
                                 int64_t first, int64_t t1, int64_t tile,
                                 int64_t* l0, int64_t* l1);
// How many fp16 or fp8 K or V passes of the AVX-512 build were redone by
// conversion since the process started (an Inf or NaN in the cache of a
// flagged layer, or a query too large for the passes' scaling).
int64_t ConvertingRedos();
// How many K or V passes of prefill chunks ran on AMX (AttentionParams::amx)
// since the process started.
int64_t AmxPasses();
// How many fp8 K or V passes began on VDPBF16PS (AttentionParams::fp8_dot)
// since the process started (one that met an Inf or NaN on a flagged layer
// and was redone by conversion counts too).
int64_t Fp8DotPasses();
// How many K passes (per KV head, or rows over every KV head; either
// layout) multiplied bf16 keys by VDPBF16PS (AttentionParams::bf16_keys)
// since the process started.
int64_t Bf16DotKeyPasses();
// How many key segments of NHD rows were read a whole row at a time, over
// all KV heads (AttentionParams::nhd_rows), since the process started.
int64_t NhdRowPasses();
// How many key segments of vLLM-layout decode rows were read a whole row
// at a time, over all KV heads (AttentionParams::vllm_rows), since the
// process started.
int64_t VllmRowPasses();
// Calls that kAuto took as long rows in 1024-key ranges
// (BestLongRowRanges), since the process started.
int64_t LongRowRangeCalls();
// Calls whose rows held different numbers of query tokens and took
// UnevenClaims' claims, since the process started.
int64_t UnevenClaimCalls();
// How many consecutive (row, KV head) items of n a thread claims at a time
// (kvh KV heads a row, `threads` threads); see attention.cc.
int64_t ClaimSize(int64_t n, int64_t kvh, int64_t threads);
// One claim of a call whose rows hold different numbers of query tokens
// (chunked prefill beside decode rows), which the threads take one at a
// time from a list sorted heaviest first: KV heads [h0, h1) of `row`, each
// over query tokens [q0, q1) (whole chunks from the row's first token), or
// with `whole` the row as one item over every KV head (a row of up to
// `row_tokens` query tokens, the kernel's rows over every KV head). `work`
// is query tokens x keys over its heads. A thread's work is the call's over
// the threads; coarse claims (over a quarter of a thread's work) head the
// list, and every thread takes those from the front; the rest
// even-numbered threads take from the front and odd ones from the back.
struct ItemClaim {
  int64_t row = 0, h0 = 0, h1 = 0, q0 = 0, q1 = 0;
  bool whole = false;
  double work = 0;
  bool coarse = false;
};
// The claims of such a call (`chunk` query tokens a chunk; chunk_keys(r,
// qi): the keys of row r's chunk from token qi): each row's KV heads
// grouped where a row's work is within a share (a 32nd of a thread's
// work), a heavier row's heads each cut into pieces of whole chunks of
// about a share (see attention.cc).
std::vector<ItemClaim> UnevenClaims(
    const AttentionRows& rows, int64_t kvh, int64_t threads, int64_t chunk,
    int64_t row_tokens,
    const std::function<int64_t(int64_t, int64_t)>& chunk_keys);
// Whether CPUID names AMD or Hygon (Zen cores) as this CPU's vendor: where
// the kernel's per-CPU choices take the Zen 5's measurements (the tests
// check those choices against it).
bool AmdOrHygonCpu();
}  // namespace internal

}  // namespace kvstep

#endif  // KVSTEP_CORE_ATTENTION_H_
