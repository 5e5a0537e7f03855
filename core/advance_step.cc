#include "core/advance_step.h"

#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/index_dispatch.h"

namespace kvstep {
namespace {

// Checks a tensor's dtype and exact shape; `allow_narrow` admits int32.
absl::Status CheckTensor(const Tensor& t, absl::string_view name,
                         bool allow_narrow, const Shape& want) {
  if (!t.defined()) {
    return absl::InvalidArgumentError(absl::StrCat(name, " is missing"));
  }
  if (t.dtype() != DType::kInt64 &&
      !(allow_narrow && t.dtype() == DType::kInt32)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s must be %s, got %s", name,
        allow_narrow ? "int32 or int64" : "int64", DTypeName(t.dtype())));
  }
  if (t.shape() != want) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s must have shape %s, got %s", name,
                        ShapeToString(want), ShapeToString(t.shape())));
  }
  return absl::OkStatus();
}

template <typename T>
constexpr int64_t MaxOf() {
  return static_cast<int64_t>(std::numeric_limits<T>::max());
}

// The typed kernel. Seq, Table and Slot are the element types of seq_lens,
// block_tables and slot_mapping.
template <typename Seq, typename Table, typename Slot>
class Stepper {
 public:
  Stepper(const AdvanceStepArgs& args, StepState* state)
      : args_(args),
        q_(state->input_tokens.rank() == 2 ? state->input_tokens.dim(1) : 1),
        width_(state->block_tables.dim(1)),
        tokens_(state->input_tokens.data<int64_t>()),
        positions_(state->input_positions.data<int64_t>()),
        seq_lens_(state->seq_lens.data<Seq>()),
        slots_(state->slot_mapping.data<Slot>()),
        tables_(state->block_tables.data<Table>()),
        sampled_(args.sampled_token_ids.data<int64_t>()),
        spec_(args.spec_token.defined() ? args.spec_token.data<int64_t>()
                                        : nullptr),
        accepted_(args.accepted_num.defined()
                      ? args.accepted_num.data<int64_t>()
                      : nullptr) {}

  absl::Status Validate() {
    for (int64_t i = 0; i < args_.num_queries; ++i) {
      int64_t first = 0;  // first position written for the row
      if (spec_ == nullptr) {
        if (sampled_[i] < 0) {
          return Invalid(i, absl::StrFormat("sampled_token_ids[%d][0] = %d is "
                                            "negative; token ids are >= 0",
                                            i, sampled_[i]));
        }
        first = static_cast<int64_t>(seq_lens_[i]);
        if (first < 0) {
          return Invalid(
              i, absl::StrFormat("seq_lens[%d] = %d is negative", i, first));
        }
      } else {
        const int64_t k = q_ - 1;
        const int64_t a = accepted_[i];
        if (a < 0 || a > k) {
          return Invalid(
              i, absl::StrFormat("accepted_num[%d] = %d is outside [0, %d]", i,
                                 a, k));
        }
        for (int64_t j = 0; j <= k; ++j) {
          if (sampled_[i * q_ + j] < 0) {
            return Invalid(
                i, absl::StrFormat("sampled_token_ids[%d][%d] = %d is negative",
                                   i, j, sampled_[i * q_ + j]));
          }
          if (j < k && spec_[i * k + j] < 0) {
            return Invalid(
                i, absl::StrFormat("spec_token[%d][%d] = %d is negative", i, j,
                                   spec_[i * k + j]));
          }
        }
        const int64_t p0 = positions_[i * q_];
        if (p0 < 0) {
          return Invalid(
              i, absl::StrFormat("input_positions[%d][0] = %d is negative", i,
                                 p0));
        }
        first = p0 + 1 + a;
      }
      // Positions first .. first+q-1 are written; the new seq_len is
      // first+q. Bound them well below overflow of any arithmetic here.
      if (first > (int64_t{1} << 62) || first + q_ > MaxOf<Seq>()) {
        return OutOfRange(
            i, absl::StrFormat("the new seq_len %d does not fit seq_lens "
                               "(%s)",
                               first + q_, DTypeName(DTypeOf<Seq>::value)));
      }
      for (int64_t j = 0; j < q_; ++j) {
        int64_t slot;
        if (auto s = SlotOf(i, first + j, &slot); !s.ok()) return s;
      }
      // Blocks FlashInfer will list for the row: ceil(new seq_len / bs).
      flashinfer_total_ +=
          (first + q_ + args_.block_size - 1) / args_.block_size;
    }
    if (flashinfer_total_ > MaxOf<int32_t>()) {
      return absl::OutOfRangeError(
          "paged_kv_indices would exceed 2^31 entries");
    }
    return absl::OkStatus();
  }

