// The isolation suite of docs/security.md on real processes: every Manager
// RPC without a token, and with another tenant's token where it names the
// first tenant's objects or needs another role; every Worker RPC without a
// capability, with another tenant's, with the tenant's own where only the
// manager may call, and with an expired one. Each is refused with
// UNAUTHENTICATED or PERMISSION_DENIED, and afterwards nothing changed: the
// tenants, tokens, workers and acme's sequence with its KV are as before.
#include <grpcpp/grpcpp.h>

#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "client/attend_stream.h"
#include "client/sequence_call_stream.h"
#include "common/capability.h"
#include "tests/integration/auth_fixture.h"
#include "tests/integration/reference.h"
#include "triax/v1/worker.grpc.pb.h"

namespace triax::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using RpcCall = std::function<grpc::Status(grpc::ClientContext*)>;

struct Rpc {
  std::string name;
  RpcCall call;
};

grpc::Status RunRpc(const RpcCall& call, const std::string& token,
                    const std::vector<v1::Capability>& caps) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  AddBearer(&ctx, token);
  AddCapabilities(&ctx, caps);
  return call(&ctx);
}

class IsolationTest : public AuthTest {
 protected:
  void SetUp() override {
    AuthTest::SetUp();
    ASSERT_TRUE(CreateTenant(admin_, "acme").ok());
    ASSERT_TRUE(CreateTenant(admin_, "beta").ok());
    a_ = Issue("tenant", "acme", "acme.token");
    b_ = Issue("tenant", "beta", "beta.token");
    Issue("worker", "", "worker.token");
    worker_ = StartWorker("w0", "worker.token");
    ASSERT_THAT(WaitForWorker("w0"), IsOk());
    acme_ = ClientFor("acme", a_);
    auto seq =
        acme_->Open(SmallModel(), {MakeSpan(v1::ROLE_SYSTEM, 32)}, "bf16");
    ASSERT_THAT(seq, IsOk());
    seq_ = *seq;
    const v1::ModelShape m = SmallModel();
    std::mt19937 rng(11);
    k_ = RoundToBf16(RandomVector(32 * m.n_kv_heads() * m.head_dim(), &rng));
    for (uint32_t l = 0; l < m.n_layers(); ++l) {
      ASSERT_THAT(acme_->WriteKV(seq_, l, 0, 32, k_.data(), k_.data()), IsOk());
    }
    beta_ = ClientFor("beta", b_);
    auto theirs =
        beta_->Open(SmallModel(), {MakeSpan(v1::ROLE_USER, 16)}, "bf16");
    ASSERT_THAT(theirs, IsOk());
    theirs_ = *theirs;
    worker_stub_ = v1::Worker::NewStub(grpc::CreateChannel(
        worker_->address(), grpc::InsecureChannelCredentials()));
  }

  // What the suite checks is unchanged after every refusal.
  std::string State() {
    std::string out;
    for (const std::string& t : TenantIds(admin_)) out += t + ",";
    out += "|";
    for (const std::string& w : WorkerIds()) out += w + ",";
    out += "|";
    EXPECT_EQ(Kvctl({"tokens"}, admin_file_), 0) << err_;
    out += out_;
    v1::GetSequenceRequest get;
    get.set_tenant_id("acme");
    get.set_sequence_id(seq_.sequence_id);
    v1::GetSequenceResponse got;
    EXPECT_TRUE(RunRpc(
                    [&](grpc::ClientContext* c) {
                      return stub_->GetSequence(c, get, &got);
                    },
                    admin_, {})
                    .ok());
    got.mutable_sequence()->clear_capabilities();
    out += got.sequence().DebugString();
    return out;
  }

