// The manager service over real gRPC on 127.0.0.1:0: status codes and
// messages for bad input on every RPC (and that nothing changed), and
// request-id idempotency.
#include "kvmanager/manager_service.h"

#include "absl/strings/str_cat.h"
#include "kvmanager/manager_service_test_util.h"

namespace triax::manager {
namespace {

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
  auto open_with = [&](const std::function<void(v1::OpenSequenceRequest&)>& f) {
    return [=]() {
      v1::OpenSequenceRequest r = OpenReq();
      f(r);
      v1::OpenSequenceResponse resp;
      return Call(&v1::Manager::Stub::OpenSequence, r, &resp);
    };
  };
  auto extend_with =
      [&](const std::function<void(v1::ExtendSequenceRequest&)>& f) {
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
  auto register_with =
      [&](const std::function<void(v1::RegisterWorkerRequest&)>& f) {
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
  auto tenant_with =
      [&](const std::function<void(v1::CreateTenantRequest&)>& f) {
        return [=]() {
          v1::CreateTenantRequest r;
          r.set_tenant_id("newco");
          f(r);
          v1::CreateTenantResponse resp;
          return Call(&v1::Manager::Stub::CreateTenant, r, &resp);
        };
      };
  auto budget_with = [&](const std::function<void(v1::SetBudgetRequest&)>& f) {
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
  auto fork_with = [&](const std::function<void(v1::ForkSequenceRequest&)>& f) {
    return [=]() {
      v1::ForkSequenceRequest r;
      r.set_tenant_id("acme");
      r.set_parent_sequence_id(seq);
      f(r);
      v1::ForkSequenceResponse resp;
      return Call(&v1::Manager::Stub::ForkSequence, r, &resp);
    };
  };
  auto close_with =
      [&](const std::function<void(v1::CloseSequenceRequest&)>& f) {
        return [=]() {
          v1::CloseSequenceRequest r;
          r.set_tenant_id("acme");
          r.set_sequence_id(seq);
          f(r);
          v1::CloseSequenceResponse resp;
          return Call(&v1::Manager::Stub::CloseSequence, r, &resp);
        };
      };
  auto truncate_with =
      [&](const std::function<void(v1::TruncateSequenceRequest&)>& f) {
        return [=]() {
          v1::TruncateSequenceRequest r;
          r.set_tenant_id("acme");
          r.set_sequence_id(seq);
          r.set_num_tokens(1);
          f(r);
          v1::TruncateSequenceResponse resp;
          return Call(&v1::Manager::Stub::TruncateSequence, r, &resp);
        };
      };
  auto get_with = [&](const std::string& tenant, const std::string& id) {
    return [=]() {
      v1::GetSequenceRequest r;
      r.set_tenant_id(tenant);
      r.set_sequence_id(id);
      v1::GetSequenceResponse resp;
      return Call(&v1::Manager::Stub::GetSequence, r, &resp);
    };
  };
  auto heartbeat_with = [&](const std::string& worker, int format) {
    return [=]() {
      v1::HeartbeatRequest r;
      r.set_worker_id(worker);
      r.mutable_inventory()->add_formats()->set_format(
          static_cast<v1::Format>(format));
      v1::HeartbeatResponse resp;
      return Call(&v1::Manager::Stub::Heartbeat, r, &resp);
    };
  };
  auto list_seq = [&](const std::string& tenant) {
    return [=]() {
      v1::ListSequencesRequest r;
      r.set_tenant_id(tenant);
      v1::ListSequencesResponse resp;
      return Call(&v1::Manager::Stub::ListSequences, r, &resp);
    };
  };
  auto put_with = [&](const std::function<void(v1::PutPolicyRequest&)>& f) {
    return [=]() {
      v1::PutPolicyRequest r = PolicyReq();
      f(r);
      v1::PutPolicyResponse resp;
      return Call(&v1::Manager::Stub::PutPolicy, r, &resp);
    };
  };
  auto demote_with =
      [&](const std::function<void(v1::DemoteBlocksRequest&)>& f) {
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
      {"truncate to 0", truncate_with([](auto& r) { r.set_num_tokens(0); }),
       C::INVALID_ARGUMENT, "num_tokens is 0"},
      {"truncate past the end",
       truncate_with([](auto& r) { r.set_num_tokens(1ull << 40); }),
       C::INVALID_ARGUMENT, "num_tokens 1099511627776 exceeds the"},
      {"truncate unknown",
       truncate_with([](auto& r) { r.set_sequence_id("seq-77"); }),
       C::NOT_FOUND, "\"seq-77\""},
      {"truncate other tenant",
       truncate_with([](auto& r) { r.set_tenant_id("other"); }),
       C::PERMISSION_DENIED, "another tenant"},
      {"truncate bad request id",
       truncate_with([](auto& r) { r.set_request_id("a b"); }),
       C::INVALID_ARGUMENT, "request_id"},
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

// A request id reused with other fields: FAILED_PRECONDITION naming the id
// and the RPC, nothing applied; the identical request still gets the first
// reply.
TEST_F(ServiceTest, RequestIdReusedForAnotherPayloadIsRefused) {
  const auto refused = [](const grpc::Status& s, const std::string& id,
                          const std::string& method) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << s.error_message();
    EXPECT_EQ(s.error_message(),
              absl::StrCat("request_id=\"", id, "\" was used for a different ",
                           method, " request"));
  };
  v1::OpenSequenceRequest req = OpenReq();
  req.set_request_id("open-1");
  v1::OpenSequenceResponse a, b;
  ASSERT_TRUE(Call(&v1::Manager::Stub::OpenSequence, req, &a).ok());
  req.mutable_spans(1)->set_num_tokens(13);
  refused(Call(&v1::Manager::Stub::OpenSequence, req, &b), "open-1",
          "OpenSequence");
  req.mutable_spans(1)->set_num_tokens(12);
  ASSERT_TRUE(Call(&v1::Manager::Stub::OpenSequence, req, &b).ok());
  EXPECT_EQ(a.SerializeAsString(), b.SerializeAsString());
  const std::string seq = a.sequence().sequence_id();

  v1::ExtendSequenceRequest ext;
  ext.set_request_id("ext-1");
  ext.set_tenant_id("acme");
  ext.set_sequence_id(seq);
  auto* sp = ext.add_spans();
  sp->set_role(v1::ROLE_ASSISTANT);
  sp->set_num_tokens(16);
  v1::ExtendSequenceResponse e;
  ASSERT_TRUE(Call(&v1::Manager::Stub::ExtendSequence, ext, &e).ok());
  sp->set_num_tokens(17);
  refused(Call(&v1::Manager::Stub::ExtendSequence, ext, &e), "ext-1",
          "ExtendSequence");

  v1::TruncateSequenceRequest tr;
  tr.set_request_id("tr-1");
  tr.set_tenant_id("acme");
  tr.set_sequence_id(seq);
  tr.set_num_tokens(40);
  v1::TruncateSequenceResponse t;
  ASSERT_TRUE(Call(&v1::Manager::Stub::TruncateSequence, tr, &t).ok());
  tr.set_num_tokens(30);
  refused(Call(&v1::Manager::Stub::TruncateSequence, tr, &t), "tr-1",
          "TruncateSequence");

  v1::SetBudgetRequest sb;
  sb.set_request_id("budget-1");
  sb.set_tenant_id("acme");
  sb.mutable_budget()->set_tier(v1::TIER_DEVICE);
  sb.mutable_budget()->set_ceiling_bytes(1 << 22);
  v1::SetBudgetResponse sr;
  ASSERT_TRUE(Call(&v1::Manager::Stub::SetBudget, sb, &sr).ok());
  sb.mutable_budget()->set_ceiling_bytes(1 << 23);
  refused(Call(&v1::Manager::Stub::SetBudget, sb, &sr), "budget-1",
          "SetBudget");

  v1::CloseSequenceRequest close;
  close.set_request_id("close-1");
  close.set_tenant_id("acme");
  close.set_sequence_id(seq);
  v1::CloseSequenceResponse c;
  ASSERT_TRUE(Call(&v1::Manager::Stub::CloseSequence, close, &c).ok());
  const std::string other = Open();
  close.set_sequence_id(other);
  refused(Call(&v1::Manager::Stub::CloseSequence, close, &c), "close-1",
          "CloseSequence");

  // Nothing of the refused requests applied: `other` is open, the budget
  // is the first one, the first sequence closed at 40 tokens.
  v1::GetSequenceRequest gs;
  gs.set_tenant_id("acme");
  gs.set_sequence_id(other);
  v1::GetSequenceResponse g;
  ASSERT_TRUE(Call(&v1::Manager::Stub::GetSequence, gs, &g).ok());
  EXPECT_EQ(g.sequence().state(), v1::SEQUENCE_STATE_OPEN);
  gs.set_sequence_id(seq);
  ASSERT_TRUE(Call(&v1::Manager::Stub::GetSequence, gs, &g).ok());
  EXPECT_EQ(g.sequence().num_tokens(), 40u);
  v1::ListTenantsResponse lt;
  ASSERT_TRUE(
      Call(&v1::Manager::Stub::ListTenants, v1::ListTenantsRequest(), &lt)
          .ok());
  for (const auto& tenant : lt.tenants()) {
    if (tenant.tenant_id() != "acme") continue;
    for (const auto& budget : tenant.budgets()) {
      if (budget.tier() == v1::TIER_DEVICE) {
        EXPECT_EQ(budget.ceiling_bytes(), uint64_t{1} << 22);
      }
    }
  }
}

}  // namespace
}  // namespace triax::manager
