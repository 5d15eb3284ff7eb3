// Identity and roles (docs/security.md) on real processes: a kvmanager with
// --auth=token, kvworkers with worker tokens, tenants with their own tokens,
// kvctl issuing and revoking them. Every refused call is checked for its
// code and for leaving the manager's state as it was.
#include <grpcpp/grpcpp.h>
#include <sys/stat.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/bearer.h"
#include "common/capability.h"
#include "common/grpc_status.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/auth_fixture.h"
#include "tests/integration/cluster.h"
#include "tests/integration/process.h"
#include "tests/integration/reference.h"
#include "triax/v1/manager.grpc.pb.h"
#include "triax/v1/worker.grpc.pb.h"

namespace triax::testing {
namespace {

using ::testing::HasSubstr;

TEST_F(AuthTest, CallsWithoutAValidTokenAreUnauthenticatedAndChangeNothing) {
  ASSERT_TRUE(CreateTenant(admin_, "acme").ok());
  const std::string good = Issue("tenant", "acme", "acme.token");
  std::string id = good.substr(5, 16);
  const std::string forged =
      absl::StrCat("tkv1.", id, ".", std::string(43, 'A'));
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "no bearer token"},
      {"not-a-token", "not of the form"},
      {"tkv1.0123456789abcdef." + std::string(43, 'x'), "unknown or revoked"},
      {forged, "the secret does not match"},
  };
  for (const auto& [token, why] : bad) {
    grpc::Status s = CreateTenant(token, "evil");
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << token;
    EXPECT_THAT(s.error_message(), HasSubstr(why));
    EXPECT_THAT(s.error_message(), HasSubstr("CreateTenant"));
    // The secret is never echoed.
    EXPECT_THAT(s.error_message(),
                ::testing::Not(HasSubstr(std::string(43, 'A'))));
    v1::ListSequencesResponse seqs;
    s = Call(token, [&](grpc::ClientContext* ctx) {
      return stub_->ListSequences(ctx, {}, &seqs);
    });
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  EXPECT_THAT(TenantIds(admin_), ::testing::ElementsAre("acme"));

  // kvctl without a token: the manager's refusal, exit 1.
  EXPECT_EQ(Kvctl({"tenants"}, ""), 1);
  EXPECT_THAT(err_, HasSubstr("UNAUTHENTICATED"));

  // Expired: a one-second token after two seconds.
  const std::string brief =
      Issue("tenant", "acme", "brief.token", {"--ttl_seconds=1"});
  EXPECT_EQ(TenantIds(brief), std::vector<std::string>{"acme"});
  absl::SleepFor(absl::Milliseconds(2100));
  v1::ListTenantsResponse resp;
  grpc::Status s = Call(brief, [&](grpc::ClientContext* ctx) {
    return stub_->ListTenants(ctx, {}, &resp);
  });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(s.error_message(), HasSubstr("expired"));

  // Revoked: refused at once, and listed no more.
  ASSERT_EQ(Kvctl({"token-revoke", id}, admin_file_), 0) << err_;
  s = Call(good, [&](grpc::ClientContext* ctx) {
    return stub_->ListTenants(ctx, {}, &resp);
  });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  ASSERT_EQ(Kvctl({"tokens"}, admin_file_), 0) << err_;
  EXPECT_THAT(out_, ::testing::Not(HasSubstr(id)));
  EXPECT_EQ(Kvctl({"token-revoke", id}, admin_file_), 1);
  EXPECT_THAT(err_, HasSubstr("NOT_FOUND"));
}

TEST_F(AuthTest, TenantTokensCannotMakeOperatorCalls) {
  ASSERT_TRUE(CreateTenant(admin_, "acme").ok());
  const std::string t = Issue("tenant", "acme", "acme.token");
  // Listed for the admin, without the secret.
  ASSERT_EQ(Kvctl({"tokens"}, admin_file_), 0) << err_;
  EXPECT_THAT(out_, HasSubstr(t.substr(5, 16)));
  EXPECT_THAT(out_, ::testing::Not(HasSubstr(t.substr(22))));

  auto denied = [&](const grpc::Status& s, const std::string& method) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << method;
    EXPECT_THAT(s.error_message(), HasSubstr(method));
    EXPECT_THAT(s.error_message(), HasSubstr("tenant \"acme\""));
  };
  denied(CreateTenant(t, "other"), "CreateTenant");
  v1::SetBudgetRequest budget;
  budget.set_tenant_id("acme");
  budget.mutable_budget()->set_tier(v1::TIER_DEVICE);
  budget.mutable_budget()->set_ceiling_bytes(1);
  v1::SetBudgetResponse budget_resp;
  denied(Call(t,
              [&](grpc::ClientContext* ctx) {
                return stub_->SetBudget(ctx, budget, &budget_resp);
              }),
         "SetBudget");
  v1::IssueTokenRequest issue;
  issue.set_role("admin");
  v1::IssueTokenResponse issue_resp;
  denied(Call(t,
              [&](grpc::ClientContext* ctx) {
                return stub_->IssueToken(ctx, issue, &issue_resp);
              }),
         "IssueToken");
  v1::ListWorkersResponse workers;
  denied(Call(t,
              [&](grpc::ClientContext* ctx) {
                return stub_->ListWorkers(ctx, {}, &workers);
              }),
         "ListWorkers");
  v1::GetPressureResponse pressure;
  denied(Call(t,
              [&](grpc::ClientContext* ctx) {
                return stub_->GetPressure(ctx, {}, &pressure);
              }),
         "GetPressure");
  v1::PutPolicyRequest policy;
  policy.mutable_policy()->set_name("mine");
  v1::PutPolicyResponse policy_resp;
  denied(Call(t,
              [&](grpc::ClientContext* ctx) {
                return stub_->PutPolicy(ctx, policy, &policy_resp);
              }),
         "PutPolicy");
  // Nothing changed: one tenant, its budget as created, one token.
  EXPECT_THAT(TenantIds(admin_), ::testing::ElementsAre("acme"));
  v1::ListTenantsResponse tenants;
  ASSERT_TRUE(Call(admin_, [&](grpc::ClientContext* ctx) {
                return stub_->ListTenants(ctx, {}, &tenants);
              }).ok());
  for (const auto& b : tenants.tenants(0).budgets()) {
    EXPECT_NE(b.ceiling_bytes(), 1u) << "SetBudget applied";
  }
  ASSERT_EQ(Kvctl({"tokens"}, admin_file_), 0);
  EXPECT_EQ(std::count(out_.begin(), out_.end(), '\n'), 2) << out_;
  // Read-only tables every user needs stay open to a tenant.
  v1::ListPoliciesResponse policies;
  EXPECT_TRUE(Call(t, [&](grpc::ClientContext* ctx) {
                return stub_->ListPolicies(ctx, {}, &policies);
              }).ok());
  EXPECT_GT(policies.policies_size(), 0);
}