  // Manager RPCs, each naming acme's objects where it names any.
  std::vector<Rpc> ManagerRpcs() {
    const std::string s = seq_.sequence_id;
    const uint64_t lineage = seq_.blocks[0].lineage_id();
    std::vector<Rpc> r;
    auto add = [&](const std::string& name, RpcCall c) {
      r.push_back({name, std::move(c)});
    };
    add("RegisterWorker", [&](grpc::ClientContext* c) {
      v1::RegisterWorkerRequest q;
      q.set_worker_id("rogue");
      q.set_address("127.0.0.1:1");
      q.set_capacity_bytes(1ull << 40);
      v1::RegisterWorkerResponse p;
      return stub_->RegisterWorker(c, q, &p);
    });
    add("Heartbeat", [&](grpc::ClientContext* c) {
      v1::HeartbeatRequest q;
      q.set_worker_id("w0");
      v1::HeartbeatResponse p;
      return stub_->Heartbeat(c, q, &p);
    });
    add("ListWorkers", [&](grpc::ClientContext* c) {
      v1::ListWorkersResponse p;
      return stub_->ListWorkers(c, {}, &p);
    });
    add("CreateTenant", [&](grpc::ClientContext* c) {
      v1::CreateTenantRequest q;
      q.set_tenant_id("evil");
      v1::CreateTenantResponse p;
      return stub_->CreateTenant(c, q, &p);
    });
    add("SetBudget", [&](grpc::ClientContext* c) {
      v1::SetBudgetRequest q;
      q.set_tenant_id("acme");
      q.mutable_budget()->set_tier(v1::TIER_DEVICE);
      q.mutable_budget()->set_ceiling_bytes(1);
      v1::SetBudgetResponse p;
      return stub_->SetBudget(c, q, &p);
    });
    add("OpenSequence", [&](grpc::ClientContext* c) {
      v1::OpenSequenceRequest q;
      q.set_tenant_id("acme");
      *q.mutable_model() = SmallModel();
      *q.add_spans() = MakeSpan(v1::ROLE_USER, 16);
      v1::OpenSequenceResponse p;
      return stub_->OpenSequence(c, q, &p);
    });
    add("ExtendSequence", [&, s](grpc::ClientContext* c) {
      v1::ExtendSequenceRequest q;
      q.set_tenant_id("acme");
      q.set_sequence_id(s);
      *q.add_spans() = MakeSpan(v1::ROLE_USER, 16);
      v1::ExtendSequenceResponse p;
      return stub_->ExtendSequence(c, q, &p);
    });
    add("ForkSequence", [&, s](grpc::ClientContext* c) {
      v1::ForkSequenceRequest q;
      q.set_tenant_id("acme");
      q.set_parent_sequence_id(s);
      v1::ForkSequenceResponse p;
      return stub_->ForkSequence(c, q, &p);
    });
    add("CloseSequence", [&, s](grpc::ClientContext* c) {
      v1::CloseSequenceRequest q;
      q.set_tenant_id("acme");
      q.set_sequence_id(s);
      v1::CloseSequenceResponse p;
      return stub_->CloseSequence(c, q, &p);
    });
    add("TruncateSequence", [&, s](grpc::ClientContext* c) {
      v1::TruncateSequenceRequest q;
      q.set_tenant_id("acme");
      q.set_sequence_id(s);
      q.set_num_tokens(1);
      v1::TruncateSequenceResponse p;
      return stub_->TruncateSequence(c, q, &p);
    });
    add("GetSequence", [&, s](grpc::ClientContext* c) {
      v1::GetSequenceRequest q;
      q.set_tenant_id("acme");
      q.set_sequence_id(s);
      v1::GetSequenceResponse p;
      return stub_->GetSequence(c, q, &p);
    });
    add("ListSequences", [&](grpc::ClientContext* c) {
      v1::ListSequencesRequest q;
      q.set_tenant_id("acme");
      v1::ListSequencesResponse p;
      return stub_->ListSequences(c, q, &p);
    });
    add("PutPolicy", [&](grpc::ClientContext* c) {
      v1::PutPolicyRequest q;
      q.mutable_policy()->set_name("evil");
      v1::PutPolicyResponse p;
      return stub_->PutPolicy(c, q, &p);
    });
    add("DemoteBlocks", [&, s](grpc::ClientContext* c) {
      v1::DemoteBlocksRequest q;
      q.set_tenant_id("acme");
      q.set_sequence_id(s);
      v1::DemoteBlocksResponse p;
      return stub_->DemoteBlocks(c, q, &p);
    });
    add("TransferSequence", [&, s](grpc::ClientContext* c) {
      v1::TransferSequenceRequest q;
      q.set_tenant_id("acme");
      q.set_sequence_id(s);
      v1::TransferSequenceResponse p;
      return stub_->TransferSequence(c, q, &p);
    });
    add("PutCalibration", [&](grpc::ClientContext* c) {
      v1::PutCalibrationRequest q;
      v1::PutCalibrationResponse p;
      return stub_->PutCalibration(c, q, &p);
    });
    add("ReportAccess", [&, s](grpc::ClientContext* c) {
      v1::ReportAccessRequest q;
      q.set_tenant_id("acme");
      q.set_sequence_id(s);
      q.set_active(true);
      v1::ReportAccessResponse p;
      return stub_->ReportAccess(c, q, &p);
    });
    add("GetPressure", [&](grpc::ClientContext* c) {
      v1::GetPressureResponse p;
      return stub_->GetPressure(c, {}, &p);
    });
    add("QueryTrace", [&, lineage](grpc::ClientContext* c) {
      v1::QueryTraceRequest q;
      q.set_lineage_id(lineage);
      v1::QueryTraceResponse p;
      return stub_->QueryTrace(c, q, &p);
    });
    add("WatchEvents", [&](grpc::ClientContext* c) {
      v1::WatchEventsRequest q;
      q.set_tenant_id("acme");
      q.set_from_id(1);
      q.set_replay_only(true);
      auto reader = stub_->WatchEvents(c, q);
      v1::Event e;
      while (reader->Read(&e)) {
      }
      return reader->Finish();
    });
    add("IssueToken", [&](grpc::ClientContext* c) {
      v1::IssueTokenRequest q;
      q.set_role("admin");
      v1::IssueTokenResponse p;
      return stub_->IssueToken(c, q, &p);
    });
    add("RevokeToken", [&](grpc::ClientContext* c) {
      v1::RevokeTokenRequest q;
      q.set_token_id(a_.substr(5, 16));
      v1::RevokeTokenResponse p;
      return stub_->RevokeToken(c, q, &p);
    });
    add("ListTokens", [&](grpc::ClientContext* c) {
      v1::ListTokensResponse p;
      return stub_->ListTokens(c, {}, &p);
    });
    add("PlanCapacity", [&](grpc::ClientContext* c) {
      v1::PlanCapacityRequest q;
      v1::PlanCapacityResponse p;
      return stub_->PlanCapacity(c, q, &p);
    });
    return r;
  }

