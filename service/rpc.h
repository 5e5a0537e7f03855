// The KvStep RPCs as an enum, for per-RPC metrics and logs.
#ifndef KVSTEP_SERVICE_RPC_H_
#define KVSTEP_SERVICE_RPC_H_

namespace kvstep {

enum class Rpc : int {
  kGetServerInfo,
  kAllocateBlocks,
  kFreeSequences,
  kCreateBatch,
  kGetBatch,
  kReleaseBatches,
  kAdvanceStep,
  kPagedAttention,
  kForkSequence,
  kCanAllocate,
  kSwapOut,
  kSwapIn,
  kResetPrefixCache,
  kSubscribeKvEvents,
  kOpenSession,
  kKeepAlive,
  kCloseSession,
  kRegisterSharedMemory,
  kUnregisterSharedMemory,
};
inline constexpr int kNumRpcs =
    static_cast<int>(Rpc::kUnregisterSharedMemory) + 1;

// The method name as in the proto ("AllocateBlocks").
inline const char* RpcName(Rpc rpc) {
  static constexpr const char* kNames[kNumRpcs] = {"GetServerInfo",
                                                   "AllocateBlocks",
                                                   "FreeSequences",
                                                   "CreateBatch",
                                                   "GetBatch",
                                                   "ReleaseBatches",
                                                   "AdvanceStep",
                                                   "PagedAttention",
                                                   "ForkSequence",
                                                   "CanAllocate",
                                                   "SwapOut",
                                                   "SwapIn",
                                                   "ResetPrefixCache",
                                                   "SubscribeKvEvents",
                                                   "OpenSession",
                                                   "KeepAlive",
                                                   "CloseSession",
                                                   "RegisterSharedMemory",
                                                   "UnregisterSharedMemory"};
  return kNames[static_cast<int>(rpc)];
}

}  // namespace kvstep

#endif  // KVSTEP_SERVICE_RPC_H_
