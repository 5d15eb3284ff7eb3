#include "bench/transfer/bench_worker.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "kernels/numeric.h"

namespace triax::bench {
namespace {

namespace v1 = triax::v1;

std::chrono::system_clock::time_point In(absl::Duration d) {
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d);
}

}  // namespace

KvPattern KvPattern::Make(const BenchShape& shape, uint32_t chunk_tokens,
                          uint32_t seed) {
  KvPattern p;
  p.chunk_tokens = chunk_tokens;
  const size_t values =
      size_t{chunk_tokens} * shape.n_kv_heads * shape.head_dim;
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  for (std::string* out : {&p.k, &p.v}) {
    std::vector<uint16_t> bf16(values);
    for (uint16_t& x : bf16) x = kernels::FloatToBf16(dist(rng));
    out->assign(reinterpret_cast<const char*>(bf16.data()), values * 2);
  }
  return p;
}

v1::ModelShape ModelProto(const BenchShape& shape) {
  v1::ModelShape m;
  m.set_name("llama3-8b-shape");
  m.set_n_layers(shape.n_layers);
  m.set_n_kv_heads(shape.n_kv_heads);
  m.set_n_q_heads(shape.n_q_heads);
  m.set_head_dim(shape.head_dim);
  return m;
}

google::protobuf::RepeatedPtrField<v1::BlockPlan> MakePlan(
    uint32_t tokens, const BenchShape& shape,
    const std::vector<kernels::Encoding>& encodings, uint64_t first_lineage) {
  google::protobuf::RepeatedPtrField<v1::BlockPlan> plan;
  const uint32_t t = shape.block_tokens;
  for (uint32_t first = 0, i = 0; first < tokens; first += t, ++i) {
    const kernels::Encoding& e = encodings[i];
    v1::BlockPlan* b = plan.Add();
    b->set_index(i);
    b->set_lineage_id(first_lineage + i);
    b->set_first_token(first);
    b->set_num_tokens(std::min(t, tokens - first));
    b->set_capacity(t);
    b->set_format(static_cast<v1::Format>(e.k));
    if (e.v != e.k) b->set_format_v(static_cast<v1::Format>(e.v));
    b->set_group_size(static_cast<uint32_t>(e.group));
    if (e.scale_dtype == kernels::ScaleDtype::kFP8) {
      b->set_scale_dtype(v1::SCALE_DTYPE_FP8_E4M3);
    }
  }
  return plan;
}

absl::StatusOr<std::unique_ptr<BenchWorker>> BenchWorker::Start(
    const std::string& id, const WorkerLaunch& launch, const std::string& dir) {
  std::vector<std::string> args = {
      "--listen=127.0.0.1:0", absl::StrCat("--worker_id=", id),
      absl::StrCat("--backend=", launch.backend),
      absl::StrCat("--pool_mb=", launch.pool_mb), "--host_tier_mb=0"};
  args.insert(args.end(), launch.extra_flags.begin(), launch.extra_flags.end());
  auto process =
      testing::Process::Start(id, "kvworker", args, dir,
                              /*with_port_file=*/true, absl::Seconds(60));
  if (!process.ok()) return process.status();
  std::unique_ptr<BenchWorker> w(new BenchWorker());
  w->id_ = id;
  w->process_ = *std::move(process);
  if (!launch.cpus.empty()) {
    absl::Status s =
        PinProcess(w->process_->pid(), launch.cpus, launch.cpus_flag);
    if (!s.ok()) return s;
  }
  grpc::ChannelArguments ch;
  ch.SetMaxReceiveMessageSize(64 << 20);
  w->stub_ = v1::Worker::NewStub(grpc::CreateCustomChannel(
      w->process_->address(), grpc::InsecureChannelCredentials(), ch));
  return w;
}

absl::Status BenchWorker::Allocate(
    const std::string& sequence_id, const BenchShape& shape,
    const google::protobuf::RepeatedPtrField<v1::BlockPlan>& plan) {
  v1::AllocatePagesRequest r;
  r.set_tenant_id(kTenant);
  r.set_sequence_id(sequence_id);
  *r.mutable_model() = ModelProto(shape);
  r.set_block_tokens(shape.block_tokens);
  *r.mutable_blocks() = plan;
  r.set_window_tokens(0);
  grpc::ClientContext ctx;
  ctx.set_deadline(In(absl::Seconds(120)));
  v1::AllocatePagesResponse resp;
  return FromGrpcStatus(stub_->AllocatePages(&ctx, r, &resp));
}

absl::Status BenchWorker::WriteLayer(const std::string& sequence_id,
                                     uint32_t layer, uint32_t tokens,
                                     const KvPattern& pattern) {
  grpc::ClientContext ctx;
  ctx.set_deadline(In(absl::Seconds(600)));
  v1::WriteKVResponse resp;
  auto writer = stub_->WriteKV(&ctx, &resp);
  const size_t token_bytes = pattern.k.size() / pattern.chunk_tokens;
  v1::WriteKVRequest m;
  m.set_tenant_id(kTenant);
  m.set_sequence_id(sequence_id);
  v1::KvChunk* c = m.mutable_chunk();
  c->set_layer(layer);
  c->set_dtype(v1::KV_DTYPE_BF16);
  for (uint32_t first = 0; first < tokens; first += pattern.chunk_tokens) {
    const uint32_t n = std::min(pattern.chunk_tokens, tokens - first);
    c->set_first_token(first);
    c->set_num_tokens(n);
    c->set_k(pattern.k.data(), n * token_bytes);
    c->set_v(pattern.v.data(), n * token_bytes);
    if (!writer->Write(m)) break;  // Finish says why
  }
  writer->WritesDone();
  absl::Status s = FromGrpcStatus(writer->Finish());
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("WriteKV on ", id_, " layer ",
                                               layer, ": ", s.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ImportSequenceResponse> BenchWorker::Import(
    const v1::ImportSequenceRequest& request) {
  grpc::ClientContext ctx;
  const uint32_t timeout_ms =
      request.timeout_ms() == 0 ? 10000 : request.timeout_ms();
  ctx.set_deadline(In(absl::Milliseconds(timeout_ms) + absl::Seconds(30)));
  v1::ImportSequenceResponse resp;
  absl::Status s = FromGrpcStatus(stub_->ImportSequence(&ctx, request, &resp));
  if (!s.ok()) {
    return absl::Status(
        s.code(), absl::StrCat("ImportSequence on ", id_, ": ", s.message()));
  }
  return resp;
}

absl::Status BenchWorker::Free(const std::string& sequence_id) {
  v1::FreePagesRequest r;
  r.set_tenant_id(kTenant);
  r.set_sequence_id(sequence_id);
  grpc::ClientContext ctx;
  ctx.set_deadline(In(absl::Seconds(60)));
  v1::FreePagesResponse resp;
  return FromGrpcStatus(stub_->FreePages(&ctx, r, &resp));
}

}  // namespace triax::bench