  // Worker RPCs on acme's sequence; `manager_only`: what only the
  // manager's capabilities allow.
  std::vector<Rpc> WorkerRpcs(bool manager_only) {
    const std::string s = seq_.sequence_id;
    v1::Worker::Stub* w = worker_stub_.get();
    std::vector<Rpc> r;
    auto add = [&](const std::string& name, RpcCall c) {
      r.push_back({name, std::move(c)});
    };
    if (!manager_only) {
      add("AllocatePages", [w, s](grpc::ClientContext* c) {
        v1::AllocatePagesRequest q;
        q.set_tenant_id("acme");
        q.set_sequence_id(s);
        *q.mutable_model() = SmallModel();
        q.set_block_tokens(16);
        q.add_blocks()->set_num_tokens(16);
        v1::AllocatePagesResponse p;
        return w->AllocatePages(c, q, &p);
      });
      add("ForkSequence", [w, s](grpc::ClientContext* c) {
        v1::WorkerForkRequest q;
        q.set_tenant_id("acme");
        q.set_parent_sequence_id(s);
        q.set_child_sequence_id("stolen");
        v1::WorkerForkResponse p;
        return w->ForkSequence(c, q, &p);
      });
      add("WriteKV", [w, s](grpc::ClientContext* c) {
        v1::WriteKVResponse p;
        auto writer = w->WriteKV(c, &p);
        v1::WriteKVRequest q;
        q.set_tenant_id("acme");
        q.set_sequence_id(s);
        writer->Write(q);
        writer->WritesDone();
        return writer->Finish();
      });
      add("ReadKV", [w, s](grpc::ClientContext* c) {
        v1::ReadKVRequest q;
        q.set_tenant_id("acme");
        q.set_sequence_id(s);
        q.set_dtype(v1::KV_DTYPE_F32);
        auto reader = w->ReadKV(c, q);
        v1::KvChunk k;
        while (reader->Read(&k)) {
        }
        return reader->Finish();
      });
      add("Attend", [w, s](grpc::ClientContext* c) {
        v1::AttendRequest q;
        q.set_tenant_id("acme");
        q.add_items()->set_sequence_id(s);
        v1::AttendResponse p;
        return w->Attend(c, q, &p);
      });
      add("AttendStream", [w, s](grpc::ClientContext* c) {
        auto stream = w->AttendStream(c);
        v1::AttendRequest q;
        q.set_tenant_id("acme");
        q.add_items()->set_sequence_id(s);
        stream->Write(q);
        stream->WritesDone();
        v1::AttendResponse p;
        while (stream->Read(&p)) {
        }
        return stream->Finish();
      });
      add("FreePages", [w, s](grpc::ClientContext* c) {
        v1::FreePagesRequest q;
        q.set_tenant_id("acme");
        q.set_sequence_id(s);
        v1::FreePagesResponse p;
        return w->FreePages(c, q, &p);
      });
    }
    add("Demote", [w, s](grpc::ClientContext* c) {
      v1::DemoteRequest q;
      q.set_tenant_id("acme");
      q.set_sequence_id(s);
      v1::DemoteResponse p;
      return w->Demote(c, q, &p);
    });
    add("GetInventory", [w](grpc::ClientContext* c) {
      v1::Inventory p;
      return w->GetInventory(c, {}, &p);
    });
    add("Spill", [w, s](grpc::ClientContext* c) {
      v1::SpillRequest q;
      q.set_tenant_id("acme");
      q.set_sequence_id(s);
      q.set_tier(v1::TIER_HOST);
      v1::SpillResponse p;
      return w->Spill(c, q, &p);
    });
    add("Restore", [w, s](grpc::ClientContext* c) {
      v1::RestoreRequest q;
      q.set_tenant_id("acme");
      q.set_sequence_id(s);
      v1::RestoreResponse p;
      return w->Restore(c, q, &p);
    });
    add("Evict", [w, s](grpc::ClientContext* c) {
      v1::EvictRequest q;
      q.set_tenant_id("acme");
      q.set_sequence_id(s);
      v1::EvictResponse p;
      return w->Evict(c, q, &p);
    });
    add("ImportSequence", [w, s](grpc::ClientContext* c) {
      v1::ImportSequenceRequest q;
      q.set_tenant_id("acme");
      q.set_sequence_id(s + "-copy");
      v1::ImportSequenceResponse p;
      return w->ImportSequence(c, q, &p);
    });
    add("ExportPages", [w, s](grpc::ClientContext* c) {
      v1::ExportPagesRequest q;
      q.set_tenant_id("acme");
      q.set_sequence_id(s);
      auto reader = w->ExportPages(c, q);
      v1::PageBatch b;
      while (reader->Read(&b)) {
      }
      return reader->Finish();
    });
    add("SharePages", [w, s](grpc::ClientContext* c) {
      auto stream = w->SharePages(c);
      v1::SharePagesRequest q;
      q.mutable_request()->set_tenant_id("acme");
      q.mutable_request()->set_sequence_id(s);
      stream->Write(q);
      stream->WritesDone();
      v1::PageBatch b;
      while (stream->Read(&b)) {
      }
      return stream->Finish();
    });
    add("OpenLink", [w](grpc::ClientContext* c) {
      v1::OpenLinkRequest q;
      q.set_backend("tcp");
      q.set_link_id("x");
      q.set_link_key("k");
      q.set_owner("o");
      v1::OpenLinkResponse p;
      return w->OpenLink(c, q, &p);
    });
    add("LinkPages", [w, s](grpc::ClientContext* c) {
      auto stream = w->LinkPages(c);
      v1::LinkPagesRequest q;
      q.mutable_request()->set_tenant_id("acme");
      q.mutable_request()->set_sequence_id(s);
      q.set_link_key("k");
      stream->Write(q);
      stream->WritesDone();
      v1::PageBatch b;
      while (stream->Read(&b)) {
      }
      return stream->Finish();
    });
    return r;
  }