TEST_F(AuthTest, OnlyWorkerTokensRegisterWorkers) {
  ASSERT_TRUE(CreateTenant(admin_, "acme").ok());
  Issue("tenant", "acme", "acme.token");
  Issue("worker", "", "worker.token");
  // No token, then a tenant's token: never registered.
  auto anonymous = StartWorker("w-anon", "");
  auto tenant = StartWorker("w-tenant", "acme.token");
  auto real = StartWorker("w-real", "worker.token");
  ASSERT_THAT(WaitForWorker("w-real"), IsOk())
      << real->Log() << cluster_->manager_process()->Log();
  absl::SleepFor(absl::Milliseconds(500));  // several registration attempts
  EXPECT_THAT(WorkerIds(), ::testing::ElementsAre("w-real"));
  // Each refusal is in the worker's log (16 UNAUTHENTICATED, 7
  // PERMISSION_DENIED).
  EXPECT_THAT(anonymous->Log(), HasSubstr("code=16"));
  EXPECT_THAT(anonymous->Log(), HasSubstr("no bearer token"));
  EXPECT_THAT(tenant->Log(), HasSubstr("code=7"));
  EXPECT_THAT(tenant->Log(), HasSubstr("is not a worker token"));
  // A heartbeat as the real worker with an admin token is refused too.
  v1::HeartbeatRequest hb;
  hb.set_worker_id("w-real");
  v1::HeartbeatResponse hb_resp;
  grpc::Status s = Call(admin_, [&](grpc::ClientContext* ctx) {
    return stub_->Heartbeat(ctx, hb, &hb_resp);
  });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("not a worker token"));
  // A worker token is no tenant and no admin.
  const std::string w =
      ReadBearerToken("f", cluster_->dir() + "/worker.token").value_or("");
  EXPECT_EQ(CreateTenant(w, "evil").error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
}

