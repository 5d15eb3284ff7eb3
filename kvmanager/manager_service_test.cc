// The manager service over real gRPC on 127.0.0.1:0: status codes and
// messages for bad input on every RPC (and that nothing changed), request-id
// idempotency, and WatchEvents replay + live + max_events.
#include "kvmanager/manager_service.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <functional>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "triax/v1/manager.grpc.pb.h"
#include "triax/v1/worker.grpc.pb.h"

namespace triax::manager {
namespace {

using ::testing::HasSubstr;

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto core = ManagerCore::Create(ManagerOptions{}, &clock_);
    ASSERT_TRUE(core.ok()) << core.status();
    core_ = std::move(*core);
    service_ =
        std::make_unique<ManagerService>(core_.get(), /*check_interval_ms=*/0);
    grpc::ServerBuilder builder;
    int port = 0;
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
};

struct BadCase {
  std::string name;
  std::function<grpc::Status()> call;
  grpc::StatusCode code;
  std::string message;
};

TEST_F(ServiceTest, BadInputOnEveryRpcGetsItsCodeAndChangesNothing) {
  const std::string seq = Open("acme");
  const std::string before = StateSnapshot();
  using C = grpc::StatusCode;
  auto open_with = [&](std::function<void(v1::OpenSequenceRequest&)> f) {
    return [=]() {
      v1::OpenSequenceRequest r = OpenReq();
      f(r);
      v1::OpenSequenceResponse resp;
      return Call(&v1::Manager::Stub::OpenSequence, r, &resp);
    };
  };
  auto extend_with = [&](std::function<void(v1::ExtendSequenceRequest&)> f) {
    return [=]() {
      v1::ExtendSequenceRequest r;
      r.set_tenant_id("acme");
      r.set_sequence_id(seq);
      auto* s = r.add_spans();
      s->set_role(v1::ROLE_USER);
      s->set_num_tokens(5);
      f(r);
      v1::ExtendSequenceResponse resp;
      return Call(&v1::Manager::Stub::ExtendSequence, r, &resp);
    };
  };
  auto register_with = [&](std::function<void(v1::RegisterWorkerRequest&)> f) {
    return [=]() {
      v1::RegisterWorkerRequest r;
      r.set_worker_id("w2");
      r.set_address("127.0.0.1:9002");
      r.set_backend("cpu");
      r.set_capacity_bytes(1 << 20);
      f(r);
      v1::RegisterWorkerResponse resp;
      return Call(&v1::Manager::Stub::RegisterWorker, r, &resp);
    };
  };
  auto tenant_with = [&](std::function<void(v1::CreateTenantRequest&)> f) {
    return [=]() {
      v1::CreateTenantRequest r;
      r.set_tenant_id("newco");
      f(r);
      v1::CreateTenantResponse resp;
      return Call(&v1::Manager::Stub::CreateTenant, r, &resp);
    };
  };
  auto budget_with = [&](std::function<void(v1::SetBudgetRequest&)> f) {
    return [=]() {
      v1::SetBudgetRequest r;
      r.set_tenant_id("acme");
      r.mutable_budget()->set_tier(v1::TIER_DEVICE);
      r.mutable_budget()->set_ceiling_bytes(100);
      f(r);
      v1::SetBudgetResponse resp;
      return Call(&v1::Manager::Stub::SetBudget, r, &resp);
    };
  };
  auto fork_with = [&](std::function<void(v1::ForkSequenceRequest&)> f) {
    return [=]() {
      v1::ForkSequenceRequest r;
      r.set_tenant_id("acme");
      r.set_parent_sequence_id(seq);
      f(r);
      v1::ForkSequenceResponse resp;
      return Call(&v1::Manager::Stub::ForkSequence, r, &resp);
    };
  };
  auto close_with = [&](std::function<void(v1::CloseSequenceRequest&)> f) {
    return [=]() {
      v1::CloseSequenceRequest r;
      r.set_tenant_id("acme");
      r.set_sequence_id(seq);
      f(r);
      v1::CloseSequenceResponse resp;
      return Call(&v1::Manager::Stub::CloseSequence, r, &resp);
    };
  };
  auto get_with = [&](std::string tenant, std::string id) {
    return [=]() {
      v1::GetSequenceRequest r;
      r.set_tenant_id(tenant);
      r.set_sequence_id(id);
      v1::GetSequenceResponse resp;
      return Call(&v1::Manager::Stub::GetSequence, r, &resp);
    };
  };
  auto heartbeat_with = [&](std::string worker, int format) {
    return [=]() {
      v1::HeartbeatRequest r;
      r.set_worker_id(worker);
      r.mutable_inventory()->add_formats()->set_format(
          static_cast<v1::Format>(format));
      v1::HeartbeatResponse resp;
      return Call(&v1::Manager::Stub::Heartbeat, r, &resp);
    };
  };
  auto list_seq = [&](std::string tenant) {
    return [=]() {
      v1::ListSequencesRequest r;
      r.set_tenant_id(tenant);
      v1::ListSequencesResponse resp;
      return Call(&v1::Manager::Stub::ListSequences, r, &resp);
    };
  };
  auto put_with = [&](std::function<void(v1::PutPolicyRequest&)> f) {
    return [=]() {
      v1::PutPolicyRequest r = PolicyReq();
      f(r);
      v1::PutPolicyResponse resp;
      return Call(&v1::Manager::Stub::PutPolicy, r, &resp);
    };
  };
  auto demote_with = [&](std::function<void(v1::DemoteBlocksRequest&)> f) {
    return [=]() {
      v1::DemoteBlocksRequest r = DemoteReq(seq, 1, v1::FORMAT_INT2);
      f(r);
      v1::DemoteBlocksResponse resp;
      return Call(&v1::Manager::Stub::DemoteBlocks, r, &resp);
    };
  };
  auto trace = [&](uint64_t id) {
    return [=]() {
      v1::QueryTraceRequest r;
      r.set_lineage_id(id);
      v1::QueryTraceResponse resp;
      return Call(&v1::Manager::Stub::QueryTrace, r, &resp);
    };
  };
  const std::vector<BadCase> cases = {
      {"register zero capacity",
       register_with([](auto& r) { r.set_capacity_bytes(0); }),
       C::INVALID_ARGUMENT, "capacity_bytes is 0"},
      {"register bad id",
       register_with([](auto& r) { r.set_worker_id("w 2"); }),
       C::INVALID_ARGUMENT, "worker_id \"w 2\""},
      {"register no address", register_with([](auto& r) { r.set_address(""); }),
       C::INVALID_ARGUMENT, "address"},
      {"register taken id",
       register_with([](auto& r) { r.set_worker_id("w1"); }), C::ALREADY_EXISTS,
       "worker_id \"w1\" is up"},
      {"heartbeat unknown", heartbeat_with("ghost", 1), C::NOT_FOUND,
       "\"ghost\""},
      {"heartbeat bad format", heartbeat_with("w1", 0), C::INVALID_ARGUMENT,
       "inventory.formats[0].format is FORMAT_UNSPECIFIED"},
      {"tenant exists", tenant_with([](auto& r) { r.set_tenant_id("acme"); }),
       C::ALREADY_EXISTS, "tenant_id \"acme\" already exists"},
      {"tenant floor>ceiling", tenant_with([](auto& r) {
         auto* b = r.add_budgets();
         b->set_tier(v1::TIER_DEVICE);
         b->set_floor_bytes(9);
         b->set_ceiling_bytes(8);
       }),
       C::INVALID_ARGUMENT, "budgets[0].floor_bytes 9 exceeds ceiling_bytes 8"},
      {"tenant unspecified tier",
       tenant_with([](auto& r) { r.add_budgets()->set_ceiling_bytes(8); }),
       C::INVALID_ARGUMENT, "budgets[0].tier is TIER_UNSPECIFIED"},
      {"tenant bad policy",
       tenant_with([](auto& r) { r.set_default_policy("x"); }),
       C::INVALID_ARGUMENT, "default_policy \"x\""},
      {"budget unknown tenant",
       budget_with([](auto& r) { r.set_tenant_id("ghost"); }), C::NOT_FOUND,
       "tenant_id \"ghost\""},
      {"budget zero ceiling",
       budget_with([](auto& r) { r.mutable_budget()->set_ceiling_bytes(0); }),
       C::INVALID_ARGUMENT, "budget.ceiling_bytes is 0"},
      {"budget missing", budget_with([](auto& r) { r.clear_budget(); }),
       C::INVALID_ARGUMENT, "budget is not set"},
      {"open unknown tenant",
       open_with([](auto& r) { r.set_tenant_id("ghost"); }), C::NOT_FOUND,
       "tenant_id \"ghost\""},
      {"open no model", open_with([](auto& r) { r.clear_model(); }),
       C::INVALID_ARGUMENT, "model is not set"},
      {"open zero layers",
       open_with([](auto& r) { r.mutable_model()->set_n_layers(0); }),
       C::INVALID_ARGUMENT, "model.n_layers=0"},
      {"open odd head_dim",
       open_with([](auto& r) { r.mutable_model()->set_head_dim(7); }),
       C::INVALID_ARGUMENT, "model.head_dim=7"},
      {"open spans and rendered", open_with([](auto& r) {
         r.mutable_rendered()->set_text("<|im_start|>user\nhi<|im_end|>\n");
         r.mutable_rendered()->set_chat_template(v1::CHAT_TEMPLATE_CHATML);
       }),
       C::INVALID_ARGUMENT,
       "spans has 2 entries and rendered is set; exactly one of spans and "
       "rendered must be given"},
      {"open malformed rendered", open_with([](auto& r) {
         r.clear_spans();
         r.mutable_rendered()->set_text("<|im_start|>user\nhi<think>");
         r.mutable_rendered()->set_chat_template(v1::CHAT_TEMPLATE_CHATML);
       }),
       C::INVALID_ARGUMENT,
       "rendered.text byte 0: the ROLE_USER message has "
       "no <|im_end|>"},
      {"open rendered no template", open_with([](auto& r) {
         r.clear_spans();
         r.mutable_rendered()->set_text("<|im_start|>user\nhi<|im_end|>");
       }),
       C::INVALID_ARGUMENT, "rendered.chat_template is 0"},
      {"extend spans and rendered", extend_with([](auto& r) {
         r.mutable_rendered()->set_text("<|im_start|>user\nhi<|im_end|>\n");
         r.mutable_rendered()->set_chat_template(v1::CHAT_TEMPLATE_CHATML);
       }),
       C::INVALID_ARGUMENT, "exactly one of spans and rendered"},
      {"extend neither", extend_with([](auto& r) { r.clear_spans(); }),
       C::INVALID_ARGUMENT, "spans is empty and rendered is not set"},
      {"extend rendered with new_turn", extend_with([](auto& r) {
         r.clear_spans();
         r.set_new_turn(true);
         r.mutable_rendered()->set_text("<|im_start|>user\nhi<|im_end|>\n");
         r.mutable_rendered()->set_chat_template(v1::CHAT_TEMPLATE_CHATML);
       }),
       C::INVALID_ARGUMENT, "new_turn is true with rendered"},
      {"extend rendered bad offsets", extend_with([](auto& r) {
         r.clear_spans();
         r.mutable_rendered()->set_text("### User:\nhi");
         r.mutable_rendered()->set_chat_template(v1::CHAT_TEMPLATE_GENERIC);
         r.mutable_rendered()->add_token_offsets(0);
         r.mutable_rendered()->add_token_offsets(40);
       }),
       C::INVALID_ARGUMENT,
       "rendered.token_offsets[1] is 40, past the last "
       "byte of the 12-byte text"},
      {"open no spans", open_with([](auto& r) { r.clear_spans(); }),
       C::INVALID_ARGUMENT, "spans is empty"},
      {"open zero tokens",
       open_with([](auto& r) { r.mutable_spans(1)->set_num_tokens(0); }),
       C::INVALID_ARGUMENT, "spans[1].num_tokens is 0"},
      {"open unspecified role", open_with([](auto& r) {
         r.mutable_spans(0)->set_role(v1::ROLE_UNSPECIFIED);
       }),
       C::INVALID_ARGUMENT, "spans[0].role is ROLE_UNSPECIFIED"},
      {"open oversized block",
       open_with([](auto& r) { r.set_block_tokens(5000); }),
       C::INVALID_ARGUMENT, "block_tokens 5000"},
      {"open bad policy", open_with([](auto& r) { r.set_policy("fp3"); }),
       C::INVALID_ARGUMENT, "policy \"fp3\" is not a known policy"},
      {"open tq with head_dim 48", open_with([](auto& r) {
         r.set_policy("tq3");
         r.mutable_model()->set_head_dim(48);
       }),
       C::INVALID_ARGUMENT, "policy \"tq3\" rules[0] encoding tq3 is invalid"},
      {"put policy unset", put_with([](auto& r) { r.clear_policy(); }),
       C::INVALID_ARGUMENT, "policy is not set"},
      {"put policy bad name",
       put_with([](auto& r) { r.mutable_policy()->set_name("a b"); }),
       C::INVALID_ARGUMENT, "policy.name \"a b\""},
      {"put policy no rules",
       put_with([](auto& r) { r.mutable_policy()->clear_rules(); }),
       C::INVALID_ARGUMENT, "policy.rules is empty"},
      {"put policy last not catch-all", put_with([](auto& r) {
         r.mutable_policy()->mutable_rules(1)->set_role(v1::ROLE_USER);
       }),
       C::INVALID_ARGUMENT, "policy.rules[1] (the last rule"},
      {"put policy unspecified format", put_with([](auto& r) {
         r.mutable_policy()->mutable_rules(0)->clear_format();
       }),
       C::INVALID_ARGUMENT, "policy.rules[0].format is FORMAT_UNSPECIFIED"},
      {"put policy bad group", put_with([](auto& r) {
         r.mutable_policy()->mutable_rules(1)->set_group_size(100);
       }),
       C::INVALID_ARGUMENT, "policy.rules[1].group_size 100"},
      {"put policy bad scale", put_with([](auto& r) {
         r.mutable_policy()->mutable_rules(1)->set_scale_dtype(
             static_cast<v1::ScaleDtype>(7));
       }),
       C::INVALID_ARGUMENT, "policy.rules[1].scale_dtype 7"},
      {"put policy builtin",
       put_with([](auto& r) { r.mutable_policy()->set_name("tq3"); }),
       C::FAILED_PRECONDITION, "policy.name \"tq3\" is a built-in policy"},
      {"demote no blocks", demote_with([](auto& r) { r.clear_blocks(); }),
       C::INVALID_ARGUMENT, "blocks is empty"},
      {"demote unknown lineage",
       demote_with([](auto& r) { r.mutable_blocks(0)->set_lineage_id(999); }),
       C::NOT_FOUND, "blocks[0].lineage_id 999 is not a block"},
      {"demote bad format", demote_with([](auto& r) {
         r.mutable_blocks(0)->set_format(static_cast<v1::Format>(42));
       }),
       C::INVALID_ARGUMENT, "blocks[0].format is FORMAT(42)"},
      {"demote other tenant",
       demote_with([](auto& r) { r.set_tenant_id("other"); }),
       C::PERMISSION_DENIED, "belongs to another tenant"},
      {"demote unknown sequence",
       demote_with([](auto& r) { r.set_sequence_id("seq-77"); }), C::NOT_FOUND,
       "sequence_id \"seq-77\""},
      {"demote duplicate lineage",
       demote_with([](auto& r) { *r.add_blocks() = r.blocks(0); }),
       C::INVALID_ARGUMENT, "blocks[1].lineage_id 1 appears more than once"},
      {"open over budget",
       open_with([](auto& r) { r.mutable_spans(1)->set_num_tokens(2000); }),
       C::RESOURCE_EXHAUSTED,
       "tenant \"acme\" tier TIER_DEVICE: request needs"},
      {"extend unknown",
       extend_with([](auto& r) { r.set_sequence_id("seq-77"); }), C::NOT_FOUND,
       "\"seq-77\""},
      {"extend other tenant",
       extend_with([](auto& r) { r.set_tenant_id("other"); }),
       C::PERMISSION_DENIED, "belongs to another tenant"},
      {"extend zero tokens",
       extend_with([](auto& r) { r.mutable_spans(0)->set_num_tokens(0); }),
       C::INVALID_ARGUMENT, "spans[0].num_tokens is 0"},
      {"extend over budget",
       extend_with([](auto& r) { r.mutable_spans(0)->set_num_tokens(4000); }),
       C::RESOURCE_EXHAUSTED, "over by"},
      {"fork unknown",
       fork_with([](auto& r) { r.set_parent_sequence_id("seq-77"); }),
       C::NOT_FOUND, "parent_sequence_id \"seq-77\""},
      {"fork other tenant",
       fork_with([](auto& r) { r.set_tenant_id("other"); }),
       C::PERMISSION_DENIED, "another tenant"},
      {"fork too many tokens", fork_with([](auto& r) { r.set_num_tokens(33); }),
       C::INVALID_ARGUMENT, "num_tokens 33"},
      {"close unknown",
       close_with([](auto& r) { r.set_sequence_id("seq-77"); }), C::NOT_FOUND,
       "\"seq-77\""},
      {"close other tenant",
       close_with([](auto& r) { r.set_tenant_id("other"); }),
       C::PERMISSION_DENIED, "another tenant"},
      {"close empty id", close_with([](auto& r) { r.set_sequence_id(""); }),
       C::INVALID_ARGUMENT, "sequence_id is empty"},
      {"get unknown", get_with("", "seq-77"), C::NOT_FOUND, "\"seq-77\""},
      {"get other tenant", get_with("other", seq), C::PERMISSION_DENIED,
       "another tenant"},
      {"list unknown tenant", list_seq("ghost"), C::NOT_FOUND,
       "tenant_id \"ghost\""},
      {"trace zero", trace(0), C::INVALID_ARGUMENT, "lineage_id is 0"},
      {"trace unknown", trace(12345), C::NOT_FOUND, "lineage_id 12345"},
  };
  for (const BadCase& c : cases) {
    grpc::Status s = c.call();
    EXPECT_EQ(s.error_code(), c.code) << c.name << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.message)) << c.name;
  }
  // WatchEvents with a bad filter.
  {
    grpc::ClientContext ctx;
    v1::WatchEventsRequest w;
    w.set_tenant_id("no spaces allowed");
    auto reader = stub_->WatchEvents(&ctx, w);
    v1::Event e;
    EXPECT_FALSE(reader->Read(&e));
    grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), C::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(),
                HasSubstr("tenant_id \"no spaces allowed\""));
  }
  EXPECT_EQ(StateSnapshot(), before);
}

