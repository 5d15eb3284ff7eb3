// The client library with ClientOptions::manager_stream (the sequence calls
// on one Manager.SequenceCalls stream) against real kvmanager and kvworker
// processes: a session gives the same plans and the same attention as the
// unary RPCs, many threads share the stream, and after the manager is
// killed and restarted the next calls open a new stream and serve.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/kv_client.h"
#include "common/status_matchers.h"
#include "tests/integration/cluster.h"
#include "tests/integration/reference.h"

namespace triax::testing {
namespace {

using triax::v1::ROLE_ASSISTANT;
using triax::v1::ROLE_SYSTEM;
using triax::v1::ROLE_USER;

class ManagerStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto c = Cluster::Start(ClusterOptions());
    ASSERT_THAT(c, IsOk());
    cluster_ = std::move(*c);
    ASSERT_THAT(cluster_->CreateTenant("acme"), IsOk());
  }

  std::unique_ptr<client::Client> NewClient(bool stream) {
    client::ClientOptions o;
    o.manager_address = cluster_->manager_address();
    o.tenant_id = "acme";
    o.rpc_timeout_ms = 5000;
    o.manager_stream = stream;
    auto c = client::Client::Connect(o);
    EXPECT_THAT(c, IsOk());
    return c.ok() ? std::move(*c) : nullptr;
  }

  // One session: open, write, attend, extend (a new turn), fork, close.
  // Returns the plans' encodings and lineage counts, and the outputs.
  struct Session {
    std::vector<std::string> encodings;
    std::vector<float> out;
    uint64_t tokens = 0;
    uint64_t fork_tokens = 0;
  };
  Session Run(client::Client* c) {
    Session r;
    const v1::ModelShape m = SmallModel();
    auto opened = c->Open(
        m, {MakeSpan(ROLE_SYSTEM, 40), MakeSpan(ROLE_USER, 24)}, "", 16);
    EXPECT_THAT(opened, IsOk());
    if (!opened.ok()) return r;
    client::SequenceHandle h = *opened;
    std::mt19937 rng(7);
    const size_t elems = size_t{m.n_kv_heads()} * m.head_dim();
    for (uint32_t l = 0; l < m.n_layers(); ++l) {
      auto k = RandomVector(64 * elems, &rng);
      auto v = RandomVector(64 * elems, &rng);
      EXPECT_THAT(c->WriteKV(h, l, 0, 64, k.data(), v.data()), IsOk());
    }
    const std::vector<uint64_t> pos = {63, 10};
    auto q = RandomVector(pos.size() * m.n_q_heads() * m.head_dim(), &rng);
    r.out.assign(q.size(), 0.f);
    client::Client::AttendArgs a;
    a.layer = 1;
    a.num_queries = pos.size();
    a.positions = pos.data();
    a.q = q.data();
    a.out = r.out.data();
    EXPECT_THAT(c->Attend(h, a), IsOk());
    EXPECT_THAT(c->Extend(&h, {MakeSpan(ROLE_ASSISTANT, 20)}, true, false),
                IsOk());
    for (const auto& b : h.blocks) {
      r.encodings.push_back(client::EncodingLabel(triax::EncodingFromProto(b)));
    }
    r.tokens = h.num_tokens;
    auto fork = c->Fork(h, 32);
    EXPECT_THAT(fork, IsOk());
    if (fork.ok()) {
      r.fork_tokens = fork->num_tokens;
      EXPECT_THAT(c->Close(*fork), IsOk());
    }
    EXPECT_THAT(c->Close(h), IsOk());
    return r;
  }

  std::unique_ptr<Cluster> cluster_;
};

TEST_F(ManagerStreamTest, ASessionIsTheSameAsWithUnaryCalls) {
  auto unary = NewClient(false);
  auto streamed = NewClient(true);
  ASSERT_NE(unary, nullptr);
  ASSERT_NE(streamed, nullptr);
  const Session u = Run(unary.get());
  const Session s = Run(streamed.get());
  EXPECT_EQ(s.encodings, u.encodings);
  EXPECT_EQ(s.tokens, 84u);
  EXPECT_EQ(s.tokens, u.tokens);
  EXPECT_EQ(s.fork_tokens, 32u);
  EXPECT_EQ(s.out, u.out);  // the same KV, the same bytes out
  // A call's error comes back as the unary call's: an unknown sequence.
  auto gone = streamed->GetSequence("no-such-sequence");
  EXPECT_THAT(gone, StatusIs(absl::StatusCode::kNotFound,
                             ::testing::HasSubstr("GetSequence")));
}

TEST_F(ManagerStreamTest, ManyThreadsShareTheStream) {
  auto c = NewClient(true);
  ASSERT_NE(c, nullptr);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10; ++i) {
        auto h = c->Open(SmallModel(), {MakeSpan(ROLE_USER, 20)}, "", 16);
        if (!h.ok()) {
          ++failures;
          continue;
        }
        if (!c->Extend(&*h, {MakeSpan(ROLE_ASSISTANT, 8)}, true, false).ok())
          ++failures;
        if (h->num_tokens != 28) ++failures;
        if (!c->Close(*h).ok()) ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST_F(ManagerStreamTest, TheStreamReopensAfterTheManagerRestarts) {
  auto c = NewClient(true);
  ASSERT_NE(c, nullptr);
  auto first = c->Open(SmallModel(), {MakeSpan(ROLE_USER, 20)}, "", 16);
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT(cluster_->RestartManager(/*kill9=*/true), IsOk());
  // The stream broke with the process; the next calls open another one
  // (the first may still see the old one end: UNAVAILABLE).
  ASSERT_THAT(
      Cluster::WaitFor("a sequence call after the restart", absl::Seconds(15),
                       [&]() -> absl::StatusOr<bool> {
                         return c->GetSequence(first->sequence_id).ok();
                       }),
      IsOk());
  // Placement needs the worker back (it registers again).
  ASSERT_THAT(cluster_->WaitForWorkerState("w0", v1::WORKER_STATE_UP), IsOk());
  auto second = c->Open(SmallModel(), {MakeSpan(ROLE_USER, 20)}, "", 16);
  ASSERT_THAT(second, IsOk());
  EXPECT_NE(second->sequence_id, first->sequence_id);
  EXPECT_THAT(c->Close(*second), IsOk());
  EXPECT_THAT(c->Close(*first), IsOk());
}

}  // namespace
}  // namespace triax::testing
