#include "client/demo.h"

#include <algorithm>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/block_tables.h"

namespace kvstep {
namespace {

double Micros(absl::Time since) {
  return absl::ToDoubleMicroseconds(absl::Now() - since);
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Layer 0's attention for the batch's current tokens: this step's K/V go
// into the cache, and every row attends over its context. Returns the time.
absl::StatusOr<double> Attend(Client& client, std::mt19937_64& rng,
                              uint64_t batch, int64_t tokens,
                              const v1::CacheGeometry& g) {
  v1::PagedAttentionRequest req;
  req.set_batch_id(batch);
  req.set_layer(0);
  // 4 query heads per KV head (GQA), as in the benchmarks.
  *req.mutable_query() =
      RandomActivations(rng, tokens, 4 * g.num_kv_heads(), g.head_size());
  *req.mutable_key() =
      RandomActivations(rng, tokens, g.num_kv_heads(), g.head_size());
  *req.mutable_value() =
      RandomActivations(rng, tokens, g.num_kv_heads(), g.head_size());
  const absl::Time t = absl::Now();
  absl::StatusOr<v1::PagedAttentionResponse> r = client.PagedAttention(req);
  if (!r.ok()) return r.status();
  return absl::ToDoubleMicroseconds(absl::Now() - t);
}

std::string Show(const v1::Tensor& t, size_t max_items = 8) {
  absl::StatusOr<std::vector<int64_t>> v = IndexTensorValues(t);
  if (!v.ok()) return "?";
  std::string s = absl::StrJoin(
      v->begin(), v->begin() + std::min(max_items, v->size()), ", ");
  if (v->size() > max_items) absl::StrAppend(&s, ", ... (", v->size(), ")");
  return "[" + s + "]";
}

}  // namespace

v1::Tensor RandomActivations(std::mt19937_64& rng, int64_t n, int64_t heads,
                             int64_t head_size) {
  std::uniform_real_distribution<float> uni(-1, 1);
  std::vector<float> v(static_cast<size_t>(n * heads * head_size));
  for (float& x : v) x = uni(rng);
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_FLOAT32);
  t.add_shape(n);
  t.add_shape(heads);
  t.add_shape(head_size);
  t.set_data(
      std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4));
  return t;
}