TEST_F(ServiceTest, RepeatedRequestIdReturnsTheFirstReplyAndAppliesOnce) {
  v1::OpenSequenceRequest req = OpenReq();
  req.set_request_id("open-1");
  v1::OpenSequenceResponse a, b;
  ASSERT_TRUE(Call(&v1::Manager::Stub::OpenSequence, req, &a).ok());
  ASSERT_TRUE(Call(&v1::Manager::Stub::OpenSequence, req, &b).ok());
  EXPECT_EQ(a.SerializeAsString(), b.SerializeAsString());
  const uint64_t last_lineage = a.sequence().blocks().rbegin()->lineage_id();

  v1::ExtendSequenceRequest ext;
  ext.set_request_id("ext-1");
  ext.set_tenant_id("acme");
  ext.set_sequence_id(a.sequence().sequence_id());
  ext.set_new_turn(true);
  auto* sp = ext.add_spans();
  sp->set_role(v1::ROLE_USER);
  sp->set_num_tokens(16);
  v1::ExtendSequenceResponse e1, e2;
  ASSERT_TRUE(Call(&v1::Manager::Stub::ExtendSequence, ext, &e1).ok());
  ASSERT_TRUE(Call(&v1::Manager::Stub::ExtendSequence, ext, &e2).ok());
  EXPECT_EQ(e1.SerializeAsString(), e2.SerializeAsString());
  ASSERT_EQ(e1.new_blocks_size(), 1);
  EXPECT_EQ(e1.new_blocks(0).lineage_id(), last_lineage + 1);

  v1::ForkSequenceRequest fork;
  fork.set_request_id("fork-1");
  fork.set_tenant_id("acme");
  fork.set_parent_sequence_id(a.sequence().sequence_id());
  fork.set_num_tokens(10);
  v1::ForkSequenceResponse f1, f2;
  ASSERT_TRUE(Call(&v1::Manager::Stub::ForkSequence, fork, &f1).ok());
  ASSERT_TRUE(Call(&v1::Manager::Stub::ForkSequence, fork, &f2).ok());
  EXPECT_EQ(f1.SerializeAsString(), f2.SerializeAsString());

  v1::SetBudgetRequest sb;
  sb.set_request_id("budget-1");
  sb.set_tenant_id("acme");
  sb.mutable_budget()->set_tier(v1::TIER_DEVICE);
  sb.mutable_budget()->set_ceiling_bytes(1 << 22);
  v1::SetBudgetResponse s1, s2;
  ASSERT_TRUE(Call(&v1::Manager::Stub::SetBudget, sb, &s1).ok());
  ASSERT_TRUE(Call(&v1::Manager::Stub::SetBudget, sb, &s2).ok());
  EXPECT_EQ(s1.SerializeAsString(), s2.SerializeAsString());

  v1::CreateTenantRequest ct;
  ct.set_request_id("tenant-1");
  ct.set_tenant_id("newco");
  v1::CreateTenantResponse t1, t2;
  ASSERT_TRUE(Call(&v1::Manager::Stub::CreateTenant, ct, &t1).ok());
  ASSERT_TRUE(Call(&v1::Manager::Stub::CreateTenant, ct, &t2).ok());
  EXPECT_EQ(t1.SerializeAsString(), t2.SerializeAsString());

  v1::RegisterWorkerRequest rw;
  rw.set_request_id("reg-1");
  rw.set_worker_id("w2");
  rw.set_address("127.0.0.1:9002");
  rw.set_backend("cpu");
  rw.set_capacity_bytes(1 << 30);
  v1::RegisterWorkerResponse r1, r2;
  ASSERT_TRUE(Call(&v1::Manager::Stub::RegisterWorker, rw, &r1).ok());
  ASSERT_TRUE(Call(&v1::Manager::Stub::RegisterWorker, rw, &r2).ok());
  EXPECT_EQ(r1.SerializeAsString(), r2.SerializeAsString());

  v1::CloseSequenceRequest close;
  close.set_request_id("close-1");
  close.set_tenant_id("acme");
  close.set_sequence_id(a.sequence().sequence_id());
  v1::CloseSequenceResponse c1, c2;
  ASSERT_TRUE(Call(&v1::Manager::Stub::CloseSequence, close, &c1).ok());
  ASSERT_TRUE(Call(&v1::Manager::Stub::CloseSequence, close, &c2).ok());
  EXPECT_EQ(c1.SerializeAsString(), c2.SerializeAsString());
  EXPECT_GT(c1.freed_lineage_ids_size(), 0);

  // Applied once: one open sequence (the fork), usage of the fork's blocks
  // only, and the next lineage id follows directly.
  v1::ListSequencesRequest ls;
  ls.set_tenant_id("acme");
  v1::ListSequencesResponse ls_resp;
  ASSERT_TRUE(Call(&v1::Manager::Stub::ListSequences, ls, &ls_resp).ok());
  ASSERT_EQ(ls_resp.sequences_size(), 1);
  EXPECT_EQ(ls_resp.sequences(0).sequence_id(), f1.sequence().sequence_id());
  v1::ListTenantsResponse lt;
  ASSERT_TRUE(
      Call(&v1::Manager::Stub::ListTenants, v1::ListTenantsRequest(), &lt)
          .ok());
  ASSERT_EQ(lt.tenants_size(), 3);
  EXPECT_EQ(lt.tenants(0).tenant_id(), "acme");
  EXPECT_EQ(lt.tenants(0).usage(0).used_bytes(), f1.sequence().bytes());
  v1::OpenSequenceResponse next;
  ASSERT_TRUE(Call(&v1::Manager::Stub::OpenSequence, OpenReq(), &next).ok());
  EXPECT_EQ(next.sequence().blocks(0).lineage_id(),
            f1.sequence().blocks().rbegin()->lineage_id() + 1);
}

