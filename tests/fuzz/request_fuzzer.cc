// request_fuzzer: libFuzzer target over request parsing and validation.
//
// An input is a sequence of calls, each framed as
//   [1 byte: which RPC (kvstep::Rpc, modulo kNumRpcs)][2 bytes little-endian:
//   n][n bytes: the request proto]
// and run against a fresh server-side stack (KvStepService over a small
// Engine, no network), once with the default block order and once with
// BlockOrder::kRuns. Whatever the bytes, no call may crash, and after every
// call the Engine's invariants must hold (every block free or owned with
// the right count, batch tables mirroring their sequences); a broken
// invariant aborts, which libFuzzer reports as a crash.
//
// Built two ways: with -fsanitize=fuzzer (KVSTEP_FUZZ=ON, scripts/fuzz.sh),
// and in every build linked with replay_main.cc, which runs the committed
// corpus as a regression test.
#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "core/engine.h"
#include "core/log.h"
#include "service/kvstep_service.h"
#include "service/rpc.h"

namespace kvstep {
namespace {

std::unique_ptr<Engine> NewEngine(BlockOrder order) {
  EngineOptions o;
  o.block_order = order;
  o.cache.num_blocks = 64;
  o.cache.block_size = 4;
  o.cache.num_layers = 2;
  o.cache.num_kv_heads = 2;
  o.cache.head_size = 32;
  o.cache.dtype = DType::kFloat16;
  o.num_host_blocks = 16;
  o.attention_threads = 1;
  o.limits.max_seq_len = 256;
  o.limits.max_batch_rows = 16;
  o.limits.max_batch_tokens = 256;
  o.limits.max_sequences = 64;
  o.limits.max_batches = 8;
  o.limits.max_sessions = 4;
  absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
  if (!e.ok()) std::abort();
  return *std::move(e);
}

template <typename Req, typename Resp, typename Method>
void Call(KvStepService* service, Method method, const uint8_t* data,
          size_t size) {
  Req req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return;
  Resp resp;
  grpc::ServerContext ctx;
  const grpc::Status status = (service->*method)(&ctx, &req, &resp);
  // KVSTEP_FUZZ_VERBOSE=1 shows what each call did (to check that a seed
  // reaches the success paths).
  static const bool verbose = std::getenv("KVSTEP_FUZZ_VERBOSE") != nullptr;
  if (verbose) {
    std::fprintf(stderr, "%s: %d %s\n", Req::descriptor()->name().c_str(),
                 static_cast<int>(status.error_code()),
                 status.error_message().c_str());
  }
}

void RunCalls(const uint8_t* data, size_t size, BlockOrder order) {
  std::unique_ptr<Engine> engine = NewEngine(order);
  ServiceOptions options;
  options.max_message_bytes = 1 << 20;
  KvStepService service(engine.get(), options);
  KvStepService* s = &service;
  while (size >= 3) {
    // The first byte names the RPC, as service/rpc.h numbers them.
    const auto rpc = static_cast<kvstep::Rpc>(data[0] % kvstep::kNumRpcs);
    size_t n = static_cast<size_t>(data[1]) | static_cast<size_t>(data[2]) << 8;
    data += 3;
    size -= 3;
    if (n > size) n = size;
    switch (rpc) {
      case Rpc::kAllocateBlocks:
        kvstep::Call<v1::AllocateBlocksRequest, v1::AllocateBlocksResponse>(
            s, &KvStepService::AllocateBlocks, data, n);
        break;
      case Rpc::kFreeSequences:
        kvstep::Call<v1::FreeSequencesRequest, v1::FreeSequencesResponse>(
            s, &KvStepService::FreeSequences, data, n);
        break;
      case Rpc::kCreateBatch:
        kvstep::Call<v1::CreateBatchRequest, v1::CreateBatchResponse>(
            s, &KvStepService::CreateBatch, data, n);
        break;
      case Rpc::kGetBatch:
        kvstep::Call<v1::GetBatchRequest, v1::GetBatchResponse>(
            s, &KvStepService::GetBatch, data, n);
        break;
      case Rpc::kReleaseBatches:
        kvstep::Call<v1::ReleaseBatchesRequest, v1::ReleaseBatchesResponse>(
            s, &KvStepService::ReleaseBatches, data, n);
        break;
      case Rpc::kAdvanceStep:
        kvstep::Call<v1::AdvanceStepRequest, v1::AdvanceStepResponse>(
            s, &KvStepService::AdvanceStep, data, n);
        break;
      case Rpc::kPagedAttention:
        kvstep::Call<v1::PagedAttentionRequest, v1::PagedAttentionResponse>(
            s, &KvStepService::PagedAttention, data, n);
        break;
      case Rpc::kForkSequence:
        kvstep::Call<v1::ForkSequenceRequest, v1::ForkSequenceResponse>(
            s, &KvStepService::ForkSequence, data, n);
        break;
      case Rpc::kCanAllocate:
        kvstep::Call<v1::AllocateBlocksRequest, v1::CanAllocateResponse>(
            s, &KvStepService::CanAllocate, data, n);
        break;
      case Rpc::kSwapOut:
        kvstep::Call<v1::SwapRequest, v1::SwapResponse>(
            s, &KvStepService::SwapOut, data, n);
        break;
      case Rpc::kSwapIn:
        kvstep::Call<v1::SwapRequest, v1::SwapResponse>(
            s, &KvStepService::SwapIn, data, n);
        break;
      case Rpc::kResetPrefixCache:
        kvstep::Call<v1::ResetPrefixCacheRequest, v1::ResetPrefixCacheResponse>(
            s, &KvStepService::ResetPrefixCache, data, n);
        break;
      case Rpc::kOpenSession:
        kvstep::Call<v1::OpenSessionRequest, v1::OpenSessionResponse>(
            s, &KvStepService::OpenSession, data, n);
        break;
      case Rpc::kCloseSession:
        kvstep::Call<v1::CloseSessionRequest, v1::CloseSessionResponse>(
            s, &KvStepService::CloseSession, data, n);
        break;
      case Rpc::kGetServerInfo:
        kvstep::Call<v1::GetServerInfoRequest, v1::GetServerInfoResponse>(
            s, &KvStepService::GetServerInfo, data, n);
        break;
      case Rpc::kKeepAlive:
        kvstep::Call<v1::KeepAliveRequest, v1::KeepAliveResponse>(
            s, &KvStepService::KeepAlive, data, n);
        break;
      case Rpc::kSubscribeKvEvents:
        break;  // a stream that runs until cancelled: not fuzzed here
      // A fuzzed call has no unix peer, so Register is refused before any
      // path is opened (a fuzzer must not open files); Unregister and the
      // shm fields of PagedAttention then meet an empty registry.
      case Rpc::kRegisterSharedMemory:
        kvstep::Call<v1::RegisterSharedMemoryRequest,
                     v1::RegisterSharedMemoryResponse>(
            s, &KvStepService::RegisterSharedMemory, data, n);
        break;
      case Rpc::kUnregisterSharedMemory:
        kvstep::Call<v1::UnregisterSharedMemoryRequest,
                     v1::UnregisterSharedMemoryResponse>(
            s, &KvStepService::UnregisterSharedMemory, data, n);
        break;
    }
    data += n;
    size -= n;
    if (absl::Status st = engine->CheckInvariants(); !st.ok()) {
      std::fprintf(stderr, "invariant broken after %s (block order %s): %s\n",
                   RpcName(rpc), std::string(BlockOrderName(order)).c_str(),
                   st.ToString().c_str());
      std::abort();
    }
  }
}

}  // namespace
}  // namespace kvstep

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvstep::SetLogLevel(kvstep::LogLevel::kError);
  for (kvstep::BlockOrder order :
       {kvstep::BlockOrder::kDescending, kvstep::BlockOrder::kRuns}) {
    kvstep::RunCalls(data, size, order);
  }
  return 0;
}
