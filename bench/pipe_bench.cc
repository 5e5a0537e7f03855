// Which vector instructions take the FMA pipes' time on this core: for
// each instruction, how many cycles 8 and 16 of it add beside 32
// independent FMAs (or VDPBF16PS) that alone take 16 on a core with two
// 512-bit FMA pipes. The attention kernel's passes mix FMAs or dots with
// conversions (fp16 and bf16 splits, fp8 lookups), query broadcasts and
// lane loads; an instruction that adds nothing here costs a pass no FMA
// time, one that adds half a cycle each runs on the same pipes.
// docs/attention.md (session 65) has the numbers this tool gave on the
// AMD Zen 5.
//
//   build/bench/pipe_bench [--rounds=5] [--iterations=N]
//
// Cycles are counted against a chain of dependent integer adds (one a
// cycle on every x86 core), so they are core cycles whatever the TSC's
// rate; each figure is the best of --rounds runs of --iterations loop
// steps (2,000,000 by default). The instructions are inline assembly on
// registers and an L1-resident buffer, so the tool needs no target flags;
// rows whose instruction set the CPU lacks (AVX512-VBMI, AVX512-BF16) are
// printed as skipped. Needs AVX-512 F and BW: without them it says so and
// exits with 77 (ctest's "skipped"); 2 is a bad flag.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <string>

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

