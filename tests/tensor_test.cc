#include "core/tensor.h"

#include <cstdint>
#include <cstring>

#include "gtest/gtest.h"

namespace kvstep {
namespace {

TEST(Tensor, ZerosIsZeroedAndAligned) {
  absl::StatusOr<Tensor> t =
      Tensor::Zeros(CpuDevice(), DType::kFloat16, {3, 5});
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->numel(), 15);
  EXPECT_EQ(t->nbytes(), 30u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t->raw_data()) % 64, 0u);
  const char* p = static_cast<const char*>(t->raw_data());
  for (size_t i = 0; i < t->nbytes(); ++i) ASSERT_EQ(p[i], 0);
}

TEST(Tensor, LargeAllocationsAreHugePageAligned) {
  absl::StatusOr<Tensor> t =
      Tensor::Zeros(CpuDevice(), DType::kFloat32, {1 << 20});
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t->raw_data()) % (2 << 20), 0u);
}

TEST(Tensor, FromHostBytesChecksTheLength) {
  const int64_t v[3] = {1, 2, 3};
  EXPECT_TRUE(
      Tensor::FromHostBytes(CpuDevice(), DType::kInt64, {3}, v, 24).ok());
  absl::StatusOr<Tensor> bad =
      Tensor::FromHostBytes(CpuDevice(), DType::kInt64, {4}, v, 24);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("needs 32 bytes, got 24"),
            std::string::npos);
}

TEST(Tensor, WrapHostBytesSharesTheCallersBytes) {
  alignas(8) float v[6] = {1, 2, 3, 4, 5, 6};
  {
    absl::StatusOr<Tensor> t =
        Tensor::WrapHostBytes(DType::kFloat32, {2, 3}, v, sizeof(v));
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->raw_data(), static_cast<void*>(v));
    EXPECT_EQ(t->DebugString(), "float32[2, 3]");
    EXPECT_EQ(t->data<float>()[4], 5.0f);
    t->data<float>()[1] = 9.0f;  // written through: the caller sees it
    v[5] = 7.0f;                 // and the tensor sees the caller's writes
    Tensor copy = *t;
    EXPECT_EQ(copy.data<float>()[5], 7.0f);
  }
  // The tensors are gone and did not free the caller's bytes (ASan would
  // report a free of stack memory).
  EXPECT_EQ(v[1], 9.0f);
}

TEST(Tensor, WrapHostBytesChecksTheLengthAndAlignment) {
  alignas(8) char bytes[32] = {};
  absl::StatusOr<Tensor> bad =
      Tensor::WrapHostBytes(DType::kFloat32, {4}, bytes, 12);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("needs 16 bytes, got 12"),
            std::string::npos)
      << bad.status();
  bad = Tensor::WrapHostBytes(DType::kFloat32, {4}, bytes + 2, 16);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("not aligned to 4"), std::string::npos)
      << bad.status();
  // Two-byte elements need two-byte alignment only.
  EXPECT_TRUE(Tensor::WrapHostBytes(DType::kFloat16, {8}, bytes + 2, 16).ok());
  EXPECT_EQ(
      Tensor::WrapHostBytes(DType::kInvalid, {1}, bytes, 1).status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(Tensor, RejectsNegativeAndOverflowingShapes) {
  EXPECT_EQ(Tensor::Zeros(CpuDevice(), DType::kInt32, {2, -1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      Tensor::FromHostBytes(CpuDevice(), DType::kInt32,
                            {int64_t{1} << 40, int64_t{1} << 40}, nullptr, 0)
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Tensor::Zeros(CpuDevice(), DType::kInvalid, {1}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Tensor, CloneIsIndependent) {
  Tensor a = Tensor::FromValues<int64_t>({2}, {{5, 6}});
  absl::StatusOr<Tensor> b = a.Clone();
  ASSERT_TRUE(b.ok());
  b->data<int64_t>()[0] = 9;
  EXPECT_EQ(a.data<int64_t>()[0], 5);
  EXPECT_EQ(b->DebugString(), "int64[2]");
}

TEST(DType, NamesRoundTrip) {
  for (int i = 1; i <= kMaxDType; ++i) {
    const DType d = static_cast<DType>(i);
    EXPECT_EQ(ParseDType(DTypeName(d)), d);
  }
  EXPECT_EQ(ParseDType("bf16"), DType::kBFloat16);
  EXPECT_EQ(ParseDType("nope"), DType::kInvalid);
}

}  // namespace
}  // namespace kvstep