  // acme's KV is still there and still acme's.
  void ExpectAcmeIntact() {
    ASSERT_THAT(acme_->RefreshPlan(&seq_), IsOk());
    std::vector<float> rk, rv;
    ASSERT_THAT(acme_->ReadKV(seq_, 0, 0, 32, &rk, &rv), IsOk());
    EXPECT_EQ(rk, k_);
  }

  std::string a_, b_;
  std::unique_ptr<Process> worker_;
  std::unique_ptr<client::Client> acme_, beta_;
  client::SequenceHandle seq_, theirs_;
  std::vector<float> k_;
  std::unique_ptr<v1::Worker::Stub> worker_stub_;
};

TEST_F(IsolationTest, EveryManagerRpcRefusesNoTokenAndAnotherTenants) {
  const std::string before = State();
  for (const Rpc& rpc : ManagerRpcs()) {
    SCOPED_TRACE(rpc.name);
    grpc::Status s = RunRpc(rpc.call, "", {});
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(rpc.name));
    s = RunRpc(rpc.call, b_, {});
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED)
        << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("tenant \"beta\""));
  }
  EXPECT_EQ(State(), before);
  ExpectAcmeIntact();
}

// The same sequence calls on a Manager.SequenceCalls stream: the stream's
// token authorizes each call as the unary RPC's would.
TEST_F(IsolationTest, SequenceCallsOnAStreamRefuseNoTokenAndAnotherTenants) {
  const std::string before = State();
  const std::string s = seq_.sequence_id;
  std::vector<std::pair<std::string, v1::SequenceCall>> calls;
  auto add = [&](const std::string& name) {
    calls.push_back({name, v1::SequenceCall()});
    return &calls.back().second;
  };
  {
    auto* q = add("OpenSequence")->mutable_open();
    q->set_tenant_id("acme");
    *q->mutable_model() = SmallModel();
    *q->add_spans() = MakeSpan(v1::ROLE_USER, 16);
  }
  {
    auto* q = add("ExtendSequence")->mutable_extend();
    q->set_tenant_id("acme");
    q->set_sequence_id(s);
    *q->add_spans() = MakeSpan(v1::ROLE_USER, 16);
  }
  {
    auto* q = add("ForkSequence")->mutable_fork();
    q->set_tenant_id("acme");
    q->set_parent_sequence_id(s);
  }
  {
    auto* q = add("CloseSequence")->mutable_close();
    q->set_tenant_id("acme");
    q->set_sequence_id(s);
  }
  {
    auto* q = add("TruncateSequence")->mutable_truncate();
    q->set_tenant_id("acme");
    q->set_sequence_id(s);
    q->set_num_tokens(16);
  }
  {
    auto* q = add("GetSequence")->mutable_get();
    q->set_tenant_id("acme");
    q->set_sequence_id(s);
  }
  {
    auto* q = add("ReportAccess")->mutable_report_access();
    q->set_tenant_id("acme");
    q->set_sequence_id(s);
    q->set_active(true);
  }
  const auto deadline = [] {
    return std::chrono::system_clock::now() + std::chrono::seconds(5);
  };
  for (const std::string& token : {std::string(), b_}) {
    client::SequenceCallStream stream(stub_.get(), token);
    for (const auto& [name, call] : calls) {
      SCOPED_TRACE(name + (token.empty() ? " without a token" : " as beta"));
      v1::SequenceReply reply;
      const grpc::Status st = stream.Call(call, deadline(), &reply);
      if (token.empty()) {
        EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED)
            << st.error_message();
        EXPECT_THAT(st.error_message(), HasSubstr(name));
      } else {
        EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED)
            << st.error_message();
        EXPECT_THAT(st.error_message(), HasSubstr("tenant \"beta\""));
      }
      EXPECT_EQ(reply.reply_case(), v1::SequenceReply::REPLY_NOT_SET);
    }
    EXPECT_EQ(stream.streams_opened(), 1u);
  }
  EXPECT_EQ(State(), before);
  ExpectAcmeIntact();
  // acme's own token serves on a stream.
  client::SequenceCallStream own(stub_.get(), a_);
  v1::SequenceReply reply;
  const grpc::Status st = own.Call(calls[5].second, deadline(), &reply);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(reply.get().sequence().sequence_id(), s);
}

