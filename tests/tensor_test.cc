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
