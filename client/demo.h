// RunDemo: a small scheduler loop against a kvstep server, the project's
// main job. It allocates blocks for a few prompts, creates their prefill
// batch, then runs decode steps (grow blocks, AdvanceStep with sampled
// tokens) and prints what happened and how long every call took, next to a
// bare GetServerInfo round trip measured in the same run. Each step also runs
// layer 0's PagedAttention (random float32 activations, GQA 4) through the
// server. It ends by freeing everything and checking that every block came
// back.
#ifndef KVSTEP_CLIENT_DEMO_H_
#define KVSTEP_CLIENT_DEMO_H_

#include <cstdint>
#include <ostream>
#include <random>

#include "absl/status/status.h"
#include "client/client.h"

namespace kvstep {

struct DemoOptions {
  int64_t num_seqs = 5;
  int64_t prompt_len = 195;  // seed 003's five 195-token prompts
  int64_t steps = 8;
  uint64_t first_seq_id = 1000;
  int64_t ping_rounds = 200;  // for the latency baseline
  uint64_t seed = 1;
};

absl::Status RunDemo(Client& client, const DemoOptions& options,
                     std::ostream& out);

// Random float32 activations [n, heads, head_size], uniform in [-1, 1), as
// the demo sends PagedAttention (and rpc_bench --prefill_tokens).
v1::Tensor RandomActivations(std::mt19937_64& rng, int64_t n, int64_t heads,
                             int64_t head_size);

}  // namespace kvstep

#endif  // KVSTEP_CLIENT_DEMO_H_