absl::Status RunDemo(Client& client, const DemoOptions& o, std::ostream& out) {
  std::mt19937_64 rng(o.seed);
  std::uniform_int_distribution<int64_t> token(0, 50271);  // opt-125m vocab

  absl::StatusOr<v1::GetServerInfoResponse> info = client.GetServerInfo();
  if (!info.ok()) return info.status();
  const v1::CacheGeometry& g = info->geometry();
  const int64_t free_before = info->free_blocks();
  out << absl::StrFormat(
      "server %s (instance %s): %d blocks of %d tokens, %d layers, %d KV "
      "heads x %d, %s free-list order, %d free\n",
      info->version(), info->server_instance_id(), g.num_blocks(),
      g.block_size(), g.num_layers(), g.num_kv_heads(), g.head_size(),
      info->block_order(), free_before);

  // 0. A session: if this process dies, the server frees what it held.
  const bool own_session = client.session_id() == 0;
  if (own_session) {
    absl::StatusOr<v1::OpenSessionResponse> session =
        client.OpenSession(absl::Seconds(30), "kvstep-cli demo");
    if (!session.ok()) return session.status();
    out << absl::StrFormat("session %d (ttl %d ms)\n", session->session_id(),
                           session->ttl_ms());
  }

  // 1. Blocks for the prompts plus the first generated token.
  std::vector<uint64_t> ids;
  std::vector<std::pair<uint64_t, int64_t>> want;
  for (int64_t i = 0; i < o.num_seqs; ++i) {
    ids.push_back(o.first_seq_id + static_cast<uint64_t>(i));
    want.emplace_back(ids.back(), o.prompt_len + 1);
  }
  absl::Time t = absl::Now();
  absl::StatusOr<v1::AllocateBlocksResponse> alloc =
      client.AllocateBlocks(want);
  if (!alloc.ok()) return alloc.status();
  out << absl::StrFormat("AllocateBlocks: %d sequences x %d tokens, %.0f us\n",
                         o.num_seqs, o.prompt_len + 1, Micros(t));
  for (const v1::SequenceBlocks& s : alloc->sequences()) {
    std::vector<int64_t> table(s.block_table().begin(), s.block_table().end());
    out << absl::StrFormat("  seq %d: %d blocks [%s]\n", s.seq_id(),
                           table.size(), absl::StrJoin(table, ", "));
  }
  // The scheduler's copy of the tables: the decode steps' reservations
  // leave them out of the replies (omit_appended_tables).
  BlockTables tables;
  if (absl::Status s = tables.Apply(*alloc); !s.ok()) return s;

  // 2. The prefill batch.
  v1::CreateBatchRequest create;
  for (uint64_t id : ids) {
    v1::BatchRow* row = create.add_rows();
    row->set_seq_id(id);
    for (int64_t j = 0; j < o.prompt_len; ++j) row->add_token_ids(token(rng));
  }
  create.set_return_tensors(true);
  create.set_block_table_width((o.prompt_len + o.steps) / g.block_size() + 1);
  t = absl::Now();
  absl::StatusOr<v1::CreateBatchResponse> batch = client.CreateBatch(create);
  if (!batch.ok()) return batch.status();
  const v1::BatchTensors& bt = batch->tensors();
  out << absl::StrFormat(
      "CreateBatch: batch %d, %d prefill rows, %d prefill tokens, %.0f us\n"
      "  seq_lens %s, query_start_loc %s\n  slot_mapping %s\n",
      batch->batch_id(), bt.num_prefills(), bt.num_prefill_tokens(), Micros(t),
      Show(bt.seq_lens()), Show(bt.query_start_loc()),
      Show(bt.slot_mapping(), 6));
  absl::StatusOr<double> attn =
      Attend(client, rng, batch->batch_id(), bt.num_prefill_tokens(), g);
  if (!attn.ok()) return attn.status();
  out << absl::StrFormat(
      "PagedAttention (layer 0, prefill, %d tokens, %d query heads): %.0f us\n",
      bt.num_prefill_tokens(), 4 * g.num_kv_heads(), *attn);

  // 3. Decode steps: the model ran and sampled; grow the blocks for the next
  // token, then advance the server-held state.
  std::vector<double> alloc_us, advance_us, attention_us;
  std::vector<int64_t> seq_lens(ids.size(), o.prompt_len);
  for (int64_t step = 1; step <= o.steps; ++step) {
    v1::AllocateBlocksRequest reserve;
    reserve.set_omit_appended_tables(true);
    for (size_t i = 0; i < ids.size(); ++i) {
      v1::SequenceAllocation* a = reserve.add_sequences();
      a->set_seq_id(ids[i]);
      a->set_num_tokens(seq_lens[i] + 1);
    }
    t = absl::Now();
    alloc = client.AllocateBlocks(reserve);
    if (!alloc.ok()) return alloc.status();
    alloc_us.push_back(Micros(t));
    if (absl::Status s = tables.Apply(*alloc); !s.ok()) return s;

    std::vector<int64_t> sampled(ids.size());
    for (int64_t& s : sampled) s = token(rng);
    v1::AdvanceStepRequest adv;
    adv.set_batch_id(batch->batch_id());
    *adv.mutable_sampled_token_ids() =
        MakeIndexTensor(sampled, {static_cast<int64_t>(sampled.size()), 1});
    adv.set_return_tensors(true);
    // Exactly once: the step number makes a retry safe.
    adv.set_step(step);
    t = absl::Now();
    absl::StatusOr<v1::AdvanceStepResponse> r = client.AdvanceStep(adv);
    if (!r.ok()) return r.status();
    advance_us.push_back(Micros(t));
    if (step == 1) {
      // As if the reply had been lost: the retry must not advance again.
      absl::StatusOr<v1::AdvanceStepResponse> again = client.AdvanceStep(adv);
      if (!again.ok()) return again.status();
      if (again->step() != r->step() ||
          again->tensors().input_positions().data() !=
              r->tensors().input_positions().data()) {
        return absl::InternalError("a retried step advanced again");
      }
      out << "retry of step 1: same reply, not advanced again\n";
    }
    // The batch's table rows are the tables the client keeps, zero-padded.
    absl::StatusOr<std::vector<int64_t>> rows =
        IndexTensorValues(r->tensors().block_tables());
    if (!rows.ok()) return rows.status();
    const size_t width = rows->size() / ids.size();
    for (size_t i = 0; i < ids.size(); ++i) {
      if (!tables.MatchesRow(
              ids[i], absl::MakeConstSpan(*rows).subspan(i * width, width))) {
        return absl::InternalError(absl::StrFormat(
            "step %d: the batch's table of seq %d is not the one the client "
            "kept from AllocateBlocks",
            step, ids[i]));
      }
    }
    for (int64_t& len : seq_lens) ++len;
    attn = Attend(client, rng, batch->batch_id(),
                  static_cast<int64_t>(ids.size()), g);
    if (!attn.ok()) return attn.status();
    attention_us.push_back(*attn);
    out << absl::StrFormat(
        "step %d: positions %s slots %s seq_lens %s  (AllocateBlocks %.0f us, "
        "AdvanceStep %.0f us, PagedAttention %.0f us)\n",
        r->step(), Show(r->tensors().input_positions()),
        Show(r->tensors().slot_mapping()), Show(r->tensors().seq_lens()),
        alloc_us.back(), advance_us.back(), attention_us.back());
  }

  // 4. Baseline: the cheapest round trip the server has.
  std::vector<double> ping_us;
  for (int64_t i = 0; i < o.ping_rounds; ++i) {
    t = absl::Now();
    if (absl::Status s = client.GetServerInfo().status(); !s.ok()) return s;
    ping_us.push_back(Micros(t));
  }

  // 5. Free everything and check nothing leaked.
  uint64_t bid = batch->batch_id();
  if (absl::Status s = client.ReleaseBatches({&bid, 1}).status(); !s.ok()) {
    return s;
  }
  absl::StatusOr<v1::FreeSequencesResponse> freed = client.FreeSequences(ids);
  if (!freed.ok()) return freed.status();
  const double ping = Median(ping_us);
  out << absl::StrFormat(
      "the client's tables (kept from replies without them) matched the "
      "batch's at every step\n");
  out << absl::StrFormat(
      "median over %d steps: AllocateBlocks %.0f us (%.2fx ping), AdvanceStep "
      "%.0f us (%.2fx ping); GetServerInfo ping %.0f us (%d rounds)\n",
      o.steps, Median(alloc_us), Median(alloc_us) / ping, Median(advance_us),
      Median(advance_us) / ping, ping, o.ping_rounds);
  out << absl::StrFormat("freed %d sequences, %d blocks; %d free (was %d)\n",
                         freed->freed_seq_ids_size(), freed->blocks_freed(),
                         freed->free_blocks(), free_before);
  if (freed->free_blocks() != free_before) {
    return absl::InternalError("blocks leaked: the free count did not return");
  }
  if (own_session) {
    if (absl::Status s = client.CloseSession().status(); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace kvstep
