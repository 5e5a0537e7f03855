// Conversions between kvstep.v1 protos and core types, and absl::Status to
// grpc::Status. Every conversion from the wire validates what it reads (dtype
// in range, shape non-negative, byte length equal to the shape's) and names
// the field in its error. Thread-safe: pure functions.
#ifndef KVSTEP_SERVICE_CONVERT_H_
#define KVSTEP_SERVICE_CONVERT_H_

#include <grpcpp/support/status.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/engine.h"
#include "core/tensor.h"
#include "kvstep/v1/kvstep.pb.h"

namespace kvstep {

// absl and gRPC share the canonical codes; the message passes unchanged.
grpc::Status ToGrpcStatus(const absl::Status& status);

// An undefined Tensor when `present` is false; otherwise the decoded tensor
// on the CPU device, or INVALID_ARGUMENT naming `field`.
// A tensor's dtype (known) and shape (rank at most 8) from the wire, for
// decoders of its bytes wherever they are: INVALID_ARGUMENT naming `field`.
absl::Status TensorMetaFromProto(const v1::Tensor& proto,
                                 absl::string_view field, DType* dtype,
                                 Shape* shape);
absl::StatusOr<Tensor> TensorFromProto(const v1::Tensor& proto, bool present,
                                       absl::string_view field);
// As TensorFromProto, but over the proto's bytes where they are aligned to
// the element size (Tensor::WrapHostBytes; a copy where not): the proto
// must outlive the tensor and every copy of it, and nothing may write
// through it. For a request's bulk tensors, read within the call.
absl::StatusOr<Tensor> TensorViewOfProto(const v1::Tensor& proto, bool present,
                                         absl::string_view field);
void TensorToProto(const Tensor& tensor, v1::Tensor* proto);

DType DTypeFromProto(v1::DType dtype);  // kInvalid when out of range
v1::DType DTypeToProto(DType dtype);

// AllocateBlocks / CanAllocate requests: lookahead added (checked for
// overflow), adapter id and cache salt combined into the hash extra key.
absl::StatusOr<std::vector<SequenceRequest>> SequenceRequestsFromProto(
    const v1::AllocateBlocksRequest& req);
void SequenceBlocksToProto(const SequenceBlocks& s, int64_t block_size,
                           v1::SequenceBlocks* proto);
void BlockCopyToProto(const BlockCopy& c, v1::BlockCopy* proto);
void KvEventToProto(const KvEvent& e, v1::KvEvent* proto);
// The extra key of the block hashes: unambiguous for any adapter and salt.
std::string ExtraKey(absl::string_view adapter_id, absl::string_view salt);

void SnapshotToProto(const BatchSnapshot& snap, v1::BatchTensors* proto);
void FlashInferToProto(const FlashInferOutputs& fi,
                       v1::FlashInferTensors* proto);
void InfoToProto(const EngineInfo& info, int64_t max_message_bytes,
                 v1::GetServerInfoResponse* proto);

}  // namespace kvstep

#endif  // KVSTEP_SERVICE_CONVERT_H_