  // Allocates the FlashInfer outputs. REQUIRES: Validate() returned OK.
  absl::Status AllocateFlashInfer(FlashInferOutputs* out) const {
    const int64_t n = args_.num_seqs;
    const std::pair<Tensor*, int64_t> outs[] = {
        {&out->paged_kv_indptr, n + 1},
        {&out->paged_kv_indices, flashinfer_total_},
        {&out->paged_kv_last_page_len, n},
        {&out->block_table_bound, n}};
    for (const auto& [t, len] : outs) {
      absl::StatusOr<Tensor> z =
          Tensor::Zeros(CpuDevice(), DType::kInt32, {len});
      if (!z.ok()) return z.status();
      *t = *std::move(z);
    }
    return absl::OkStatus();
  }

  // REQUIRES: Validate() returned OK.
  void Apply() {
    for (int64_t i = 0; i < args_.num_queries; ++i) {
      int64_t first;
      if (spec_ == nullptr) {
        first = static_cast<int64_t>(seq_lens_[i]);
        tokens_[i] = sampled_[i];
      } else {
        const int64_t k = q_ - 1;
        const int64_t a = accepted_[i];
        first = positions_[i * q_] + 1 + a;
        tokens_[i * q_] = sampled_[i * q_ + a];
        for (int64_t j = 0; j < k; ++j)
          tokens_[i * q_ + 1 + j] = spec_[i * k + j];
      }
      for (int64_t j = 0; j < q_; ++j) {
        int64_t slot = 0;
        (void)SlotOf(i, first + j, &slot);
        positions_[i * q_ + j] = first + j;
        slots_[i * q_ + j] = static_cast<Slot>(slot);
      }
      seq_lens_[i] = static_cast<Seq>(first + q_);
    }
    // Padding rows (only outside speculative mode, where q == 1).
    for (int64_t i = args_.num_queries; i < args_.num_seqs; ++i) {
      tokens_[i] = 0;
      positions_[i] = 0;
      slots_[i] = static_cast<Slot>(-1);
    }
  }

  // REQUIRES: AllocateFlashInfer(out) and then Apply() ran.
  void FillFlashInfer(FlashInferOutputs* out) const {
    const int64_t bs = args_.block_size;
    int32_t* p = out->paged_kv_indptr.data<int32_t>();
    int32_t* idx = out->paged_kv_indices.data<int32_t>();
    int32_t* last = out->paged_kv_last_page_len.data<int32_t>();
    int32_t* bound = out->block_table_bound.data<int32_t>();
    // One prefix sum (vLLM's kernel recomputes it per thread).
    p[0] = 0;
    for (int64_t i = 0; i < args_.num_seqs; ++i) {
      int32_t b = 0;
      if (i < args_.num_queries) {
        const int64_t len = static_cast<int64_t>(seq_lens_[i]);
        b = static_cast<int32_t>((len + bs - 1) / bs);
        last[i] = static_cast<int32_t>((len - 1) % bs + 1);
        bound[i] = b;
        for (int32_t c = 0; c < b; ++c) {
          idx[p[i] + c] = static_cast<int32_t>(tables_[i * width_ + c]);
        }
      }
      p[i + 1] = p[i] + b;
    }
  }