namespace kvstep {
namespace {

// The exit status where this CPU cannot run the tool (ctest's skip).
constexpr int kNoAvx512 = 77;

#if defined(__x86_64__)

// What the loops load and their registers start from: every word
// 0x3f803f80 (Main fills it), a normal float (about 1.002) and a pair of
// bf16 ones, so that no operand is zero or denormal.
constexpr uint32_t kOnes = 0x3f803f80;
alignas(64) uint32_t g_buf[16];

// The registers the loops write. zmm16-31 exist for the compiler only
// where it targets AVX-512 (this file is built for baseline x86-64, whose
// compiler never holds a value in them); named there, as xmm16-31.
#if defined(__AVX512F__)
#define KVSTEP_HIGH_CLOBBERS                                                \
  , "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", \
      "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31"
#else
#define KVSTEP_HIGH_CLOBBERS
#endif
#define KVSTEP_CLOBBERS                                                    \
  "rcx", "rax", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6",    \
      "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", \
      "xmm15", "memory" KVSTEP_HIGH_CLOBBERS

// The registers the loops read, set from g_buf before each loop: left as
// they were, they could hold denormals, which some cores multiply slowly,
// or zeros, which a core could take a shortcut on (the Zen 5 does not: 16
// cycles for the 32 FMAs either way).
// clang-format does not settle on a layout for this list (each run
// changes it), so it is left as written.
// clang-format off
#define KVSTEP_ONE(r) "vbroadcastss (%1),%%" r "\n"
#define KVSTEP_ONES                                            \
  KVSTEP_ONE("zmm0") KVSTEP_ONE("zmm1") KVSTEP_ONE("zmm2")     \
  KVSTEP_ONE("zmm3") KVSTEP_ONE("zmm4") KVSTEP_ONE("zmm5")     \
  KVSTEP_ONE("zmm6") KVSTEP_ONE("zmm7") KVSTEP_ONE("zmm8")     \
  KVSTEP_ONE("zmm9") KVSTEP_ONE("zmm10") KVSTEP_ONE("zmm11")   \
  KVSTEP_ONE("zmm12") KVSTEP_ONE("zmm13") KVSTEP_ONE("zmm14")  \
  KVSTEP_ONE("zmm15") KVSTEP_ONE("zmm28") KVSTEP_ONE("zmm29")  \
  KVSTEP_ONE("zmm30") KVSTEP_ONE("zmm31")
// clang-format on

// The loop: n steps of `body`, timed by the TSC.
#define KVSTEP_LOOP(name, body)                                               \
  __attribute__((noinline)) double name(int64_t n) {                          \
    const uint64_t t0 = __rdtsc();                                            \
    asm volatile(KVSTEP_ONES "mov %0, %%rcx\n1:\n" body "dec %%rcx\njnz 1b\n" \
                 :                                                            \
                 : "r"(n), "r"(g_buf)                                         \
                 : KVSTEP_CLOBBERS);                                          \
    return static_cast<double>(__rdtsc() - t0) / static_cast<double>(n);      \
  }

// 8 dependent adds a step: 8 cycles.
KVSTEP_LOOP(AddChain,
            "add %%rax,%%rax\nadd %%rax,%%rax\nadd %%rax,%%rax\nadd "
            "%%rax,%%rax\nadd %%rax,%%rax\nadd %%rax,%%rax\nadd "
            "%%rax,%%rax\nadd %%rax,%%rax\n")

// 16 independent accumulators (zmm0-15), twice a step.
#define KVSTEP_ACC16(op)                                             \
  op " %%zmm30,%%zmm31,%%zmm0\n" op " %%zmm30,%%zmm31,%%zmm1\n" op   \
     " %%zmm30,%%zmm31,%%zmm2\n" op " %%zmm30,%%zmm31,%%zmm3\n" op   \
     " %%zmm30,%%zmm31,%%zmm4\n" op " %%zmm30,%%zmm31,%%zmm5\n" op   \
     " %%zmm30,%%zmm31,%%zmm6\n" op " %%zmm30,%%zmm31,%%zmm7\n" op   \
     " %%zmm30,%%zmm31,%%zmm8\n" op " %%zmm30,%%zmm31,%%zmm9\n" op   \
     " %%zmm30,%%zmm31,%%zmm10\n" op " %%zmm30,%%zmm31,%%zmm11\n" op \
     " %%zmm30,%%zmm31,%%zmm12\n" op " %%zmm30,%%zmm31,%%zmm13\n" op \
     " %%zmm30,%%zmm31,%%zmm14\n" op " %%zmm30,%%zmm31,%%zmm15\n"
#define KVSTEP_FMA32 KVSTEP_ACC16("vfmadd231ps") KVSTEP_ACC16("vfmadd231ps")
#define KVSTEP_DOT32 KVSTEP_ACC16("vdpbf16ps") KVSTEP_ACC16("vdpbf16ps")

// 8 of an instruction into zmm16-23: `pre` is everything before the
// destination register, which follows as %%zmm16 ... %%zmm23. Where the
// destination is also a source (VPERMT2B, VPTERNLOGD), each register
// chains one or two of them a step, a few cycles against the step's 16 or
// more, so the rows time throughput, not latency.
#define KVSTEP_X8(pre)                                                \
  pre "%%zmm16\n" pre "%%zmm17\n" pre "%%zmm18\n" pre "%%zmm19\n" pre \
      "%%zmm20\n" pre "%%zmm21\n" pre "%%zmm22\n" pre "%%zmm23\n"

// One row: the instruction 8 and 16 times a step beside 32 FMAs and 32
// dots.
#define KVSTEP_ROW(id, pre)                                           \
  KVSTEP_LOOP(Fma8_##id, KVSTEP_X8(pre) KVSTEP_FMA32)                 \
  KVSTEP_LOOP(Fma16_##id, KVSTEP_X8(pre) KVSTEP_X8(pre) KVSTEP_FMA32) \
  KVSTEP_LOOP(Dot8_##id, KVSTEP_X8(pre) KVSTEP_DOT32)                 \
  KVSTEP_LOOP(Dot16_##id, KVSTEP_X8(pre) KVSTEP_X8(pre) KVSTEP_DOT32)

KVSTEP_LOOP(FmaAlone, KVSTEP_FMA32)
KVSTEP_LOOP(DotAlone, KVSTEP_DOT32)

// Shuffles and lookups.
KVSTEP_ROW(permt2b, "vpermt2b %%zmm29,%%zmm28,")
KVSTEP_ROW(permb, "vpermb %%zmm29,%%zmm28,")
KVSTEP_ROW(permw, "vpermw %%zmm29,%%zmm28,")
KVSTEP_ROW(pshufb, "vpshufb %%zmm29,%%zmm28,")
KVSTEP_ROW(valignd, "valignd $3,%%zmm29,%%zmm28,")
KVSTEP_ROW(vshufi64x2, "vshufi64x2 $0x4e,%%zmm29,%%zmm28,")
KVSTEP_ROW(pmovzxbw, "vpmovzxbw %%ymm28,")
KVSTEP_ROW(cvtph2ps, "vcvtph2ps %%ymm28,")
// Integer arithmetic and logic.
KVSTEP_ROW(pmaddubsw, "vpmaddubsw %%zmm29,%%zmm28,")
KVSTEP_ROW(pmullw, "vpmullw %%zmm29,%%zmm28,")
KVSTEP_ROW(punpcklbw, "vpunpcklbw %%zmm29,%%zmm28,")
KVSTEP_ROW(pternlogd, "vpternlogd $0xf8,%%zmm29,%%zmm28,")
KVSTEP_ROW(psrlw, "vpsrlw $4,%%zmm28,")
KVSTEP_ROW(pslld, "vpslld $16,%%zmm28,")
KVSTEP_ROW(paddw, "vpaddw %%zmm29,%%zmm28,")
KVSTEP_ROW(pandd, "vpandd %%zmm29,%%zmm28,")
// Loads from L1.
KVSTEP_ROW(movups, "vmovups (%1),")
KVSTEP_ROW(broadcastss, "vbroadcastss (%1),")
KVSTEP_ROW(broadcastf32x4, "vbroadcastf32x4 (%1),")
KVSTEP_ROW(broadcastf64x4, "vbroadcastf64x4 (%1),")

// The dot columns need AVX512-BF16 (Main checks it for all rows).
struct Row {
  const char* name;
  bool needs_vbmi;
  double (*fma8)(int64_t);
  double (*fma16)(int64_t);
  double (*dot8)(int64_t);
  double (*dot16)(int64_t);
};

#define KVSTEP_R(id, needs_vbmi) \
  { #id, needs_vbmi, Fma8_##id, Fma16_##id, Dot8_##id, Dot16_##id }

const Row kRows[] = {
    KVSTEP_R(permt2b, true),         KVSTEP_R(permb, true),
    KVSTEP_R(permw, false),          KVSTEP_R(pshufb, false),
    KVSTEP_R(valignd, false),        KVSTEP_R(vshufi64x2, false),
    KVSTEP_R(pmovzxbw, false),       KVSTEP_R(cvtph2ps, false),
    KVSTEP_R(pmaddubsw, false),      KVSTEP_R(pmullw, false),
    KVSTEP_R(punpcklbw, false),      KVSTEP_R(pternlogd, false),
    KVSTEP_R(psrlw, false),          KVSTEP_R(pslld, false),
    KVSTEP_R(paddw, false),          KVSTEP_R(pandd, false),
    KVSTEP_R(movups, false),         KVSTEP_R(broadcastss, false),
    KVSTEP_R(broadcastf32x4, false), KVSTEP_R(broadcastf64x4, false),
};

int Main(int argc, char** argv) {
  int rounds = 5;
  int64_t iterations = 2000000;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--rounds=", 0) == 0) {
      rounds = std::atoi(a.c_str() + 9);
    } else if (a.rfind("--iterations=", 0) == 0) {
      iterations = std::atoll(a.c_str() + 13);
    } else {
      std::fprintf(stderr, "unknown flag %s (see the top of %s)\n", a.c_str(),
                   __FILE__);
      return 2;
    }
  }
  if (rounds < 1 || iterations < 1000) {
    std::fprintf(stderr, "--rounds must be >= 1 and --iterations >= 1000\n");
    return 2;
  }
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") ||
      !__builtin_cpu_supports("avx512bw")) {
    std::fprintf(stderr, "this CPU has no AVX-512 F and BW\n");
    return kNoAvx512;
  }
  std::fill(std::begin(g_buf), std::end(g_buf), kOnes);
  const bool vbmi = __builtin_cpu_supports("avx512vbmi");
  const bool bf16 = __builtin_cpu_supports("avx512bf16");
  // TSC ticks a core cycle, from the add chain; the best of the rounds
  // for every figure.
  auto best = [&](double (*fn)(int64_t)) {
    double b = 1e300;
    for (int r = 0; r < rounds; ++r) b = std::min(b, fn(iterations));
    return b;
  };
  best(AddChain);                          // warms the core's clock up
  const double tick = best(AddChain) / 8;  // TSC ticks a cycle
  auto cycles = [&](double (*fn)(int64_t)) { return best(fn) / tick; };
  const double fma = cycles(FmaAlone);
  const double dot = bf16 ? cycles(DotAlone) : 0;
  char dot_alone[32] = "skipped (no AVX512-BF16)";
  if (bf16) std::snprintf(dot_alone, sizeof(dot_alone), "%.2f", dot);
  std::printf(
      "cycles a step: 32 VFMADD231PS alone %.2f, 32 VDPBF16PS alone %s; "
      "then each instruction 8 and 16 times beside them (+ what it adds)\n",
      fma, dot_alone);
  std::printf("%-16s %14s %14s %14s %14s\n", "instruction", "8 + fma",
              "16 + fma", "8 + dot", "16 + dot");
  auto cell = [](double c, double base) {
    char s[32];
    std::snprintf(s, sizeof(s), "%.2f (%+.2f)", c, c - base);
    return std::string(s);
  };
  for (const Row& row : kRows) {
    if (row.needs_vbmi && !vbmi) {
      std::printf("%-16s skipped (no AVX512-VBMI)\n", row.name);
      continue;
    }
    const std::string f8 = cell(cycles(row.fma8), fma);
    const std::string f16 = cell(cycles(row.fma16), fma);
    const std::string d8 = bf16 ? cell(cycles(row.dot8), dot) : "-";
    const std::string d16 = bf16 ? cell(cycles(row.dot16), dot) : "-";
    std::printf("%-16s %14s %14s %14s %14s\n", row.name, f8.c_str(),
                f16.c_str(), d8.c_str(), d16.c_str());
  }
  return 0;
}

#else

int Main(int, char**) {
  std::fprintf(stderr, "pipe_bench needs an x86-64 CPU with AVX-512\n");
  return kNoAvx512;
}

#endif

}  // namespace
}  // namespace kvstep

int main(int argc, char** argv) { return kvstep::Main(argc, argv); }