TEST_F(ServiceTest, WatchEventsReplaysThenStreamsLiveUpToMaxEvents) {
  const std::string seq = Open("acme");  // 3 blocks + SEQUENCE_OPENED
  // Replay everything for this sequence, then two live events, then stop.
  grpc::ClientContext ctx;
  v1::WatchEventsRequest w;
  w.set_from_id(1);
  w.set_sequence_id(seq);
  w.set_max_events(6);
  auto reader = stub_->WatchEvents(&ctx, w);
  std::vector<v1::Event> got;
  v1::Event e;
  for (int i = 0; i < 4 && reader->Read(&e); ++i) got.push_back(e);
  ASSERT_EQ(got.size(), 4u);
  EXPECT_EQ(got[0].kind(), v1::EVENT_BLOCK_CREATED);
  EXPECT_EQ(got[0].lineage_id(), 1u);
  EXPECT_EQ(got[0].tag().temporal(), v1::TEMPORAL_SINK);
  EXPECT_EQ(got[3].kind(), v1::EVENT_SEQUENCE_OPENED);
  // Live: an event of another sequence is filtered out; closing ours yields
  // BLOCK_RELEASED, BLOCK_FREED for block 1, then the stream ends at 6.
  Open("other");
  v1::CloseSequenceRequest close;
  close.set_tenant_id("acme");
  close.set_sequence_id(seq);
  v1::CloseSequenceResponse close_resp;
  ASSERT_TRUE(Call(&v1::Manager::Stub::CloseSequence, close, &close_resp).ok());
  while (reader->Read(&e)) got.push_back(e);
  EXPECT_TRUE(reader->Finish().ok());
  ASSERT_EQ(got.size(), 6u);
  EXPECT_EQ(got[4].kind(), v1::EVENT_BLOCK_RELEASED);
  EXPECT_EQ(got[5].kind(), v1::EVENT_BLOCK_FREED);
  EXPECT_EQ(got[5].lineage_id(), 1u);
  for (size_t i = 1; i < got.size(); ++i)
    EXPECT_GT(got[i].id(), got[i - 1].id());
  for (const auto& ev : got) EXPECT_EQ(ev.sequence_id(), seq);
}

