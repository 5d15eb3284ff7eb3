// The gRPC fixture shared by the worker service tests: a WorkerService over
// a WorkerCore, a SequenceStore and a RecordingDevice (CPU compute that
// records batches), served on an in-process channel, plus helpers that build
// requests and K/V chunks.
#pragma once

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/health_check.h"
#include "common/status_matchers.h"
#include "kernels/numeric.h"
#include "triax/v1/manager.grpc.pb.h"
#include "worker/convert.h"
#include "worker/health_reporter.h"
#include "worker/manager_link.h"
#include "worker/recording_device.h"
#include "worker/tier_store.h"
#include "worker/worker_service.h"

namespace triax::worker {
namespace {

using ::testing::HasSubstr;
using triax::testing::IsOk;
using triax::testing::StatusIs;

constexpr char kTenant[] = "tenant-a";

// Expects `s` to have `code` and a message containing `field`.
#define EXPECT_CODE(s, code, field)                         \
  do {                                                      \
    const grpc::Status _s = (s);                            \
    EXPECT_EQ(_s.error_code(), code) << _s.error_message(); \
    EXPECT_THAT(_s.error_message(), HasSubstr(field));      \
  } while (0)

v1::ModelShape Model(uint32_t layers = 2, uint32_t kv = 2, uint32_t q = 4,
                     uint32_t d = 32) {
  v1::ModelShape m;
  m.set_name("test");
  m.set_n_layers(layers);
  m.set_n_kv_heads(kv);
  m.set_n_q_heads(q);
  m.set_head_dim(d);
  return m;
}

v1::AllocatePagesRequest AllocRequest(const std::string& seq, uint32_t tokens,
                                      v1::Format format = v1::FORMAT_INT4,
                                      const std::string& request_id = "") {
  v1::AllocatePagesRequest r;
  r.set_request_id(request_id);
  r.set_tenant_id(kTenant);
  r.set_sequence_id(seq);
  *r.mutable_model() = Model();
  r.set_block_tokens(16);
  uint32_t i = 0;
  for (uint32_t first = 0; first < tokens; first += 16, ++i) {
    v1::BlockPlan* b = r.add_blocks();
    b->set_index(i);
    b->set_lineage_id(1000 + i);
    b->set_first_token(first);
    b->set_num_tokens(std::min(16u, tokens - first));
    b->set_capacity(16);
    b->set_format(format);
  }
  return r;
}

// ImportSequence of sequence "s" (`tokens` tokens, blocks in `format`,
// window 4, timeout 5 s) from the worker at `source_address`.
v1::ImportSequenceRequest ImportRequestFrom(
    const std::string& source_address, uint32_t tokens,
    v1::Format format = v1::FORMAT_INT4) {
  const v1::AllocatePagesRequest plan = AllocRequest("s", tokens, format);
  v1::ImportSequenceRequest r;
  r.set_request_id("imp-1");
  r.set_transfer_id("t-1");
  r.set_tenant_id(kTenant);
  r.set_sequence_id("s");
  *r.mutable_model() = plan.model();
  r.set_block_tokens(plan.block_tokens());
  r.set_window_tokens(4);
  *r.mutable_blocks() = plan.blocks();
  r.set_source_address(source_address);
  r.set_source_worker_id("worker-a");
  r.set_timeout_ms(5000);
  return r;
}

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> x(n);
  for (float& f : x) f = dist(rng);
  return x;
}

std::string F32Bytes(const float* p, size_t n) {
  return std::string(reinterpret_cast<const char*>(p), n * 4);
}

v1::KvChunk F32Chunk(uint32_t layer, uint64_t first, uint32_t n,
                     const std::vector<float>& k, const std::vector<float>& v,
                     size_t per_token = 64) {
  v1::KvChunk c;
  c.set_layer(layer);
  c.set_first_token(first);
  c.set_num_tokens(n);
  c.set_dtype(v1::KV_DTYPE_F32);
  c.set_k(F32Bytes(k.data() + first * per_token, n * per_token));
  c.set_v(F32Bytes(v.data() + first * per_token, n * per_token));
  return c;
}

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto a = PageAllocator::Create(&device_, 4 << 20);
    ASSERT_TRUE(a.ok());
    alloc_ = *std::move(a);
    store_ = std::make_unique<SequenceStore>(&device_, alloc_.get(), Options());
    core_ = std::make_unique<WorkerCore>(store_.get(), &device_);
    service_ = std::make_unique<WorkerService>(core_.get());
    // As kvworker's main does: the server then serves grpc.health.v1.Health.
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::Worker::NewStub(channel_);
  }
  void TearDown() override {
    server_->Shutdown();
    server_.reset();
    service_.reset();
    core_.reset();
    store_.reset();
    alloc_.reset();
  }
  virtual StoreOptions Options() { return StoreOptions{4}; }

  grpc::Status Allocate(const v1::AllocatePagesRequest& r,
                        v1::AllocatePagesResponse* resp = nullptr) {
    grpc::ClientContext ctx;
    v1::AllocatePagesResponse local;
    return stub_->AllocatePages(&ctx, r, resp ? resp : &local);
  }
  std::string Inventory() {
    grpc::ClientContext ctx;
    v1::Inventory inv;
    EXPECT_TRUE(
        stub_->GetInventory(&ctx, v1::GetInventoryRequest(), &inv).ok());
    return inv.SerializeAsString();
  }
  grpc::Status Write(const std::vector<v1::WriteKVRequest>& msgs,
                     v1::WriteKVResponse* resp = nullptr) {
    grpc::ClientContext ctx;
    v1::WriteKVResponse local;
    auto writer = stub_->WriteKV(&ctx, resp ? resp : &local);
    for (const auto& m : msgs) {
      if (!writer->Write(m)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }
  v1::WriteKVRequest WriteMsg(const std::string& seq, v1::KvChunk chunk,
                              const std::string& request_id = "",
                              const std::string& tenant = kTenant) {
    v1::WriteKVRequest m;
    m.set_request_id(request_id);
    m.set_tenant_id(tenant);
    m.set_sequence_id(seq);
    *m.mutable_chunk() = std::move(chunk);
    return m;
  }
  grpc::Status Read(const v1::ReadKVRequest& r, std::vector<v1::KvChunk>* out) {
    grpc::ClientContext ctx;
    auto reader = stub_->ReadKV(&ctx, r);
    v1::KvChunk c;
    while (reader->Read(&c)) out->push_back(c);
    return reader->Finish();
  }
  grpc::Status Free(const std::string& seq, const std::string& request_id = "",
                    const std::string& tenant = kTenant,
                    v1::FreePagesResponse* resp = nullptr) {
    grpc::ClientContext ctx;
    v1::FreePagesRequest r;
    r.set_request_id(request_id);
    r.set_tenant_id(tenant);
    r.set_sequence_id(seq);
    v1::FreePagesResponse local;
    return stub_->FreePages(&ctx, r, resp ? resp : &local);
  }
  grpc::Status Fork(const v1::WorkerForkRequest& r,
                    v1::WorkerForkResponse* resp = nullptr) {
    grpc::ClientContext ctx;
    v1::WorkerForkResponse local;
    return stub_->ForkSequence(&ctx, r, resp ? resp : &local);
  }

  // A sequence "s" of 40 int4 tokens with the first `written` written.
  void MakeWritten(uint64_t written, std::vector<float>* k,
                   std::vector<float>* v) {
    ASSERT_TRUE(Allocate(AllocRequest("s", 40)).ok());
    *k = Random(size_t{40} * 64, 1);
    *v = Random(size_t{40} * 64, 2);
    for (uint32_t l = 0; l < 2; ++l) {
      ASSERT_TRUE(Write({WriteMsg("s", F32Chunk(l, 0, written, *k, *v))}).ok());
    }
  }

  RecordingDevice device_;  // CPU compute, records batches
  std::unique_ptr<PageAllocator> alloc_;
  std::unique_ptr<SequenceStore> store_;
  std::unique_ptr<WorkerCore> core_;
  std::unique_ptr<WorkerService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Worker::Stub> stub_;
};

}  // namespace
}  // namespace triax::worker