 private:
  std::string Row(int64_t i) const {
    if (static_cast<size_t>(i) < args_.row_seq_ids.size()) {
      return absl::StrFormat("row %d (seq %d)", i, args_.row_seq_ids[i]);
    }
    return absl::StrFormat("row %d", i);
  }
  absl::Status Invalid(int64_t i, absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(Row(i), ": ", what));
  }
  absl::Status OutOfRange(int64_t i, absl::string_view what) const {
    return absl::OutOfRangeError(absl::StrCat(Row(i), ": ", what));
  }

  // The slot of position `pos` of row `i`, with every bound checked.
  absl::Status SlotOf(int64_t i, int64_t pos, int64_t* slot) const {
    const int64_t bs = args_.block_size;
    const int64_t c = pos / bs;
    if (c >= width_) {
      return OutOfRange(
          i, absl::StrFormat("position %d needs block_tables[%d][%d], but "
                             "block_tables has width %d",
                             pos, i, c, width_));
    }
    if (static_cast<size_t>(i) < args_.row_owned_blocks.size() &&
        c >= args_.row_owned_blocks[i]) {
      return OutOfRange(
          i, absl::StrFormat("position %d needs block %d of the sequence, "
                             "which owns %d blocks: call AllocateBlocks for "
                             "at least %d tokens first",
                             pos, c, args_.row_owned_blocks[i], pos + 1));
    }
    const int64_t block = static_cast<int64_t>(tables_[i * width_ + c]);
    if (block < 0 || (args_.num_blocks > 0 && block >= args_.num_blocks)) {
      return OutOfRange(
          i, absl::StrFormat("block_tables[%d][%d] = %d is not a block of the "
                             "pool [0, %d)",
                             i, c, block, args_.num_blocks));
    }
    if (static_cast<size_t>(block) < args_.block_ref_counts.size() &&
        args_.block_ref_counts[static_cast<size_t>(block)] > 1) {
      return absl::FailedPreconditionError(absl::StrCat(
          Row(i),
          absl::StrFormat(": position %d is in block %d of the sequence, "
                          "which is shared with another sequence: call "
                          "AllocateBlocks first (it copies the block)",
                          pos, c)));
    }
    int64_t s;
    if (__builtin_mul_overflow(block, bs, &s) ||
        __builtin_add_overflow(s, pos % bs, &s) || s > MaxOf<Slot>()) {
      return OutOfRange(
          i, absl::StrFormat("the slot of position %d in block %d does not "
                             "fit slot_mapping (%s)",
                             pos, block, DTypeName(DTypeOf<Slot>::value)));
    }
    *slot = s;
    return absl::OkStatus();
  }

  const AdvanceStepArgs& args_;
  const int64_t q_;  // tokens per row: 1, or 1 + spec_num
  const int64_t width_;
  int64_t* const tokens_;
  int64_t* const positions_;
  Seq* const seq_lens_;
  Slot* const slots_;
  const Table* const tables_;
  const int64_t* const sampled_;
  const int64_t* const spec_;
  const int64_t* const accepted_;
  int64_t flashinfer_total_ = 0;  // set by Validate()
};