TEST_F(ServiceTest, LiveWatcherSeesWorkerFailureWithLineageIds) {
  const std::string seq = Open("acme");
  grpc::ClientContext ctx;
  v1::WatchEventsRequest w;  // live only
  w.set_lineage_id(2);
  w.set_max_events(2);
  auto reader = stub_->WatchEvents(&ctx, w);
  // Make sure the stream is established before the failure happens.
  while (core_->events().subscribers() == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  clock_.AdvanceMs(3001);
  ASSERT_EQ(core_->CheckWorkers().size(), 1u);
  v1::Event e;
  ASSERT_TRUE(reader->Read(&e));
  EXPECT_EQ(e.kind(), v1::EVENT_BLOCK_LOST);
  EXPECT_EQ(e.lineage_id(), 2u);
  ASSERT_TRUE(reader->Read(&e));
  EXPECT_EQ(e.kind(), v1::EVENT_SEQUENCE_LOST);
  EXPECT_EQ(e.lineage_ids_size(), 3);
  EXPECT_FALSE(reader->Read(&e));
  EXPECT_TRUE(reader->Finish().ok());
  v1::GetSequenceRequest get;
  get.set_sequence_id(seq);
  v1::GetSequenceResponse got;
  ASSERT_TRUE(Call(&v1::Manager::Stub::GetSequence, get, &got).ok());
  EXPECT_EQ(got.sequence().state(), v1::SEQUENCE_STATE_LOST);
  EXPECT_EQ(got.sequence().lost_lineage_ids_size(), 3);
  // Opening now has nowhere to go.
  v1::OpenSequenceResponse resp;
  EXPECT_EQ(
      Call(&v1::Manager::Stub::OpenSequence, OpenReq(), &resp).error_code(),
      grpc::StatusCode::UNAVAILABLE);
}

TEST_F(ServiceTest, CancelledWatcherUnsubscribes) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  v1::WatchEventsRequest w;
  auto reader = stub_->WatchEvents(ctx.get(), w);
  while (core_->events().subscribers() == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ctx->TryCancel();
  v1::Event e;
  EXPECT_FALSE(reader->Read(&e));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  for (int i = 0; i < 2000 && core_->events().subscribers() != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(core_->events().subscribers(), 0u);
}

// A worker that only answers Demote: records the requests and fails while
// `fail` is set.
class FakeWorker final : public v1::Worker::Service {
 public:
  grpc::Status Demote(grpc::ServerContext*, const v1::DemoteRequest* req,
                      v1::DemoteResponse* resp) override {
    absl::MutexLock lock(&mu);
    requests.push_back(*req);
    if (fail) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "pool is full");
    }
    resp->set_pages_reencoded(req->blocks_size() * 2);
    return grpc::Status::OK;
  }
  absl::Mutex mu;
  std::vector<v1::DemoteRequest> requests ABSL_GUARDED_BY(mu);
  bool fail ABSL_GUARDED_BY(mu) = false;
};