TEST_F(IsolationTest, EveryWorkerRpcRefusesCallsTheManagerDidNotSign) {
  const std::string before = State();
  for (const Rpc& rpc : WorkerRpcs(/*manager_only=*/false)) {
    SCOPED_TRACE(rpc.name);
    grpc::Status s = RunRpc(rpc.call, "", {});
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(rpc.name));
    // beta's own capability (for its own sequence) names nothing of acme's.
    s = RunRpc(rpc.call, "", theirs_.capabilities);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED)
        << s.error_message();
    // acme's capability with a field changed: forged.
    std::vector<v1::Capability> forged = seq_.capabilities;
    forged[0].set_max_tokens(1 << 20);
    s = RunRpc(rpc.call, "", forged);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << s.error_message();
  }
  // What only the manager may ask is refused with the tenant's own
  // (valid) capability.
  ASSERT_THAT(acme_->RefreshPlan(&seq_), IsOk());
  for (const Rpc& rpc : WorkerRpcs(/*manager_only=*/true)) {
    SCOPED_TRACE(rpc.name);
    const grpc::Status s = RunRpc(rpc.call, "", seq_.capabilities);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED)
        << s.error_message();
  }
  EXPECT_EQ(State(), before);
  ExpectAcmeIntact();
}

// Capabilities that expire in a second.
class ExpiryTest : public IsolationTest {
 protected:
  std::vector<std::string> ExtraManagerFlags() const override {
    return {"--capability_ttl_seconds=1"};
  }
};