absl::Status CheckShapes(const AdvanceStepArgs& a, const StepState& s) {
  if (a.block_size <= 0 || a.block_size > MaxOf<int32_t>()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "block_size must be in [1, 2^31), got %d", a.block_size));
  }
  if (a.num_seqs <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("num_seqs must be > 0, got %d", a.num_seqs));
  }
  if (a.num_queries <= 0 || a.num_queries > a.num_seqs) {
    return absl::InvalidArgumentError(
        absl::StrFormat("num_queries must be in [1, num_seqs=%d], got %d",
                        a.num_seqs, a.num_queries));
  }
  const int64_t n = a.num_seqs;
  const bool spec = a.spec_token.defined() || a.accepted_num.defined();
  int64_t q = 1;
  if (spec) {
    if (!a.spec_token.defined() || !a.accepted_num.defined()) {
      return absl::InvalidArgumentError(
          "speculative mode needs both spec_token and accepted_num");
    }
    if (a.num_queries != n) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "speculative mode needs num_queries == num_seqs, got %d and %d",
          a.num_queries, n));
    }
    if (a.spec_token.rank() != 2 || a.spec_token.dim(0) != n ||
        a.spec_token.dim(1) < 1) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "spec_token must have shape [num_seqs=%d, spec_num >= 1], got %s", n,
          ShapeToString(a.spec_token.shape())));
    }
    q = 1 + a.spec_token.dim(1);
    if (auto st = CheckTensor(a.spec_token, "spec_token", false, {n, q - 1});
        !st.ok()) {
      return st;
    }
    if (auto st = CheckTensor(a.accepted_num, "accepted_num", false, {n});
        !st.ok()) {
      return st;
    }
    if (auto st = CheckTensor(a.sampled_token_ids, "sampled_token_ids", false,
                              {n, q});
        !st.ok()) {
      return st;
    }
  } else if (auto st = CheckTensor(a.sampled_token_ids, "sampled_token_ids",
                                   false, {a.num_queries, 1});
             !st.ok()) {
    return st;
  }
  const Shape per_token = spec ? Shape{n, q} : Shape{n};
  if (auto st = CheckTensor(s.input_tokens, "input_tokens", false, per_token);
      !st.ok()) {
    return st;
  }
  if (auto st =
          CheckTensor(s.input_positions, "input_positions", false, per_token);
      !st.ok()) {
    return st;
  }
  if (auto st = CheckTensor(s.seq_lens, "seq_lens", true, {n}); !st.ok()) {
    return st;
  }
  if (auto st = CheckTensor(s.slot_mapping, "slot_mapping", true, per_token);
      !st.ok()) {
    return st;
  }
  if (!s.block_tables.defined() || s.block_tables.rank() != 2 ||
      s.block_tables.dim(0) != n || s.block_tables.dim(1) < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "block_tables must have shape [num_seqs=%d, W >= 1], got %s", n,
        s.block_tables.defined() ? ShapeToString(s.block_tables.shape())
                                 : "nothing"));
  }
  if (auto st = CheckTensor(s.block_tables, "block_tables", true,
                            s.block_tables.shape());
      !st.ok()) {
    return st;
  }
  for (const Tensor* t :
       {&s.input_tokens, &s.input_positions, &s.seq_lens, &s.slot_mapping,
        &s.block_tables, &a.sampled_token_ids, &a.spec_token,
        &a.accepted_num}) {
    if (t->defined() && !t->device()->host_accessible()) {
      return absl::UnimplementedError(
          "AdvanceStep on a non-host device is not implemented yet");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AdvanceStep(const AdvanceStepArgs& args, StepState* state,
                         FlashInferOutputs* flashinfer) {
  if (auto s = CheckShapes(args, *state); !s.ok()) return s;
  return DispatchIndex(state->seq_lens.dtype(), [&](auto seq) {
    return DispatchIndex(state->block_tables.dtype(), [&](auto table) {
      return DispatchIndex(state->slot_mapping.dtype(), [&](auto slot) {
        Stepper<decltype(seq), decltype(table), decltype(slot)> stepper(args,
                                                                        state);
        if (auto s = stepper.Validate(); !s.ok()) return s;
        // Outputs are allocated before the first write, so that running out
        // of memory cannot leave a half-applied step.
        FlashInferOutputs fi;
        if (flashinfer != nullptr) {
          if (auto s = stepper.AllocateFlashInfer(&fi); !s.ok()) return s;
        }
        stepper.Apply();
        if (flashinfer != nullptr) {
          stepper.FillFlashInfer(&fi);
          *flashinfer = std::move(fi);
        }
        return absl::OkStatus();
      });
    });
  });
}

}  // namespace kvstep