TEST_F(ServiceTest, PutAndListPoliciesIdempotently) {
  v1::PutPolicyRequest req = PolicyReq();
  req.set_request_id("pol-1");
  v1::PutPolicyResponse a, b;
  ASSERT_TRUE(Call(&v1::Manager::Stub::PutPolicy, req, &a).ok());
  EXPECT_EQ(a.policy().name(), "mixed");
  EXPECT_FALSE(a.policy().builtin());
  ASSERT_EQ(a.policy().rules_size(), 2);
  EXPECT_EQ(a.policy().rules(0).format_v(), v1::FORMAT_INT4);
  EXPECT_EQ(a.policy().rules(0).group_size(), 64u);
  EXPECT_EQ(a.policy().rules(0).scale_dtype(), v1::SCALE_DTYPE_FP16);
  ASSERT_TRUE(Call(&v1::Manager::Stub::PutPolicy, req, &b).ok());
  EXPECT_EQ(a.SerializeAsString(), b.SerializeAsString());
  v1::ListPoliciesResponse list;
  ASSERT_TRUE(
      Call(&v1::Manager::Stub::ListPolicies, v1::ListPoliciesRequest(), &list)
          .ok());
  ASSERT_EQ(list.policies_size(), 10);
  EXPECT_EQ(list.policies(0).name(), "triaxial-static");
  EXPECT_TRUE(list.policies(0).builtin());
  EXPECT_EQ(list.policies(0).rules_size(), 6);
  EXPECT_EQ(list.policies(0).rules(0).temporal(), v1::TEMPORAL_SINK);
  EXPECT_EQ(list.policies(9).name(), "mixed");
  // A sequence under it gets the rule encodings in its plan.
  v1::OpenSequenceRequest open = OpenReq();
  open.set_policy("mixed");
  v1::OpenSequenceResponse o;
  ASSERT_TRUE(Call(&v1::Manager::Stub::OpenSequence, open, &o).ok());
  ASSERT_EQ(o.sequence().blocks_size(), 3);
  const auto& b0 = o.sequence().blocks(0);
  EXPECT_EQ(b0.format(), v1::FORMAT_FP8_E4M3);
  EXPECT_EQ(b0.format_v(), v1::FORMAT_INT4);
  EXPECT_EQ(b0.group_size(), 64u);
  EXPECT_EQ(o.sequence().blocks(2).format(), v1::FORMAT_INT2);
  EXPECT_EQ(o.sequence().blocks(2).format_v(), v1::FORMAT_INT2);
}