TEST_F(AuthTest, ATenantSeesAndTouchesOnlyItsOwnSequences) {
  ASSERT_TRUE(CreateTenant(admin_, "acme").ok());
  ASSERT_TRUE(CreateTenant(admin_, "beta").ok());
  const std::string a = Issue("tenant", "acme", "acme.token");
  const std::string b = Issue("tenant", "beta", "beta.token");
  Issue("worker", "", "worker.token");
  auto worker = StartWorker("w0", "worker.token");
  ASSERT_THAT(WaitForWorker("w0"), IsOk());

  auto acme = ClientFor("acme", a);
  auto seq = acme->Open(SmallModel(), {MakeSpan(v1::ROLE_SYSTEM, 32)}, "bf16");
  ASSERT_THAT(seq, IsOk());
  const uint64_t lineage = seq->blocks[0].lineage_id();
  // beta's own sequence.
  auto beta = ClientFor("beta", b);
  ASSERT_THAT(beta->Open(SmallModel(), {MakeSpan(v1::ROLE_USER, 16)}, "bf16"),
              IsOk());

  // beta naming acme is refused on every sequence call.
  auto as_acme = ClientFor("acme", b);
  auto opened =
      as_acme->Open(SmallModel(), {MakeSpan(v1::ROLE_USER, 16)}, "bf16");
  EXPECT_EQ(opened.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(opened.status().message(),
              HasSubstr("may not act for tenant_id=\"acme\""));
  client::SequenceHandle stolen = *seq;
  EXPECT_EQ(as_acme->Extend(&stolen, {MakeSpan(v1::ROLE_USER, 8)}, true, false)
                .code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(as_acme->Close(*seq).code(), absl::StatusCode::kPermissionDenied);
  v1::GetSequenceRequest get;
  get.set_tenant_id("acme");
  get.set_sequence_id(seq->sequence_id);
  v1::GetSequenceResponse got;
  EXPECT_EQ(Call(b,
                 [&](grpc::ClientContext* ctx) {
                   return stub_->GetSequence(ctx, get, &got);
                 })
                .error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  get.clear_tenant_id();  // the operator view
  EXPECT_EQ(Call(b,
                 [&](grpc::ClientContext* ctx) {
                   return stub_->GetSequence(ctx, get, &got);
                 })
                .error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  v1::TransferSequenceRequest move;
  move.set_tenant_id("acme");
  move.set_sequence_id(seq->sequence_id);
  v1::TransferSequenceResponse moved;
  EXPECT_EQ(Call(b,
                 [&](grpc::ClientContext* ctx) {
                   return stub_->TransferSequence(ctx, move, &moved);
                 })
                .error_code(),
            grpc::StatusCode::PERMISSION_DENIED);

  // Lists, traces and events: beta's own only.
  v1::ListSequencesResponse listed;
  ASSERT_TRUE(Call(b, [&](grpc::ClientContext* ctx) {
                return stub_->ListSequences(ctx, {}, &listed);
              }).ok());
  ASSERT_EQ(listed.sequences_size(), 1);
  EXPECT_EQ(listed.sequences(0).tenant_id(), "beta");
  v1::ListSequencesRequest theirs;
  theirs.set_tenant_id("acme");
  EXPECT_EQ(Call(b,
                 [&](grpc::ClientContext* ctx) {
                   return stub_->ListSequences(ctx, theirs, &listed);
                 })
                .error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(TenantIds(b), std::vector<std::string>{"beta"});
  EXPECT_EQ(TenantIds(admin_), (std::vector<std::string>{"acme", "beta"}));
  v1::QueryTraceRequest trace;
  trace.set_lineage_id(lineage);
  v1::QueryTraceResponse traced;
  grpc::Status s = Call(b, [&](grpc::ClientContext* ctx) {
    return stub_->QueryTrace(ctx, trace, &traced);
  });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  ASSERT_TRUE(Call(a, [&](grpc::ClientContext* ctx) {
                return stub_->QueryTrace(ctx, trace, &traced);
              }).ok());
  EXPECT_GT(traced.events_size(), 0);
  // Watching: another tenant's filter is refused; no filter means its own.
  {
    v1::WatchEventsRequest w;
    w.set_tenant_id("acme");
    w.set_from_id(1);
    w.set_replay_only(true);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(5));
    AddBearer(&ctx, b);
    auto reader = stub_->WatchEvents(&ctx, w);
    v1::Event e;
    while (reader->Read(&e)) {
    }
    EXPECT_EQ(reader->Finish().error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    v1::WatchEventsRequest w;
    w.set_from_id(1);
    w.set_replay_only(true);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(5));
    AddBearer(&ctx, b);
    auto reader = stub_->WatchEvents(&ctx, w);
    v1::Event e;
    int n = 0;
    while (reader->Read(&e)) {
      EXPECT_EQ(e.tenant_id(), "beta") << e.DebugString();
      ++n;
    }
    EXPECT_TRUE(reader->Finish().ok());
    EXPECT_GT(n, 0);
  }
  // acme's sequence is untouched and still its own.
  EXPECT_THAT(acme->Close(*seq), IsOk());
}

TEST_F(AuthTest, TokensSurviveARestartAndRevocationsToo) {
  ASSERT_TRUE(CreateTenant(admin_, "acme").ok());
  const std::string kept = Issue("tenant", "acme", "kept.token");
  const std::string gone = Issue("tenant", "acme", "gone.token");
  ASSERT_EQ(Kvctl({"token-revoke", gone.substr(5, 16)}, admin_file_), 0);
  ASSERT_THAT(cluster_->RestartManager(), IsOk());
  stub_ = v1::Manager::NewStub(grpc::CreateChannel(
      cluster_->manager_address(), grpc::InsecureChannelCredentials()));
  EXPECT_EQ(TenantIds(kept), std::vector<std::string>{"acme"});
  v1::ListTenantsResponse resp;
  grpc::Status s = Call(gone, [&](grpc::ClientContext* ctx) {
    return stub_->ListTenants(ctx, {}, &resp);
  });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // The admin token file is read again.
  EXPECT_EQ(TenantIds(admin_), std::vector<std::string>{"acme"});
}

// Workers serve only what the manager signed (docs/security.md
// "Capabilities"): the tenant's own calls through the client library, the
// manager's transfers and demotions; nothing without a capability, with
// another sequence's, a forged one, another worker's, or one of a narrower
// scope.
TEST_F(AuthTest, WorkersServeOnlyCallsTheManagerSigned) {
  ASSERT_TRUE(CreateTenant(admin_, "acme").ok());
  ASSERT_TRUE(CreateTenant(admin_, "beta").ok());
  const std::string a = Issue("tenant", "acme", "acme.token");
  const std::string b = Issue("tenant", "beta", "beta.token");
  Issue("worker", "", "worker.token");
  auto w0 = StartWorker("w0", "worker.token");
  ASSERT_THAT(WaitForWorker("w0"), IsOk());
  auto acme = ClientFor("acme", a);
  // Placed on w0 (the only worker).
  auto seq = acme->Open(SmallModel(), {MakeSpan(v1::ROLE_SYSTEM, 32)}, "bf16");
  ASSERT_THAT(seq, IsOk());
  ASSERT_EQ(seq->capabilities.size(), 1u);
  EXPECT_EQ(seq->capabilities[0].worker_id(), "w0");
  EXPECT_EQ(seq->capabilities[0].scope(), v1::Capability::SCOPE_CLIENT);
  const v1::ModelShape m = SmallModel();
  const size_t n = 32 * m.n_kv_heads() * m.head_dim();
  std::mt19937 rng(7);
  const std::vector<float> k = RoundToBf16(RandomVector(n, &rng));
  const std::vector<float> v = RoundToBf16(RandomVector(n, &rng));
  for (uint32_t layer = 0; layer < m.n_layers(); ++layer) {
    ASSERT_THAT(acme->WriteKV(*seq, layer, 0, 32, k.data(), v.data()), IsOk());
  }
  std::vector<float> rk, rv;
  ASSERT_THAT(acme->ReadKV(*seq, 0, 0, 32, &rk, &rv), IsOk());
  EXPECT_EQ(rk, k);
  auto beta = ClientFor("beta", b);
  auto theirs = beta->Open(SmallModel(), {MakeSpan(v1::ROLE_USER, 16)}, "bf16");
  ASSERT_THAT(theirs, IsOk());

  auto stub = v1::Worker::NewStub(
      grpc::CreateChannel(w0->address(), grpc::InsecureChannelCredentials()));
  grpc::Status s;
  auto read = [&](const std::string& tenant,
                  const std::vector<v1::Capability>& caps) {
    v1::ReadKVRequest req;
    req.set_tenant_id(tenant);
    req.set_sequence_id(seq->sequence_id);
    req.set_dtype(v1::KV_DTYPE_F32);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(5));
    AddCapabilities(&ctx, caps);
    auto reader = stub->ReadKV(&ctx, req);
    v1::KvChunk c;
    while (reader->Read(&c)) {
    }
    return reader->Finish();
  };
  s = read("acme", seq->capabilities);
  EXPECT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
  s = read("acme", {});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(s.error_message(), HasSubstr("no capability"));
  // beta with its own capability, naming acme's sequence.
  s = read("acme", theirs->capabilities);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  s = read("beta", theirs->capabilities);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  // acme's capability with its tenant or sequence changed: forged.
  v1::Capability forged = seq->capabilities[0];
  forged.set_tenant_id("beta");
  s = read("beta", {forged});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(s.error_message(), HasSubstr("signature does not verify"));

  auto call = [&](const std::vector<v1::Capability>& caps, auto&& rpc) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(5));
    AddCapabilities(&ctx, caps);
    return rpc(&ctx);
  };
  // A plan for a tenant the manager never signed for: nothing reserved.
  v1::AllocatePagesRequest ghost;
  ghost.set_tenant_id("ghost");
  ghost.set_sequence_id("seq-ghost");
  *ghost.mutable_model() = SmallModel();
  ghost.set_block_tokens(16);
  ghost.add_blocks()->set_num_tokens(16);
  v1::AllocatePagesResponse allocated;
  s = call({}, [&](grpc::ClientContext* c) {
    return stub->AllocatePages(c, ghost, &allocated);
  });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // acme's own sequence, but a bigger plan than the manager's.
  v1::AllocatePagesRequest bigger;
  bigger.set_tenant_id("acme");
  bigger.set_sequence_id(seq->sequence_id);
  *bigger.mutable_model() = SmallModel();
  bigger.set_block_tokens(16);
  for (int i = 0; i < 64; ++i) bigger.add_blocks()->set_num_tokens(16);
  s = call(seq->capabilities, [&](grpc::ClientContext* c) {
    return stub->AllocatePages(c, bigger, &allocated);
  });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("1024 tokens exceed the 32"));
  // A tenant's capability does not demote, spill or free another's, nor
  // list the worker's inventory.
  v1::DemoteRequest demote;
  demote.set_tenant_id("acme");
  demote.set_sequence_id(seq->sequence_id);
  v1::DemoteResponse demoted;
  s = call(seq->capabilities, [&](grpc::ClientContext* c) {
    return stub->Demote(c, demote, &demoted);
  });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("does not allow a manager call"));
  v1::FreePagesRequest free;
  free.set_tenant_id("acme");
  free.set_sequence_id(seq->sequence_id);
  v1::FreePagesResponse freed;
  s = call(theirs->capabilities, [&](grpc::ClientContext* c) {
    return stub->FreePages(c, free, &freed);
  });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  v1::Inventory inventory;
  s = call(seq->capabilities, [&](grpc::ClientContext* c) {
    return stub->GetInventory(c, {}, &inventory);
  });
  EXPECT_NE(s.error_code(), grpc::StatusCode::OK);
  // Nothing changed: acme reads its KV back.
  ASSERT_THAT(acme->ReadKV(*seq, 0, 0, 32, &rk, &rv), IsOk());
  EXPECT_EQ(rk, k);

  // The manager's own worker calls carry its capabilities: a transfer to a
  // second worker (ImportSequence there, ExportPages from w0, FreePages on
  // w0) and the tenant's refreshed handle reads from the new worker.
  auto w1 = StartWorker("w1", "worker.token");
  ASSERT_THAT(WaitForWorker("w1"), IsOk());
  client::Client::TransferOptions to;
  to.destination_worker_id = "w1";
  ASSERT_THAT(acme->TransferSequence(&*seq, to), IsOk());
  ASSERT_EQ(seq->capabilities.size(), 1u);
  EXPECT_EQ(seq->capabilities[0].worker_id(), "w1");
  ASSERT_THAT(acme->ReadKV(*seq, 0, 0, 32, &rk, &rv), IsOk());
  EXPECT_EQ(rk, k);
  // A capability for w1 is no use on w0.
  s = read("acme", seq->capabilities);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(s.error_message(), HasSubstr("not this one"));
  // An operator's demotion (the manager's Demote on w1).
  ASSERT_EQ(Kvctl({"demote", seq->sequence_id,
                   std::to_string(seq->blocks[0].lineage_id()), "int4",
                   "--tenant=acme"},
                  admin_file_),
            0)
      << err_;
  EXPECT_THAT(acme->Close(*seq), IsOk());
}

