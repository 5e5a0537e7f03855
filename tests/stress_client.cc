// stress_client: one scheduler-like client for process_test. It opens a
// session and runs random operations (allocate with shared prompt stems,
// grow, fork, batch, PagedAttention and numbered AdvanceStep with retries,
// free) against a kvstep server until --iterations are done (then it frees
// everything and closes its session) or until it is killed (then the
// server must reclaim everything when the session lapses). Several of
// them run at once, so one client's control calls meet another's
// attention kernel in flight (Engine: the kernel runs outside the lock,
// on pinned blocks).
//
// The server's cache must be float16 with 1 KV head of head size 16 (as
// process_test makes it). Every K and V element any client writes is in
// (-1, 1), and every slot attention reads was written by some client or
// is still zero, so every output element is a weighted mean of values in
// [-1, 1]: a reply with one outside (or an Inf or NaN) is a wrong one.
//
//   stress_client --target=unix:/tmp/k.sock --seed=3 --iterations=300
//
// It keeps its sequences' block tables as a scheduler would (BlockTables,
// growing them with omit_appended_tables) and checks each batch's
// block_tables against them.
//
// Exit 0 when every reply was one a correct server may give; 1 otherwise.
// RESOURCE_EXHAUSTED is expected (the pool is shared and small).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "client/block_tables.h"
#include "client/client.h"

ABSL_FLAG(std::string, target, "", "server address");
ABSL_FLAG(uint64_t, seed, 1, "random seed; also spreads the sequence ids");
ABSL_FLAG(int64_t, iterations, 200, "operations (0: until killed)");
ABSL_FLAG(int64_t, ttl_ms, 1000, "session TTL");

namespace {

int Bad(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "stress_client: %s: %s\n", what.c_str(),
               s.ToString().c_str());
  return 1;
}

bool Tolerated(const absl::Status& s) {
  return s.ok() || s.code() == absl::StatusCode::kResourceExhausted;
}

// A FLOAT16 [n, heads, 16] tensor of random values in (-1, 1): exponents
// up to 14 (2^-1), so no bit pattern reaches 1.0 (0x3c00).
kvstep::v1::Tensor RandomHalves(std::mt19937_64& rng, int64_t n,
                                int64_t heads) {
  kvstep::v1::Tensor t;
  t.set_dtype(kvstep::v1::DTYPE_FLOAT16);
  t.add_shape(n);
  t.add_shape(heads);
  t.add_shape(16);
  std::string bytes(static_cast<size_t>(n * heads * 16 * 2), '\0');
  for (size_t i = 0; i < bytes.size(); i += 2) {
    const auto h = static_cast<uint16_t>((rng() & 0x8000) | (rng() % 0x3c00));
    std::memcpy(&bytes[i], &h, 2);
  }
  t.set_data(std::move(bytes));
  return t;
}