TEST_F(ServiceTest, DemoteBlocksGoesThroughTheWorker) {
  FakeWorker fake;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(&fake);
  auto worker_server = builder.BuildAndStart();
  ASSERT_NE(worker_server, nullptr);
  v1::RegisterWorkerRequest reg;
  reg.set_worker_id("wd");
  reg.set_address("127.0.0.1:" + std::to_string(port));
  reg.set_backend("cpu");
  reg.set_capacity_bytes(1ull << 41);  // more room: sequences go here
  v1::RegisterWorkerResponse reg_resp;
  ASSERT_TRUE(Call(&v1::Manager::Stub::RegisterWorker, reg, &reg_resp).ok());
  v1::OpenSequenceResponse o;
  ASSERT_TRUE(Call(&v1::Manager::Stub::OpenSequence, OpenReq(), &o).ok());
  ASSERT_EQ(o.sequence().worker_id(), "wd");
  const std::string seq = o.sequence().sequence_id();
  const uint64_t lineage = o.sequence().blocks(2).lineage_id();  // user, bf16
  ASSERT_EQ(o.sequence().blocks(2).format(), v1::FORMAT_BF16);

  // The worker fails: its status comes back, the plan stays.
  {
    absl::MutexLock lock(&fake.mu);
    fake.fail = true;
  }
  const std::string before = StateSnapshot();
  v1::DemoteBlocksRequest req = DemoteReq(seq, lineage, v1::FORMAT_INT2);
  req.set_request_id("dem-1");
  v1::DemoteBlocksResponse r1;
  grpc::Status st = Call(&v1::Manager::Stub::DemoteBlocks, req, &r1);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(st.error_message(), "worker \"wd\" Demote: pool is full");
  EXPECT_EQ(StateSnapshot(), before);

  // It succeeds: the plan and the usage change; a repeat changes nothing.
  {
    absl::MutexLock lock(&fake.mu);
    fake.fail = false;
  }
  ASSERT_TRUE(Call(&v1::Manager::Stub::DemoteBlocks, req, &r1).ok());
  EXPECT_EQ(r1.sequence().blocks(2).format(), v1::FORMAT_INT2);
  EXPECT_EQ(r1.sequence().blocks(2).format_v(), v1::FORMAT_INT2);
  EXPECT_EQ(r1.sequence().blocks(2).group_size(), 32u);
  EXPECT_LT(r1.bytes_delta(), 0);
  EXPECT_EQ(static_cast<int64_t>(r1.sequence().bytes()),
            static_cast<int64_t>(o.sequence().bytes()) + r1.bytes_delta());
  v1::DemoteBlocksResponse r2;
  ASSERT_TRUE(Call(&v1::Manager::Stub::DemoteBlocks, req, &r2).ok());
  EXPECT_EQ(r1.SerializeAsString(), r2.SerializeAsString());
  {
    absl::MutexLock lock(&fake.mu);
    ASSERT_EQ(fake.requests.size(), 2u);  // the failed call and the success
    const v1::DemoteRequest& w = fake.requests[1];
    EXPECT_EQ(w.request_id(), "dem-1");
    EXPECT_EQ(w.tenant_id(), "acme");
    EXPECT_EQ(w.sequence_id(), seq);
    ASSERT_EQ(w.blocks_size(), 1);
    EXPECT_EQ(w.blocks(0).lineage_id(), lineage);
    EXPECT_EQ(w.blocks(0).index(), 2u);
    EXPECT_EQ(w.blocks(0).format(), v1::FORMAT_INT2);
    EXPECT_EQ(w.blocks(0).group_size(), 32u);
  }
  v1::GetSequenceRequest get;
  get.set_tenant_id("acme");
  get.set_sequence_id(seq);
  v1::GetSequenceResponse got;
  ASSERT_TRUE(Call(&v1::Manager::Stub::GetSequence, get, &got).ok());
  EXPECT_EQ(got.sequence().SerializeAsString(),
            r1.sequence().SerializeAsString());

  // An unreachable worker: UNAVAILABLE, prefixed, nothing applied.
  worker_server->Shutdown();
  v1::DemoteBlocksRequest again = DemoteReq(seq, lineage, v1::FORMAT_INT4);
  v1::DemoteBlocksResponse r3;
  st = Call(&v1::Manager::Stub::DemoteBlocks, again, &r3);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(st.error_message(), HasSubstr("worker \"wd\" Demote: "));
  ASSERT_TRUE(Call(&v1::Manager::Stub::GetSequence, get, &got).ok());
  EXPECT_EQ(got.sequence().blocks(2).format(), v1::FORMAT_INT2);
}

