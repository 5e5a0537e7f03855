#include "core/traffic.h"

#include <cstdio>
#include <cstdlib>
#include <utility>

namespace kvstep {

Traffic::Traffic(SequenceManager* seqs)
    : seqs_(seqs), block_size_(seqs->block_size()) {}

Traffic::Traffic(BlockAllocator* alloc, int64_t block_size, bool pass_length)
    : alloc_(alloc), block_size_(block_size), pass_length_(pass_length) {}

Traffic::Live* Traffic::Admit(int64_t prompt, SeqId* id) {
  const SeqId sid = next_;
  Live q;
  if (!Grow(sid, &q, prompt)) return nullptr;
  ++next_;
  q.tokens = q.target = prompt;
  if (id != nullptr) *id = sid;
  return &live_.emplace(sid, std::move(q)).first->second;
}

int64_t Traffic::Step() {
  int64_t grown = 0;
  for (auto it = live_.begin(); it != live_.end();) {
    Live& q = it->second;
    if (q.tokens < q.target) {
      if (Grow(it->first, &q, q.tokens + 1)) {
        ++q.tokens;
        ++grown;
      } else if (q.preemptible) {
        Drop(it->first, &q);
        ++preempted_;
        it = live_.erase(it);
        continue;
      }
    }
    if (!q.stays && q.tokens == q.target) {
      Drop(it->first, &q);
      it = live_.erase(it);
      continue;
    }
    ++it;
  }
  return grown;
}

const std::vector<BlockId>& Traffic::Table(SeqId id) const {
  if (seqs_ != nullptr) return seqs_->Find(id)->blocks;
  return live_.at(id).table;
}

bool Traffic::Fits(const absl::Status& st) {
  if (st.ok() || absl::IsResourceExhausted(st)) return st.ok();
  // Any other refusal (a length past max_seq_len, say) is the simulation's
  // setup, which waiting or preempting would hide.
  std::fprintf(stderr, "Traffic: %s\n", st.ToString().c_str());
  std::abort();
}

bool Traffic::Grow(SeqId id, Live* q, int64_t tokens) {
  const int64_t blocks = (tokens + block_size_ - 1) / block_size_;
  if (seqs_ == nullptr) {
    const int64_t need = blocks - static_cast<int64_t>(q->table.size());
    if (need <= 0) return true;
    const BlockId after =
        q->table.empty() ? BlockAllocator::kNone : q->table.back();
    return Fits(alloc_->Allocate(need, &q->table, after,
                                 pass_length_ ? blocks : int64_t{0}));
  }
  // Growth within the blocks a sequence holds takes no call (Allocate
  // would take no block; the tables come out the same): that is most steps
  // of most sequences, whose calls were most of a large pool's replay
  // (attention_bench, 8192 keys x 256 rows: about 8 s of a 23 s case).
  // Otherwise it marks the tokens as planned (num_tokens), as a server's
  // step would, which keeps Allocate's copy-on-write scan to the new ones.
  if (Sequence* s = seqs_->Find(id);
      s != nullptr && blocks <= static_cast<int64_t>(s->blocks.size())) {
    s->num_tokens = tokens;
    return true;
  }
  out_.clear();
  if (!Fits(seqs_->Allocate({{id, tokens}}, &out_))) return false;
  seqs_->Find(id)->num_tokens = tokens;
  return true;
}

void Traffic::Drop(SeqId id, Live* q) {
  if (seqs_ != nullptr) {
    int64_t freed = 0;
    std::vector<BatchId> batches;
    if (!seqs_->Free(id, &freed, &batches)) std::abort();  // a live id
    return;
  }
  // Release fails only for ids the pool does not hold as owned, which a
  // table it handed out cannot be.
  if (!alloc_->Release(q->table).ok()) std::abort();
  q->table.clear();
}

void CountAdjacent(absl::Span<const BlockId> table, int64_t* pairs,
                   int64_t* consecutive) {
  for (size_t i = 1; i < table.size(); ++i) {
    ++*pairs;
    *consecutive += table[i] == table[i - 1] + 1;
  }
}

}  // namespace kvstep