TEST(AuthFlagsTest, AnAdminTokenFileOthersMayReadIsRefused) {
  auto dir = TempDir::Create("triax-auth");
  ASSERT_THAT(dir, IsOk());
  const std::string path = (*dir)->path() + "/admin.token";
  std::ofstream(path) << "tkv1.0123456789abcdef." << std::string(43, 'x')
                      << "\n";
  chmod(path.c_str(), 0644);
  std::string out, err;
  auto rc = RunToCompletion("kvmanager",
                            {"--listen=127.0.0.1:0", "--metadata=memory",
                             "--auth=token", "--admin_token_file=" + path},
                            (*dir)->path(), &out, &err);
  ASSERT_THAT(rc, IsOk());
  EXPECT_EQ(*rc, 2);
  EXPECT_THAT(err, HasSubstr("chmod 600"));
  rc = RunToCompletion(
      "kvmanager",
      {"--listen=127.0.0.1:0", "--metadata=memory", "--auth=token"},
      (*dir)->path(), &out, &err);
  ASSERT_THAT(rc, IsOk());
  EXPECT_EQ(*rc, 2);
  EXPECT_THAT(err, HasSubstr("needs --admin_token_file"));
  rc = RunToCompletion(
      "kvmanager",
      {"--listen=127.0.0.1:0", "--metadata=memory", "--auth=bogus"},
      (*dir)->path(), &out, &err);
  ASSERT_THAT(rc, IsOk());
  EXPECT_EQ(*rc, 2);
  EXPECT_THAT(err, HasSubstr("--auth=bogus"));
}

}  // namespace
}  // namespace triax::testing