TEST_F(ServiceTest, OpenAndExtendWithRenderedText) {
  // A Llama 3 prompt with tokenizer offsets and a BOS: "<|begin_of_text|>"
  // and each header one token, the contents one token per word.
  const std::string text =
      "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
      "Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
      "Hi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
  v1::OpenSequenceRequest req = OpenReq();
  req.clear_spans();
  req.set_block_tokens(2);
  v1::RenderedText* r = req.mutable_rendered();
  r->set_text(text);
  r->set_chat_template(v1::CHAT_TEMPLATE_LLAMA3);
  r->set_bos_tokens(1);
  for (const char* piece :
       {"<|begin_of_text|>", "<|start_header_id|>system",
        "<|end_header_id|>\n\n", "Be ", "brief.", "<|eot_id|>",
        "<|start_header_id|>user", "<|end_header_id|>\n\n", "Hi ", "there",
        "<|eot_id|>", "<|start_header_id|>assistant",
        "<|end_header_id|>\n\n"}) {
    const size_t at =
        text.find(piece, r->token_offsets_size() == 0
                             ? 0
                             : r->token_offsets(r->token_offsets_size() - 1));
    ASSERT_NE(at, std::string::npos) << piece;
    r->add_token_offsets(static_cast<uint32_t>(at));
  }
  v1::OpenSequenceResponse open;
  grpc::Status s = Call(&v1::Manager::Stub::OpenSequence, req, &open);
  ASSERT_TRUE(s.ok()) << s.error_message();
  // BOS + 3 delimiter tokens, 2 system, 3 delimiter, 2 user, 3 delimiter.
  std::vector<std::pair<v1::Role, uint32_t>> blocks;
  for (const auto& b : open.sequence().blocks()) {
    blocks.emplace_back(b.tag().role(), b.num_tokens());
  }
  EXPECT_EQ(blocks, (std::vector<std::pair<v1::Role, uint32_t>>{
                        {v1::ROLE_DELIMITER, 2},
                        {v1::ROLE_DELIMITER, 2},
                        {v1::ROLE_SYSTEM, 2},
                        {v1::ROLE_DELIMITER, 2},
                        {v1::ROLE_DELIMITER, 1},
                        {v1::ROLE_USER, 2},
                        {v1::ROLE_DELIMITER, 2},
                        {v1::ROLE_DELIMITER, 1}}));
  EXPECT_EQ(open.sequence().num_tokens(), 14u);
  EXPECT_EQ(open.sequence().turns(), 1u);

  // Decoded text of the open assistant message, then the next user turn
  // (byte-level: no offsets).
  v1::ExtendSequenceRequest ext;
  ext.set_tenant_id("acme");
  ext.set_sequence_id(open.sequence().sequence_id());
  ext.mutable_rendered()->set_text(
      "Hello.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nQ");
  ext.mutable_rendered()->set_chat_template(v1::CHAT_TEMPLATE_LLAMA3);
  ext.mutable_rendered()->set_continues(v1::ROLE_ASSISTANT);
  v1::ExtendSequenceResponse er;
  s = Call(&v1::Manager::Stub::ExtendSequence, ext, &er);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("the ROLE_USER message has no"));
  ext.mutable_rendered()->set_text(
      "Hello.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nQ"
      "<|eot_id|>");
  s = Call(&v1::Manager::Stub::ExtendSequence, ext, &er);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(er.sequence().turns(), 2u);
  EXPECT_EQ(er.sequence().num_tokens(),
            14u + 6 + 10 + 19 + 4 + 17 + 2 + 1 + 10);
  // The earlier turn aged: its blocks (but the sink) are recent now.
  ASSERT_FALSE(er.retagged_blocks().empty());
  for (const auto& b : er.retagged_blocks()) {
    EXPECT_EQ(b.tag().temporal(), v1::TEMPORAL_RECENT_TURNS);
  }
  EXPECT_EQ(er.new_blocks(0).tag().role(), v1::ROLE_ASSISTANT);
  EXPECT_EQ(er.new_blocks(0).tag().temporal(), v1::TEMPORAL_RECENT_TURNS);
  const auto& last = er.sequence().blocks(er.sequence().blocks_size() - 1);
  EXPECT_EQ(last.tag().role(), v1::ROLE_DELIMITER);
  EXPECT_EQ(last.tag().temporal(), v1::TEMPORAL_CURRENT_TURN);
}

