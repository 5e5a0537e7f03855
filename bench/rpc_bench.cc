// Control-RPC latency against a bare gRPC ping, measured in the same run.
//
// The ping is grpc.health.v1 Check: gRPC's own smallest unary call on the
// same channel. Calls are interleaved (ping, then each kvstep RPC, round
// after round) so that the machine's noise hits every kind alike, and each
// kind's median is reported as a ratio to the ping's median. The bar: kvstep
// control RPCs within 10% of the ping.
//
// The series, on one batch of --rows decode rows whose blocks were
// allocated up front for every step of the run: GetServerInfo; a
// one-sequence AllocateBlocks retry; a decode step's slot reservation for
// every row (AllocateBlocks of each row's tokens plus one), with every
// table in the reply and with omit_appended_tables; AdvanceStep, without
// and with the state tensors in the reply.
//
//   build/bench/rpc_bench [--rounds=3000] [--rows=64] [--target=ADDR]
//       [--attention_context=N [--background_attention]]
//       [--attention_threads=N] [--attention_idle_poll_us=N]
// Without --target, a server is started in this process on a unix socket.
//
// --attention_context=N (N a multiple of 16, at least 1024) adds a
// PagedAttention call to every round: one decode token over N cached tokens
// (explicit mode, bf16, 32 query heads over 8 KV heads, head 128, block 16,
// random blocks; 4 MiB of K/V per 1024 tokens, so that the call runs on the
// server's attention threads). The control RPCs of the next round then
// come within the attention workers' idle poll (--attention_idle_poll_us,
// passed to the in-process server; -1 its default): runs with the poll and
// without show what a polling worker costs the control path. The cache
// then has that geometry for every series (64 KB a block).
//
// --background_attention (with --attention_context) makes the same
// attention call from a second client in a loop, on its own thread, for
// as long as the rounds run, instead of once a round: the control RPCs
// then meet an attention call in flight, as a scheduler's do when it plans
// the next step while the model runner's layers attend. The in-process
// server then runs attention on one thread unless --attention_threads
// says otherwise, so that one core is the kernel's and the other is left
// to the server's gRPC threads and this client: the series then shows
// what a call in flight costs the control path, on top of what sharing
// the cores costs it (with the server's default of a thread a core, the
// kernel takes both). "attention calls" is how many the loop made.
//
// --prefill_tokens=N (N > 0) then times a prefill PagedAttention call of N
// tokens as the demo sends one: one row attending over its own N tokens,
// float32 query [N, 32, 128], key and value [N, 8, 128], explicit mode, the
// step's K/V written into N slots of the pool, out [N, 32, 128] back: 24 MB
// of request and 16 MB of response at the demo's 975 tokens. Its baseline
// is the same call made on the in-process server's Engine directly, from
// tensors built once (the kernel, ReshapeAndCache and the engine's own
// work, with no RPC), alternated with the RPC call --prefill_rounds times:
// "rpc/engine" is what the RPC's bytes cost on top of the work. A third
// kind, alternated with them, makes the RPC with the activations and the
// output in shared memory (RegisterSharedMemory; the client's copies into
// and out of the region timed with it). Needs the in-process server (no
// --target).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/demo.h"
#include "client/shared_memory.h"
#include "service/convert.h"
#include "service/server.h"

ABSL_FLAG(int, rounds, 3000, "calls of each kind");
ABSL_FLAG(int, rows, 64, "decode rows in the batch");
ABSL_FLAG(std::string, target, "", "an external server (default: in-process)");
ABSL_FLAG(int64_t, attention_context, 0,
          "cached tokens of a PagedAttention call added to each round (0: "
          "none; else a multiple of 16, at least 1024)");
ABSL_FLAG(int64_t, attention_idle_poll_us, -1,
          "the in-process server's --attention_idle_poll_us");
ABSL_FLAG(bool, background_attention, false,
          "with --attention_context: the attention call in a loop on its own "
          "client and thread while the rounds run, not in the rounds");
