// The service's limits (manager_service.h ServiceLimits, ManagerOptions::
// max_sequences_per_tenant, the server's largest request): each refusal is
// RESOURCE_EXHAUSTED with a message naming the limit and its value, and a
// call within the limit still works. Real gRPC on loopback
// (manager_service_test_util.h) with small limits.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "kvmanager/manager_service.h"
#include "kvmanager/manager_service_test_util.h"

namespace triax::manager {
namespace {

class LimitsTest : public ServiceTest {
 protected:
  ManagerOptions Options() const override {
    ManagerOptions o;
    o.max_sequences_per_tenant = 2;
    return o;
  }
  ServiceLimits Limits() const override {
    ServiceLimits l;
    l.max_spans_per_request = 3;
    l.max_watchers = 2;
    l.max_events_per_watch = 4;
    return l;
  }
  int MaxMessageBytes() const override { return 64 << 10; }

  std::unique_ptr<grpc::ClientReader<v1::Event>> Watch(grpc::ClientContext* ctx,
                                                       uint64_t from_id,
                                                       bool replay_only) {
    v1::WatchEventsRequest req;
    req.set_from_id(from_id);
    req.set_max_events(0);
    req.set_replay_only(replay_only);
    return stub_->WatchEvents(ctx, req);
  }
};

TEST_F(LimitsTest, SpansPerRequest) {
  v1::OpenSequenceRequest open = OpenReq();  // 2 spans
  v1::OpenSequenceResponse resp;
  ASSERT_TRUE(Call(&v1::Manager::Stub::OpenSequence, open, &resp).ok());
  for (int i = 0; i < 2; ++i) {
    auto* s = open.add_spans();
    s->set_role(v1::ROLE_USER);
    s->set_num_tokens(1);
  }
  grpc::Status s = Call(&v1::Manager::Stub::OpenSequence, open, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("max_spans_per_request = 3"));
  EXPECT_THAT(s.error_message(), HasSubstr("4 spans"));

  v1::ExtendSequenceRequest extend;
  extend.set_tenant_id("acme");
  extend.set_sequence_id(resp.sequence().sequence_id());
  for (int i = 0; i < 4; ++i) {
    auto* sp = extend.add_spans();
    sp->set_role(v1::ROLE_USER);
    sp->set_num_tokens(2);
  }
  v1::ExtendSequenceResponse ext_resp;
  s = Call(&v1::Manager::Stub::ExtendSequence, extend, &ext_resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("max_spans_per_request = 3"));
  extend.mutable_spans()->RemoveLast();
  EXPECT_TRUE(Call(&v1::Manager::Stub::ExtendSequence, extend, &ext_resp).ok());
}

TEST_F(LimitsTest, SequencesPerTenant) {
  const std::string first = Open();
  Open();
  v1::OpenSequenceResponse resp;
  grpc::Status s = Call(&v1::Manager::Stub::OpenSequence, OpenReq(), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("max_sequences_per_tenant = 2"));
  EXPECT_THAT(s.error_message(), HasSubstr("tenant acme"));
  // A fork is a sequence too.
  v1::ForkSequenceRequest fork;
  fork.set_tenant_id("acme");
  fork.set_parent_sequence_id(first);
  fork.set_num_tokens(16);
  v1::ForkSequenceResponse fork_resp;
  s = Call(&v1::Manager::Stub::ForkSequence, fork, &fork_resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("max_sequences_per_tenant = 2"));
  // Another tenant has its own count; a closed sequence frees a place.
  Open("other");
  v1::CloseSequenceRequest close;
  close.set_tenant_id("acme");
  close.set_sequence_id(first);
  v1::CloseSequenceResponse close_resp;
  ASSERT_TRUE(Call(&v1::Manager::Stub::CloseSequence, close, &close_resp).ok());
  EXPECT_TRUE(Call(&v1::Manager::Stub::OpenSequence, OpenReq(), &resp).ok());
}

// Without the events cap, so that live watchers stay open.
class WatchersTest : public LimitsTest {
 protected:
  ServiceLimits Limits() const override {
    ServiceLimits l = LimitsTest::Limits();
    l.max_events_per_watch = 0;
    return l;
  }
};

TEST_F(WatchersTest, ConcurrentWatchers) {
  // Two live watchers hold both places; each has read one event, so the
  // server has started its stream.
  Open();
  grpc::ClientContext c1, c2, c3;
  auto w1 = Watch(&c1, 1, false);
  auto w2 = Watch(&c2, 1, false);
  v1::Event e;
  ASSERT_TRUE(w1->Read(&e));
  ASSERT_TRUE(w2->Read(&e));
  auto w3 = Watch(&c3, 1, false);
  while (w3->Read(&e)) {
  }
  grpc::Status s = w3->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("max_watchers = 2"));
  // A watcher that ends gives its place back.
  c1.TryCancel();
  while (w1->Read(&e)) {
  }
  w1->Finish();
  bool admitted = false;
  // The server counts the cancelled stream out when its reactor is done,
  // which may come after the client's Finish: retry until it has (no
  // timing assumption, only eventual release).
  for (int attempt = 0; attempt < 1000 && !admitted; ++attempt) {
    grpc::ClientContext c4;
    auto w4 = Watch(&c4, 1, true);
    int n = 0;
    while (w4->Read(&e)) ++n;
    grpc::Status f = w4->Finish();
    if (f.ok()) {
      admitted = true;
      EXPECT_GT(n, 0);
    } else {
      ASSERT_EQ(f.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    }
  }
  EXPECT_TRUE(admitted);
  c2.TryCancel();
  while (w2->Read(&e)) {
  }
  w2->Finish();
}

TEST_F(LimitsTest, EventsPerWatch) {
  for (int i = 0; i < 2; ++i) Open();  // more than 4 events with the setup
  grpc::ClientContext ctx;
  auto w = Watch(&ctx, 1, true);
  std::vector<uint64_t> ids;
  v1::Event e;
  while (w->Read(&e)) ids.push_back(e.id());
  grpc::Status s = w->Finish();
  ASSERT_EQ(ids.size(), 4u);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("max_events_per_watch = 4"));
  EXPECT_THAT(s.error_message(),
              HasSubstr("from_id = " + std::to_string(ids.back() + 1)));
}

TEST_F(LimitsTest, MessageSize) {
  v1::OpenSequenceRequest open = OpenReq();
  open.set_policy(std::string(100 << 10, 'p'));  // past the 64 KiB limit
  v1::OpenSequenceResponse resp;
  grpc::Status s = Call(&v1::Manager::Stub::OpenSequence, open, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("65536"));
}

}  // namespace
}  // namespace triax::manager