TEST_F(ServiceTest, CalibrationRpcsValidateAndRoundTrip) {
  auto table = [] {
    v1::PutCalibrationRequest req;
    auto* t = req.mutable_table();
    t->set_model("tiny-cal");
    t->mutable_shape()->set_n_layers(2);
    t->mutable_shape()->set_n_kv_heads(2);
    t->mutable_shape()->set_n_q_heads(4);
    t->mutable_shape()->set_head_dim(64);
    t->set_block_tokens(16);
    for (v1::Format f : {v1::FORMAT_BF16, v1::FORMAT_INT4}) {
      auto* e = t->add_entries();
      e->mutable_tag()->set_temporal(v1::TEMPORAL_OLDER);
      e->mutable_tag()->set_role(v1::ROLE_USER);
      e->set_format(f);
      e->set_distortion(f == v1::FORMAT_BF16 ? 0 : 0.25);
    }
    t->mutable_source()->set_tool("calibrate 1.0");
    t->mutable_source()->add_held_out_ids("s9");
    return req;
  };
  struct Case {
    std::function<void(v1::PutCalibrationRequest*)> mutate;
    const char* message;
  };
  const std::vector<Case> cases = {
      {[](auto* r) { r->clear_table(); }, "table is not set"},
      {[](auto* r) { r->mutable_table()->clear_shape(); },
       "table.shape is not set"},
      {[](auto* r) { r->mutable_table()->set_model(""); }, "table.model"},
      {[](auto* r) { r->mutable_table()->set_block_tokens(5000); },
       "table.block_tokens 5000"},
      {[](auto* r) {
         r->mutable_table()->mutable_entries(1)->set_format(
             static_cast<v1::Format>(42));
       },
       "table.entries[1].format"},
      {[](auto* r) {
         r->mutable_table()->mutable_entries(0)->mutable_tag()->set_role(
             v1::ROLE_UNSPECIFIED);
       },
       "table.entries[0].tag.role"},
      {[](auto* r) {
         r->mutable_table()->mutable_entries(1)->set_distortion(-2);
       },
       "table.entries[1].distortion is -2"},
      {[](auto* r) {
         r->mutable_table()->mutable_entries(1)->set_format(v1::FORMAT_BF16);
       },
       "table.entries[1] repeats table.entries[0]"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    v1::PutCalibrationRequest req = table();
    cases[i].mutate(&req);
    v1::PutCalibrationResponse resp;
    const grpc::Status st =
        Call(&v1::Manager::Stub::PutCalibration, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << i;
    EXPECT_THAT(st.error_message(), HasSubstr(cases[i].message)) << i;
    v1::GetCalibrationRequest get;
    get.set_model("tiny-cal");
    v1::GetCalibrationResponse got;
    EXPECT_EQ(Call(&v1::Manager::Stub::GetCalibration, get, &got).error_code(),
              grpc::StatusCode::NOT_FOUND)
        << i;
  }
  v1::GetCalibrationRequest get;
  get.set_model("tiny-cal");
  v1::GetCalibrationResponse got;
  grpc::Status st = Call(&v1::Manager::Stub::GetCalibration, get, &got);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(st.error_message(), HasSubstr("\"tiny-cal\""));

  v1::PutCalibrationRequest req = table();
  req.set_request_id("cal-1");
  v1::PutCalibrationResponse resp;
  ASSERT_TRUE(Call(&v1::Manager::Stub::PutCalibration, req, &resp).ok());
  EXPECT_EQ(resp.entries(), 2u);
  ASSERT_TRUE(Call(&v1::Manager::Stub::GetCalibration, get, &got).ok());
  EXPECT_EQ(got.table().model(), "tiny-cal");
  ASSERT_EQ(got.table().entries_size(), 2);
  EXPECT_EQ(got.table().entries(1).format(), v1::FORMAT_INT4);
  EXPECT_EQ(got.table().entries(1).format_v(), v1::FORMAT_INT4);
  EXPECT_EQ(got.table().entries(1).group_size(), 32u);
  EXPECT_EQ(got.table().entries(1).tag().modality(), v1::MODALITY_TEXT);
  EXPECT_DOUBLE_EQ(got.table().entries(1).distortion(), 0.25);
  EXPECT_EQ(got.table().source().tool(), "calibrate 1.0");
  EXPECT_EQ(got.table().source().held_out_ids(0), "s9");

  // An allocation policy round-trips its fields; opening under it works.
  v1::PutPolicyRequest put;
  put.mutable_policy()->set_name("tri-4");
  put.mutable_policy()->set_budget_bits(14);
  put.mutable_policy()->set_calibration_model("tiny-cal");
  put.mutable_policy()->add_candidates()->set_format(v1::FORMAT_INT4);
  v1::PutPolicyResponse put_resp;
  ASSERT_TRUE(Call(&v1::Manager::Stub::PutPolicy, put, &put_resp).ok());
  EXPECT_EQ(put_resp.policy().budget_bits(), 14);
  EXPECT_EQ(put_resp.policy().calibration_model(), "tiny-cal");
  ASSERT_EQ(put_resp.policy().candidates_size(), 1);
  EXPECT_EQ(put_resp.policy().candidates(0).format_v(), v1::FORMAT_INT4);
  v1::OpenSequenceRequest open = OpenReq();
  open.set_policy("tri-4");
  v1::OpenSequenceResponse open_resp;
  st = Call(&v1::Manager::Stub::OpenSequence, open, &open_resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  // sink BF16 (pinned), system BF16 (no entries for the role), user INT4
  // (borrowed from OLDER/USER): (16 x 16 + 4 x 16 + 12 x 5.5) / 32 = 12.06.
  ASSERT_EQ(open_resp.sequence().blocks_size(), 3);
  EXPECT_EQ(open_resp.sequence().blocks(0).format(), v1::FORMAT_BF16);
  EXPECT_EQ(open_resp.sequence().blocks(1).format(), v1::FORMAT_BF16);
  EXPECT_EQ(open_resp.sequence().blocks(2).format(), v1::FORMAT_INT4);
}

}  // namespace
}  // namespace triax::manager
