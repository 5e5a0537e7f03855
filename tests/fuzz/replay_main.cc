// Runs request_fuzzer's LLVMFuzzerTestOneInput over files (or every file of
// directories) given on the command line: the committed corpus becomes a
// regression test in every build, sanitizers or not.
//
//   request_fuzzer_replay tests/fuzz/corpus
//   request_fuzzer_replay --write_seeds DIR   (writes the seed inputs)
#include <dirent.h>
#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "kvstep/v1/kvstep.pb.h"
#include "service/rpc.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

namespace v1 = kvstep::v1;
using kvstep::Rpc;

// One framed call: [rpc][n lo][n hi][n bytes].
void Frame(std::string* out, kvstep::Rpc rpc,
           const google::protobuf::Message& m) {
  const std::string body = m.SerializeAsString();
  out->push_back(static_cast<char>(rpc));
  out->push_back(static_cast<char>(body.size() & 0xff));
  out->push_back(static_cast<char>(body.size() >> 8));
  *out += body;
}

v1::Tensor Fp16(std::vector<int64_t> shape) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_FLOAT16);
  int64_t n = 1;
  for (int64_t d : shape) {
    t.add_shape(d);
    n *= d;
  }
  // 0x3c00 is 1.0 in fp16.
  std::string bytes;
  for (int64_t i = 0; i < n; ++i) bytes += std::string("\x00\x3c", 2);
  t.set_data(bytes);
  return t;
}

v1::Tensor I64(std::vector<int64_t> values, std::vector<int64_t> shape) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_INT64);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(std::string(reinterpret_cast<const char*>(values.data()),
                         values.size() * sizeof(int64_t)));
  return t;
}

// A scheduler's life: allocate with prompts, prefill batch, step, attend,
// fork, grow (copy-on-write), swap, free, release, reset.
std::string LifeSeed() {
  std::string s;
  v1::AllocateBlocksRequest a;
  v1::SequenceAllocation* s1 = a.add_sequences();
  s1->set_seq_id(1);
  s1->set_num_tokens(21);
  for (int i = 0; i < 20; ++i) s1->add_prompt_token_ids(i);
  a.add_sequences()->set_seq_id(2);
  a.mutable_sequences(1)->set_num_tokens(9);
  Frame(&s, Rpc::kAllocateBlocks, a);
  v1::CreateBatchRequest cb;
  v1::BatchRow* r1 = cb.add_rows();
  r1->set_seq_id(1);
  for (int i = 0; i < 20; ++i) r1->add_token_ids(i);
  v1::BatchRow* r2 = cb.add_rows();
  r2->set_seq_id(2);
  for (int i = 0; i < 8; ++i) r2->add_token_ids(i);
  cb.set_num_padding_rows(1);
  Frame(&s, Rpc::kCreateBatch, cb);
  v1::PagedAttentionRequest pa;
  pa.set_batch_id(1);
  *pa.mutable_query() = Fp16({29, 2, 32});
  *pa.mutable_key() = Fp16({29, 2, 32});
  *pa.mutable_value() = Fp16({29, 2, 32});
  Frame(&s, Rpc::kPagedAttention, pa);
  v1::AdvanceStepRequest adv;
  adv.set_batch_id(1);
  adv.set_step(1);
  adv.set_return_tensors(true);
  adv.set_flashinfer(true);
  *adv.mutable_sampled_token_ids() = I64({5, 6}, {2, 1});
  Frame(&s, Rpc::kAdvanceStep, adv);
  Frame(&s, Rpc::kAdvanceStep, adv);  // the retry
  *pa.mutable_query() = Fp16({3, 2, 32});
  *pa.mutable_key() = Fp16({3, 2, 32});
  *pa.mutable_value() = Fp16({3, 2, 32});
  Frame(&s, Rpc::kPagedAttention, pa);
  v1::ForkSequenceRequest fork;
  fork.set_parent_seq_id(1);
  fork.add_child_seq_ids(3);
  Frame(&s, Rpc::kForkSequence, fork);
  v1::AllocateBlocksRequest grow;
  grow.add_sequences()->set_seq_id(3);
  grow.mutable_sequences(0)->set_num_tokens(30);
  Frame(&s, Rpc::kAllocateBlocks, grow);
  Frame(&s, Rpc::kCanAllocate, grow);
  v1::GetBatchRequest gb;
  gb.set_batch_id(1);
  Frame(&s, Rpc::kGetBatch, gb);
  v1::SwapRequest swap;
  swap.add_seq_ids(2);
  Frame(&s, Rpc::kSwapOut, swap);
  Frame(&s, Rpc::kSwapIn, swap);
  v1::FreeSequencesRequest fr;
  fr.add_seq_ids(1);
  fr.add_seq_ids(77);
  Frame(&s, Rpc::kFreeSequences, fr);
  v1::ReleaseBatchesRequest rb;
  rb.add_batch_ids(1);
  Frame(&s, Rpc::kReleaseBatches, rb);
  Frame(&s, Rpc::kResetPrefixCache, v1::ResetPrefixCacheRequest());
  Frame(&s, Rpc::kGetServerInfo, v1::GetServerInfoRequest());
  return s;
}

std::string SessionSeed() {
  std::string s;
  v1::OpenSessionRequest open;
  open.set_ttl_ms(1000);
  open.set_name("fuzz");
  Frame(&s, Rpc::kOpenSession, open);
  v1::KeepAliveRequest ka;
  ka.set_session_id(12345);
  Frame(&s, Rpc::kKeepAlive, ka);
  v1::CloseSessionRequest close;
  close.set_session_id(12345);
  Frame(&s, Rpc::kCloseSession, close);
  v1::AdvanceStepRequest adv;
  v1::ExplicitStepState* e = adv.mutable_explicit_state();
  e->set_num_seqs(1);
  e->set_num_queries(1);
  e->set_block_size(4);
  *e->mutable_input_tokens() = I64({7}, {1});
  *e->mutable_input_positions() = I64({3}, {1});
  *e->mutable_seq_lens() = I64({4}, {1});
  *e->mutable_slot_mapping() = I64({3}, {1});
  *e->mutable_block_tables() = I64({0, 1}, {1, 2});
  *adv.mutable_sampled_token_ids() = I64({9}, {1, 1});
  Frame(&s, Rpc::kAdvanceStep, adv);
  return s;
}

int RunFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream data;
  data << in.rdbuf();
  const std::string bytes = data.str();
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()),
                         bytes.size());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--write_seeds") {
    const std::string dir = argv[2];
    std::ofstream(dir + "/life") << LifeSeed();
    std::ofstream(dir + "/session") << SessionSeed();
    return 0;
  }
  int runs = 0;
  for (int i = 1; i < argc; ++i) {
    struct stat st;
    if (stat(argv[i], &st) != 0) {
      std::fprintf(stderr, "cannot read %s\n", argv[i]);
      return 2;
    }
    if (!S_ISDIR(st.st_mode)) {
      runs += RunFile(argv[i]);
      continue;
    }
    DIR* d = opendir(argv[i]);
    for (dirent* e; (e = readdir(d)) != nullptr;) {
      if (e->d_name[0] == '.') continue;
      runs += RunFile(std::string(argv[i]) + "/" + e->d_name);
    }
    closedir(d);
  }
  // The generated seeds too, so that the test never runs on nothing.
  const std::string seeds[] = {LifeSeed(), SessionSeed()};
  for (const std::string& s : seeds) {
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()),
                           s.size());
    ++runs;
  }
  std::printf("replayed %d inputs: no crash, invariants held\n", runs);
  return 0;
}