TEST_F(ExpiryTest, AnExpiredCapabilityIsRefusedAndARefreshedOneServes) {
  const std::vector<v1::Capability> old = seq_.capabilities;
  absl::SleepFor(absl::Milliseconds(1100));  // --capability_ttl_seconds=1
  for (const Rpc& rpc : WorkerRpcs(/*manager_only=*/false)) {
    SCOPED_TRACE(rpc.name);
    const grpc::Status s = RunRpc(rpc.call, "", old);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("expired"));
  }
  // GetSequence signs a fresh one (RefreshPlan), which serves.
  ExpectAcmeIntact();
}

// AttendStream carries its capabilities once, in the stream's metadata,
// and checks them against every message: one that expires while the
// stream is open refuses the next message and ends the stream; a stream
// opened with the refreshed handle serves.
TEST_F(ExpiryTest, AStreamsCapabilityThatExpiresRefusesItsNextMessage) {
  ASSERT_THAT(acme_->RefreshPlan(&seq_), IsOk());  // a fresh capability
  auto stream =
      client::AttendStream::Open(acme_.get(), seq_.worker_address, {&seq_});
  ASSERT_THAT(stream, IsOk());
  const v1::ModelShape m = SmallModel();
  std::vector<float> q(m.n_q_heads() * m.head_dim(), 0.25f), out(q.size());
  std::vector<client::Client::BatchItem> items(1);
  items[0].seq = &seq_;
  items[0].args.q = q.data();
  items[0].args.out = out.data();
  auto first = (*stream)->Attend(items);
  if (!first.ok() && absl::StrContains(first.status().message(), "expired")) {
    GTEST_SKIP() << "the first message came after the 1 s capability "
                    "expired (a slow machine): "
                 << first.status();
  }
  ASSERT_THAT(first, IsOk());
  EXPECT_THAT((*first)[0], IsOk());
  absl::SleepFor(absl::Milliseconds(1100));  // --capability_ttl_seconds=1
  EXPECT_THAT((*stream)->Attend(items),
              StatusIs(absl::StatusCode::kUnauthenticated,
                       AllOf(HasSubstr("messages[1]: AttendStream"),
                             HasSubstr("expired"))));
  ASSERT_THAT(acme_->RefreshPlan(&seq_), IsOk());
  auto again =
      client::AttendStream::Open(acme_.get(), seq_.worker_address, {&seq_});
  ASSERT_THAT(again, IsOk());
  auto r = (*again)->Attend(items);
  ASSERT_THAT(r, IsOk());
  EXPECT_THAT((*r)[0], IsOk());
  EXPECT_THAT((*again)->Finish(), IsOk());
}

}  // namespace
}  // namespace triax::testing
