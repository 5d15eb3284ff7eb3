// The gRPC fixture shared by the manager service tests: a ManagerService over
// a ManagerCore with a FakeClock, served on 127.0.0.1:0, and a stub.
#pragma once

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <functional>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "kvmanager/manager_service.h"
#include "triax/v1/manager.grpc.pb.h"
#include "triax/v1/worker.grpc.pb.h"

namespace triax::manager {
namespace {

using ::testing::HasSubstr;

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto core = ManagerCore::Create(Options(), &clock_);
    ASSERT_TRUE(core.ok()) << core.status();
    core_ = std::move(*core);
    service_ =
        std::make_unique<ManagerService>(core_.get(), /*check_interval_ms=*/0);
    service_->SetLimits(Limits());
    grpc::ServerBuilder builder;
    if (MaxMessageBytes() > 0) {
      builder.SetMaxReceiveMessageSize(MaxMessageBytes());
    }
    int& port = port_;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_NE(port, 0);
    stub_ = v1::Manager::NewStub(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                            grpc::InsecureChannelCredentials()));

    v1::RegisterWorkerRequest reg;
    reg.set_worker_id("w1");
    reg.set_address("127.0.0.1:9001");
    reg.set_backend("cpu");
    reg.set_capacity_bytes(1ull << 40);
    v1::RegisterWorkerResponse reg_resp;
    ASSERT_TRUE(Call(&v1::Manager::Stub::RegisterWorker, reg, &reg_resp).ok());
    for (const char* t : {"acme", "other"}) {
      v1::CreateTenantRequest ct;
      ct.set_tenant_id(t);
      auto* b = ct.add_budgets();
      b->set_tier(v1::TIER_DEVICE);
      b->set_ceiling_bytes(1 << 20);
      v1::CreateTenantResponse ct_resp;
      ASSERT_TRUE(Call(&v1::Manager::Stub::CreateTenant, ct, &ct_resp).ok());
    }
  }

  // What a fixture may change (limits tests): the core's options, the
  // service's limits, the server's largest request (0: gRPC's default).
  virtual ManagerOptions Options() const { return {}; }
  virtual ServiceLimits Limits() const { return {}; }
  virtual int MaxMessageBytes() const { return 0; }

  void TearDown() override {
    if (server_) server_->Shutdown();
    service_.reset();
  }

  template <typename Req, typename Resp>
  grpc::Status Call(grpc::Status (v1::Manager::Stub::*method)(
                        grpc::ClientContext*, const Req&, Resp*),
                    const Req& req, Resp* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    return (stub_.get()->*method)(&ctx, req, resp);
  }

  v1::OpenSequenceRequest OpenReq(const std::string& tenant = "acme") {
    v1::OpenSequenceRequest r;
    r.set_tenant_id(tenant);
    auto* m = r.mutable_model();
    m->set_n_layers(2);
    m->set_n_kv_heads(2);
    m->set_n_q_heads(4);
    m->set_head_dim(64);
    auto* s = r.add_spans();
    s->set_role(v1::ROLE_SYSTEM);
    s->set_num_tokens(20);
    s = r.add_spans();
    s->set_role(v1::ROLE_USER);
    s->set_num_tokens(12);
    return r;
  }

  std::string Open(const std::string& tenant = "acme") {
    v1::OpenSequenceResponse resp;
    grpc::Status s =
        Call(&v1::Manager::Stub::OpenSequence, OpenReq(tenant), &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp.sequence().sequence_id();
  }

  // A snapshot of everything a failed call must leave alone.
  std::string StateSnapshot() {
    v1::ListSequencesRequest ls;
    ls.set_include_closed(true);
    v1::ListSequencesResponse ls_resp;
    EXPECT_TRUE(Call(&v1::Manager::Stub::ListSequences, ls, &ls_resp).ok());
    v1::ListTenantsResponse lt_resp;
    EXPECT_TRUE(Call(&v1::Manager::Stub::ListTenants, v1::ListTenantsRequest(),
                     &lt_resp)
                    .ok());
    v1::ListWorkersResponse lw_resp;
    EXPECT_TRUE(Call(&v1::Manager::Stub::ListWorkers, v1::ListWorkersRequest(),
                     &lw_resp)
                    .ok());
    for (auto& w : *lw_resp.mutable_workers()) w.clear_last_heartbeat_unix_ms();
    v1::ListPoliciesResponse lp_resp;
    EXPECT_TRUE(Call(&v1::Manager::Stub::ListPolicies,
                     v1::ListPoliciesRequest(), &lp_resp)
                    .ok());
    return ls_resp.DebugString() + lt_resp.DebugString() +
           lw_resp.DebugString() + lp_resp.DebugString() +
           std::to_string(core_->events().next_id());
  }

  // "mixed": system k=fp8 v=int4 g=64, everything else int2.
  static v1::PutPolicyRequest PolicyReq() {
    v1::PutPolicyRequest r;
    r.mutable_policy()->set_name("mixed");
    auto* sys = r.mutable_policy()->add_rules();
    sys->set_role(v1::ROLE_SYSTEM);
    sys->set_format(v1::FORMAT_FP8_E4M3);
    sys->set_format_v(v1::FORMAT_INT4);
    sys->set_group_size(64);
    auto* rest = r.mutable_policy()->add_rules();
    rest->set_format(v1::FORMAT_INT2);
    return r;
  }

  static v1::DemoteBlocksRequest DemoteReq(const std::string& seq,
                                           uint64_t lineage, v1::Format f) {
    v1::DemoteBlocksRequest r;
    r.set_tenant_id("acme");
    r.set_sequence_id(seq);
    auto* b = r.add_blocks();
    b->set_lineage_id(lineage);
    b->set_format(f);
    return r;
  }

  FakeClock clock_;
  std::unique_ptr<ManagerCore> core_;
  std::unique_ptr<ManagerService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Manager::Stub> stub_;
  int port_ = 0;  // the server's
};

}  // namespace
}  // namespace triax::manager