ABSL_FLAG(int, attention_threads, -1,
          "the in-process server's --attention_threads (-1: 1 with "
          "--background_attention, else the server's default)");
ABSL_FLAG(int64_t, prefill_tokens, 0,
          "tokens of a prefill PagedAttention call timed against the engine "
          "called directly (0: none)");
ABSL_FLAG(int, prefill_rounds, 20, "calls of each prefill kind");
ABSL_FLAG(bool, keep_freed_memory, true,
          "KeepFreedMemory() first, as kvstep-server does by default");

namespace {

struct Series {
  std::string name;
  std::function<bool()> call;
  std::vector<double> us;
};

double Quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * (v.size() - 1))];
}

// The --prefill_tokens series (see the top of this file): the RPC call and
// the engine's, alternated; 0 on success.
int PrefillSeries(kvstep::Server& server, kvstep::Client& client, int64_t n,
                  int rounds) {
  std::mt19937_64 rng(7);
  const int64_t nb = (n + 15) / 16;
  // The call's blocks belong to a sequence of its own, so that its K/V
  // land in no other sequence's blocks.
  const std::pair<uint64_t, int64_t> seq = {uint64_t{1} << 40, n};
  absl::StatusOr<kvstep::v1::AllocateBlocksResponse> alloc =
      client.AllocateBlocks({&seq, 1});
  if (!alloc.ok() || alloc->sequences_size() != 1 ||
      alloc->sequences(0).block_table_size() != nb) {
    std::fprintf(stderr, "AllocateBlocks for the prefill: %s\n",
                 alloc.status().ToString().c_str());
    return 1;
  }
  std::vector<int64_t> table(alloc->sequences(0).block_table().begin(),
                             alloc->sequences(0).block_table().end());
  std::vector<int64_t> slots, starts = {0, n};
  for (int64_t t = 0; t < n; ++t) slots.push_back(table[t / 16] * 16 + t % 16);
  const kvstep::v1::Tensor query = kvstep::RandomActivations(rng, n, 32, 128);
  const kvstep::v1::Tensor key = kvstep::RandomActivations(rng, n, 8, 128);
  const kvstep::v1::Tensor value = kvstep::RandomActivations(rng, n, 8, 128);
  kvstep::v1::PagedAttentionRequest req;
  *req.mutable_query() = query;
  *req.mutable_key() = key;
  *req.mutable_value() = value;
  *req.mutable_block_tables() = kvstep::MakeIndexTensor(table, {1, nb});
  *req.mutable_seq_lens() = kvstep::MakeIndexTensor({n}, {1});
  *req.mutable_slot_mapping() = kvstep::MakeIndexTensor(slots, {n});
  *req.mutable_query_start_loc() = kvstep::MakeIndexTensor(starts, {2});
  // The engine's call reads the same activations, copied out of the
  // protos once.
  kvstep::AttentionRequest direct;
  for (const auto& [proto, tensor] :
       {std::pair{&query, &direct.query}, std::pair{&key, &direct.key},
        std::pair{&value, &direct.value}}) {
    absl::StatusOr<kvstep::Tensor> t =
        kvstep::TensorFromProto(*proto, true, "activations");
    if (!t.ok()) {
      std::fprintf(stderr, "%s\n", t.status().ToString().c_str());
      return 1;
    }
    *tensor = *std::move(t);
  }
  // The same call with the activations and the output in shared memory
  // (a region registered once): the client's copies into the region and
  // out of it are timed with the call.
  const int64_t q_bytes = static_cast<int64_t>(query.data().size());
  const int64_t kv_bytes = static_cast<int64_t>(key.data().size());
  absl::StatusOr<std::unique_ptr<kvstep::SharedMemory>> shm =
      kvstep::SharedMemory::Create(2 * q_bytes + 2 * kv_bytes);
  if (!shm.ok()) {
    std::fprintf(stderr, "%s\n", shm.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<kvstep::v1::RegisterSharedMemoryResponse> region =
      client.RegisterSharedMemory((*shm)->path(), (*shm)->size());
  if (!region.ok()) {
    std::fprintf(stderr, "RegisterSharedMemory: %s\n",
                 region.status().ToString().c_str());
    return 1;
  }
  kvstep::v1::PagedAttentionRequest shm_req = req;
  int64_t place = 0;
  for (kvstep::v1::Tensor* t : {shm_req.mutable_query(), shm_req.mutable_key(),
                                shm_req.mutable_value()}) {
    const int64_t size = static_cast<int64_t>(t->data().size());
    t->clear_data();
    t->mutable_shm()->set_region_id(region->region_id());
    t->mutable_shm()->set_offset(place);
    place += size;
  }
  shm_req.mutable_out_shm()->set_region_id(region->region_id());
  shm_req.mutable_out_shm()->set_offset(place);
  std::vector<char> out_copy(static_cast<size_t>(q_bytes));
  kvstep::AttentionRows rows;
  rows.query_start = starts;
  rows.seq_lens = {n};
  rows.block_tables = table;
  rows.width = nb;
  rows.num_real = 1;
  std::vector<double> rpc_us, engine_us, shm_us;
  size_t out_bytes = 0;
  for (int r = 0; r < rounds; ++r) {
    absl::Time t = absl::Now();
    absl::StatusOr<kvstep::v1::PagedAttentionResponse> resp =
        client.PagedAttention(req);
    rpc_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t));
    if (!resp.ok()) {
      std::fprintf(stderr, "PagedAttention: %s\n",
                   resp.status().ToString().c_str());
      return 1;
    }
    t = absl::Now();
    absl::StatusOr<kvstep::Tensor> out =
        server.engine()->PagedAttentionExplicit(direct, rows, slots);
    engine_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t));
    if (!out.ok()) {
      std::fprintf(stderr, "Engine::PagedAttentionExplicit: %s\n",
                   out.status().ToString().c_str());
      return 1;
    }
    t = absl::Now();
    char* base = (*shm)->data();
    // (std::copy: memcpy from a string's bytes reads to clang-tidy as a
    // string copy that loses its terminator.)
    std::copy(query.data().begin(), query.data().end(), base);
    std::copy(key.data().begin(), key.data().end(), base + q_bytes);
    std::copy(value.data().begin(), value.data().end(),
              base + q_bytes + kv_bytes);
    absl::StatusOr<kvstep::v1::PagedAttentionResponse> via_shm =
        client.PagedAttention(shm_req);
    if (via_shm.ok()) {
      std::memcpy(out_copy.data(), base + place, out_copy.size());
    }
    shm_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t));
    if (!via_shm.ok()) {
      std::fprintf(stderr, "PagedAttention (shared memory): %s\n",
                   via_shm.status().ToString().c_str());
      return 1;
    }
    // Every path runs the same kernel on the same inputs: a difference would
    // mean an RPC path mangled its bytes.
    if (r == 0) {
      if (out_copy.size() != out->nbytes() ||
          std::memcmp(out_copy.data(), out->raw_data(), out_copy.size()) != 0) {
        std::fprintf(stderr,
                     "the shared-memory RPC's out differs from the "
                     "engine's\n");
        return 1;
      }
      const std::string& via_rpc = resp->out().data();
      if (via_rpc.size() != out->nbytes() ||
          std::memcmp(via_rpc.data(), out->raw_data(), via_rpc.size()) != 0) {
        std::fprintf(stderr,
                     "the RPC's out (%zu bytes) differs from the engine's "
                     "(%zu)\n",
                     via_rpc.size(), out->nbytes());
        return 1;
      }
      out_bytes = out->nbytes();
    }
  }
  const double mb = static_cast<double>(req.ByteSizeLong() + out_bytes) / 1e6;
  const double rpc = Quantile(rpc_us, 0.5), engine = Quantile(engine_us, 0.5);
  std::printf(
      "\nprefill PagedAttention, %lld tokens (float32 activations, %.1f MB "
      "of request and response)\n",
      static_cast<long long>(n), mb);
  std::printf("%-44s %9s %9s %9s\n", "call", "p50 us", "p90 us", "p50/engine");
  std::printf("%-44s %9.1f %9.1f %9.2f\n", "Engine::PagedAttentionExplicit",
              engine, Quantile(engine_us, 0.9), 1.0);
  std::printf("%-44s %9.1f %9.1f %9.2f\n", "PagedAttention RPC", rpc,
              Quantile(rpc_us, 0.9), rpc / engine);
  const double via_shm = Quantile(shm_us, 0.5);
  std::printf("%-44s %9.1f %9.1f %9.2f\n", "PagedAttention RPC, shared memory",
              via_shm, Quantile(shm_us, 0.9), via_shm / engine);
  std::printf(
      "(%d alternated rounds; the RPC's bytes cost %.1f ms, %.2f GB/s "
      "of payload; through shared memory, the client's copies included, "
      "%.1f ms)\n",
      rounds, (rpc - engine) / 1e3, mb / 1e3 / ((rpc - engine) / 1e6),
      (via_shm - engine) / 1e3);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int rounds = absl::GetFlag(FLAGS_rounds);
  const int rows = absl::GetFlag(FLAGS_rows);
  std::string target = absl::GetFlag(FLAGS_target);
  const int64_t attn_ctx = absl::GetFlag(FLAGS_attention_context);
  if (attn_ctx != 0 && (attn_ctx < 1024 || attn_ctx % 16 != 0)) {
    std::fprintf(stderr,
                 "--attention_context must be 0 or a multiple of 16 of at "
                 "least 1024\n");
    return 2;
  }
  const bool background = absl::GetFlag(FLAGS_background_attention);
  if (background && attn_ctx == 0) {
    std::fprintf(stderr, "--background_attention needs --attention_context\n");
    return 2;
  }
  const int64_t prefill = absl::GetFlag(FLAGS_prefill_tokens);
  const int prefill_rounds = absl::GetFlag(FLAGS_prefill_rounds);
  if (prefill < 0 || prefill_rounds < 1 ||
      (prefill > 0 && !absl::GetFlag(FLAGS_target).empty())) {
    std::fprintf(stderr,
                 "--prefill_tokens must be >= 0 and needs the in-process "
                 "server (no --target); --prefill_rounds >= 1\n");
    return 2;
  }
  // Enough blocks for every row to advance once per round, and the
  // attention call's blocks after them.
  const int64_t control_blocks =
      (int64_t{rows} + 1) * ((int64_t{rounds} * 2 + 32) / 16 + 1);
  const int64_t prefill_blocks = (prefill + 15) / 16;
  const int64_t pool_blocks = control_blocks + attn_ctx / 16 + prefill_blocks;
  const bool attention = attn_ctx > 0 || prefill > 0;
  std::unique_ptr<kvstep::Server> server;
  if (target.empty()) {
    // As kvstep-server does by default (--keep_freed_memory); this process
    // is the client too.
    if (absl::GetFlag(FLAGS_keep_freed_memory)) kvstep::KeepFreedMemory();
    kvstep::ServerOptions o;
    o.listen = absl::StrCat("unix:/tmp/kvstep-rpc-bench-", getpid(), ".sock");
    // A small geometry unless attention is timed, since this measures
    // control RPCs, not the pool.
    o.engine.cache.num_blocks = pool_blocks;
    o.engine.cache.num_layers = 1;
    o.engine.cache.num_kv_heads = attention ? 8 : 1;
    o.engine.cache.head_size = attention ? 128 : 8;
    if (attention) o.engine.cache.dtype = kvstep::DType::kBFloat16;
    o.engine.attention_idle_poll_us =
        absl::GetFlag(FLAGS_attention_idle_poll_us);
    const int threads = absl::GetFlag(FLAGS_attention_threads);
    if (threads >= 0) {
      o.engine.attention_threads = threads;
    } else if (background) {
      o.engine.attention_threads = 1;
    }
    auto s = kvstep::Server::Start(o);
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.status().ToString().c_str());
      return 1;
    }
    server = *std::move(s);
    target = server->address();
  }
  auto client = kvstep::Client::Connect(target);
  if (absl::Status s = client->WaitForReady(absl::Seconds(10)); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }

  // One decode batch of `rows` sequences with room for every step.
  const uint64_t base = 1u << 30;
  std::vector<std::pair<uint64_t, int64_t>> seqs;
  kvstep::v1::CreateBatchRequest create;
  for (int i = 0; i < rows; ++i) {
    seqs.emplace_back(base + i, rounds * 2 + 16);
    kvstep::v1::BatchRow* r = create.add_rows();
    r->set_seq_id(base + i);
    r->add_token_ids(1);
  }
  if (auto a = client->AllocateBlocks(seqs); !a.ok()) {
    std::fprintf(stderr, "AllocateBlocks: %s\n", a.status().ToString().c_str());
    return 1;
  }
  auto batch = client->CreateBatch(create);
  if (!batch.ok()) {
    std::fprintf(stderr, "%s\n", batch.status().ToString().c_str());
    return 1;
  }
  kvstep::v1::AdvanceStepRequest step;
  step.set_batch_id(batch->batch_id());
  *step.mutable_sampled_token_ids() =
      kvstep::MakeIndexTensor(std::vector<int64_t>(rows, 7), {rows, 1});
  kvstep::v1::AdvanceStepRequest step_tensors = step;
  step_tensors.set_return_tensors(true);
  const std::vector<std::pair<uint64_t, int64_t>> retry(seqs.begin(),
                                                        seqs.begin() + 1);
  // A decode step's slot reservation for every row (vLLM's append_slots):
  // room for the rows' tokens plus the next one. The blocks were allocated
  // ahead, so it takes none, but it is checked and answered in full; with
  // `omit`, as a scheduler that mirrors the tables sends it.
  int64_t tokens_now = 1;  // each row's, after the AdvanceSteps so far
  kvstep::v1::AllocateBlocksRequest reserve;
  for (const auto& [id, tokens] : seqs) {
    reserve.add_sequences()->set_seq_id(id);
  }
  auto Reserve = [&](bool omit) -> const kvstep::v1::AllocateBlocksRequest& {
    reserve.set_omit_appended_tables(omit);
    for (kvstep::v1::SequenceAllocation& a : *reserve.mutable_sequences()) {
      a.set_num_tokens(tokens_now + 1);
    }
    return reserve;
  };

  std::vector<Series> series = {
      {"ping (health Check)", [&] { return client->IsServing().ok(); }, {}},
      {"GetServerInfo", [&] { return client->GetServerInfo().ok(); }, {}},
      {"AllocateBlocks (1 seq, no-op retry)",
       [&] { return client->AllocateBlocks(retry).ok(); },
       {}},
      {absl::StrCat("AllocateBlocks (", rows, " seqs, a step's slots)"),
       [&] { return client->AllocateBlocks(Reserve(false)).ok(); },
       {}},
      {absl::StrCat("AllocateBlocks (", rows, " seqs, omit tables)"),
       [&] { return client->AllocateBlocks(Reserve(true)).ok(); },
       {}},
      {absl::StrCat("AdvanceStep (", rows, " rows)"),
       [&] { return client->AdvanceStep(step).ok() && ++tokens_now > 0; },
       {}},
      {absl::StrCat("AdvanceStep (", rows, " rows, return tensors)"),
       [&] {
         return client->AdvanceStep(step_tensors).ok() && ++tokens_now > 0;
       },
       {}},
  };
  // One decode token over attn_ctx cached tokens, in explicit mode; the
  // new K/V are not written (slot -1), so the call only reads the cache.
  kvstep::v1::PagedAttentionRequest attn;
  if (attn_ctx > 0) {
    const int64_t nb = attn_ctx / 16;
    std::vector<int64_t> table(static_cast<size_t>(nb));
    for (int64_t i = 0; i < nb; ++i) {
      table[static_cast<size_t>(i)] = (i * 7919) % pool_blocks;
    }
    *attn.mutable_block_tables() = kvstep::MakeIndexTensor(table, {1, nb});
    *attn.mutable_seq_lens() = kvstep::MakeIndexTensor({attn_ctx}, {1});
    *attn.mutable_slot_mapping() = kvstep::MakeIndexTensor({-1}, {1});
    auto bf16 = [](int64_t heads) {
      kvstep::v1::Tensor t;
      t.set_dtype(kvstep::v1::DTYPE_BFLOAT16);
      for (const int64_t d : {int64_t{1}, heads, int64_t{128}}) t.add_shape(d);
      t.set_data(std::string(static_cast<size_t>(heads * 128 * 2), '\0'));
      return t;
    };
    *attn.mutable_query() = bf16(32);
    *attn.mutable_key() = bf16(8);
    *attn.mutable_value() = bf16(8);
    if (!background) {
      series.push_back({absl::StrCat("PagedAttention (bf16, context ", attn_ctx,
                                     ", ", attn_ctx * 4 / 1024, " MiB)"),
                        [&] { return client->PagedAttention(attn).ok(); },
                        {}});
    }
  }
  for (int warm = 0; warm < 100; ++warm) series[0].call();
  // --background_attention: the attention loop, started before the rounds
  // and stopped after them.
  std::atomic<bool> stop{false};
  std::atomic<int64_t> attention_calls{0};
  std::atomic<bool> attention_failed{false};
  std::thread attention_loop;
  if (background) {
    attention_loop = std::thread([&] {
      auto own = kvstep::Client::Connect(target);
      while (!stop.load(std::memory_order_relaxed)) {
        if (!own->PagedAttention(attn).ok()) {
          attention_failed = true;
          return;
        }
        attention_calls.fetch_add(1, std::memory_order_relaxed);
      }
    });
    // Its first call back (the pool's pages touched) before the first round.
    while (attention_calls.load() == 0 && !attention_failed.load()) {
      absl::SleepFor(absl::Milliseconds(1));
    }
  }
  auto stop_loop = [&] {
    stop = true;
    if (attention_loop.joinable()) attention_loop.join();
  };
  for (int r = 0; r < rounds; ++r) {
    for (Series& s : series) {
      const absl::Time t = absl::Now();
      if (!s.call()) {
        std::fprintf(stderr, "%s failed\n", s.name.c_str());
        stop_loop();
        return 1;
      }
      s.us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t));
    }
  }
  stop_loop();
  if (attention_failed) {
    std::fprintf(stderr, "the background PagedAttention call failed\n");
    return 1;
  }
  const double ping = Quantile(series[0].us, 0.5);
  std::printf("%-44s %9s %9s %9s\n", "call", "p50 us", "p90 us", "p50/ping");
  for (const Series& s : series) {
    std::printf("%-44s %9.1f %9.1f %9.2f\n", s.name.c_str(),
                Quantile(s.us, 0.5), Quantile(s.us, 0.9),
                Quantile(s.us, 0.5) / ping);
  }
  std::printf("(%d interleaved rounds, target %s)\n", rounds, target.c_str());
  if (background) {
    std::printf(
        "background: %lld PagedAttention calls (bf16, context %lld, %lld MiB "
        "of K/V each) in flight through the rounds, from another client\n",
        static_cast<long long>(attention_calls.load()),
        static_cast<long long>(attn_ctx),
        static_cast<long long>(attn_ctx * 4 / 1024));
  }
  if (prefill > 0) {
    return PrefillSeries(*server, *client, prefill, prefill_rounds);
  }
  return 0;
}