// Whether `out` is FLOAT16 [n, 2, 16] with every element in [-1, 1] (an
// Inf or NaN has a larger magnitude's bits).
bool MeansOfValues(const kvstep::v1::Tensor& out, int64_t n) {
  if (out.dtype() != kvstep::v1::DTYPE_FLOAT16 || out.shape_size() != 3 ||
      out.shape(0) != n || out.shape(1) != 2 || out.shape(2) != 16 ||
      static_cast<int64_t>(out.data().size()) != n * 2 * 16 * 2) {
    return false;
  }
  for (size_t i = 0; i < out.data().size(); i += 2) {
    uint16_t h;
    std::memcpy(&h, out.data().data() + i, 2);
    if ((h & 0x7fff) > 0x3c00) return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  const int64_t iterations = absl::GetFlag(FLAGS_iterations);
  std::mt19937_64 rng(seed);
  auto client = kvstep::Client::Connect(absl::GetFlag(FLAGS_target));
  if (absl::Status s = client->WaitForReady(absl::Seconds(10)); !s.ok()) {
    return Bad("connect", s);
  }
  absl::StatusOr<kvstep::v1::OpenSessionResponse> session =
      client->OpenSession(absl::Milliseconds(absl::GetFlag(FLAGS_ttl_ms)),
                          absl::StrCat("stress ", seed));
  if (!session.ok()) return Bad("OpenSession", session.status());

  // Ids unique to this client: sessions may not share sequences.
  uint64_t next_id = seed << 32;
  // Per live sequence: tokens it holds, and tokens computed (in the cache).
  std::vector<uint64_t> live;
  std::vector<int64_t> lens;
  std::vector<int64_t> computed;
  kvstep::BlockTables tables;
  for (int64_t it = 0; iterations == 0 || it < iterations; ++it) {
    const int op = static_cast<int>(rng() % 10);
    if (op < 4 || live.empty()) {
      // A new sequence whose prompt shares a stem with others (prefix hits
      // across sessions).
      kvstep::v1::AllocateBlocksRequest req;
      kvstep::v1::SequenceAllocation* a = req.add_sequences();
      a->set_seq_id(++next_id);
      const int64_t len = 1 + static_cast<int64_t>(rng() % 120);
      for (int64_t t = 0; t < len; ++t) {
        a->add_prompt_token_ids(t < 32 ? t : static_cast<int64_t>(rng() % 50));
      }
      a->set_num_tokens(len + 1);
      absl::StatusOr<kvstep::v1::AllocateBlocksResponse> r =
          client->AllocateBlocks(req);
      if (!Tolerated(r.status())) return Bad("AllocateBlocks", r.status());
      if (r.ok()) {
        if (absl::Status s = tables.Apply(*r); !s.ok()) {
          return Bad("AllocateBlocks' table", s);
        }
        live.push_back(a->seq_id());
        lens.push_back(len);
        computed.push_back(r->sequences(0).computed_tokens());
      }
    } else if (op < 5) {
      const size_t k = rng() % live.size();
      const uint64_t child = ++next_id;
      absl::StatusOr<kvstep::v1::ForkSequenceResponse> r =
          client->ForkSequence(live[k], {&child, 1});
      if (!Tolerated(r.status())) return Bad("ForkSequence", r.status());
      if (r.ok()) {
        if (absl::Status s = tables.ApplyFork(*r); !s.ok()) {
          return Bad("ForkSequence's table", s);
        }
        live.push_back(child);
        lens.push_back(lens[k]);
        computed.push_back(computed[k]);
      }
    } else if (op < 8) {
      // One row on a sequence (the rest of its prompt, or one decode token):
      // grow it (copy-on-write when shared), batch it, and take three
      // numbered steps, retrying each once.
      const size_t k = rng() % live.size();
      kvstep::v1::AllocateBlocksRequest grow;
      grow.set_omit_appended_tables(true);
      grow.add_sequences()->set_seq_id(live[k]);
      grow.mutable_sequences(0)->set_num_tokens(lens[k] + 4);
      absl::StatusOr<kvstep::v1::AllocateBlocksResponse> g =
          client->AllocateBlocks(grow);
      if (!Tolerated(g.status())) return Bad("grow", g.status());
      if (!g.ok()) continue;
      if (absl::Status s = tables.Apply(*g); !s.ok()) {
        return Bad("grow's table", s);
      }
      kvstep::v1::CreateBatchRequest cb;
      cb.set_return_tensors(true);
      kvstep::v1::BatchRow* row = cb.add_rows();
      row->set_seq_id(live[k]);
      if (computed[k] < lens[k]) {
        for (int64_t t = computed[k]; t < lens[k]; ++t) row->add_token_ids(7);
        row->set_num_cached_tokens(computed[k]);
      } else {
        row->add_token_ids(7);
        row->set_num_cached_tokens(lens[k]);
        ++lens[k];
      }
      absl::StatusOr<kvstep::v1::CreateBatchResponse> b =
          client->CreateBatch(cb);
      if (!b.ok()) return Bad("CreateBatch", b.status());
      // The batch's table row is the sequence's table, zero-padded.
      absl::StatusOr<std::vector<int64_t>> row_table =
          kvstep::IndexTensorValues(b->tensors().block_tables());
      if (!row_table.ok() || !tables.MatchesRow(live[k], *row_table)) {
        const std::vector<int64_t>* known = tables.Find(live[k]);
        return Bad(
            "CreateBatch",
            absl::InternalError(absl::StrCat(
                "block_tables ", b->tensors().block_tables().ShortDebugString(),
                " is not the table this client keeps (",
                known == nullptr ? 0 : known->size(), " blocks)")));
      }
      for (int64_t step = 1; step <= 3; ++step) {
        // The step's forward pass: its tokens' K/V written, attention over
        // the row (2 query heads over the 1 KV head).
        const int64_t n = step == 1 ? row->token_ids_size() : 1;
        kvstep::v1::PagedAttentionRequest attn;
        attn.set_batch_id(b->batch_id());
        *attn.mutable_query() = RandomHalves(rng, n, 2);
        *attn.mutable_key() = RandomHalves(rng, n, 1);
        *attn.mutable_value() = RandomHalves(rng, n, 1);
        absl::StatusOr<kvstep::v1::PagedAttentionResponse> out =
            client->PagedAttention(attn);
        if (!out.ok()) return Bad("PagedAttention", out.status());
        if (!MeansOfValues(out->out(), n)) {
          return Bad("PagedAttention",
                     absl::InternalError(absl::StrCat(
                         "an output that is not a mean of the values: ",
                         out->out().ShortDebugString().substr(0, 200))));
        }
        kvstep::v1::AdvanceStepRequest adv;
        adv.set_batch_id(b->batch_id());
        adv.set_step(step);
        *adv.mutable_sampled_token_ids() = kvstep::MakeIndexTensor({9}, {1, 1});
        for (int attempt = 0; attempt < 2; ++attempt) {
          absl::StatusOr<kvstep::v1::AdvanceStepResponse> r =
              client->AdvanceStep(adv);
          if (!r.ok()) return Bad("AdvanceStep", r.status());
          if (r->step() != step) {
            return Bad("AdvanceStep", absl::InternalError("wrong step"));
          }
        }
      }
      // Three steps: their input tokens' K/V are (being) written, and the
      // next token goes after them.
      lens[k] += 3;
      computed[k] = lens[k];
      uint64_t bid = b->batch_id();
      if (absl::Status s = client->ReleaseBatches({&bid, 1}).status();
          !s.ok()) {
        return Bad("ReleaseBatches", s);
      }
    } else {
      const size_t k = rng() % live.size();
      absl::StatusOr<kvstep::v1::FreeSequencesResponse> r =
          client->FreeSequences({&live[k], 1});
      if (!r.ok()) return Bad("FreeSequences", r.status());
      if (r->freed_seq_ids_size() != 1) {
        return Bad("FreeSequences", absl::InternalError("not freed"));
      }
      tables.Forget({&live[k], 1});
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
      lens.erase(lens.begin() + static_cast<std::ptrdiff_t>(k));
      computed.erase(computed.begin() + static_cast<std::ptrdiff_t>(k));
    }
  }
  if (!live.empty()) {
    absl::StatusOr<kvstep::v1::FreeSequencesResponse> r =
        client->FreeSequences(live);
    if (!r.ok()) return Bad("final FreeSequences", r.status());
  }
  absl::StatusOr<kvstep::v1::CloseSessionResponse> closed =
      client->CloseSession();
  if (!closed.ok()) return Bad("CloseSession", closed.status());
  if (closed->sequences_freed() != 0) {
    return Bad("CloseSession",
               absl::InternalError("the session still held sequences"));
  }
  return 0;
}
