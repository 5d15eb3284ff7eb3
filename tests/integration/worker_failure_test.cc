// A worker killed with SIGKILL mid-session: the manager marks it SUSPECT
// after --worker_timeout_ms and DOWN after --worker_down_timeout_ms, the
// sequence becomes LOST with its blocks' lineage
// ids, WatchEvents replays WORKER_DOWN and SEQUENCE_LOST, and the client's
// next Attend fails with UNAVAILABLE. A second process under a live
// worker's id is refused; a restart is taken.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <random>

#include "absl/strings/match.h"
#include "client/kv_client.h"
#include "common/status_matchers.h"
#include "tests/integration/cluster.h"
#include "tests/integration/reference.h"

namespace triax::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::UnorderedElementsAreArray;

TEST(WorkerFailureTest, KilledWorkerLosesItsSequences) {
  ClusterOptions o;
  o.worker_timeout_ms = 300;
  o.worker_down_timeout_ms = 600;
  o.heartbeat_interval_ms = 100;
  auto started = Cluster::Start(o);
  ASSERT_THAT(started, IsOk());
  Cluster& cluster = **started;
  ASSERT_THAT(cluster.CreateTenant("acme"), IsOk());
  auto client = cluster.NewClient("acme");
  ASSERT_THAT(client, IsOk());

  const triax::v1::ModelShape model = SmallModel();
  auto seq = (*client)->Open(model,
                             {MakeSpan(triax::v1::ROLE_SYSTEM, 16),
                              MakeSpan(triax::v1::ROLE_USER, 20)},
                             "bf16", 16);
  ASSERT_THAT(seq, IsOk());
  std::vector<uint64_t> lineages;
  for (const auto& b : seq->blocks) lineages.push_back(b.lineage_id());
  ASSERT_EQ(lineages.size(), 3u);
  std::mt19937 rng(11);
  const size_t elems = size_t{36} * model.n_kv_heads() * model.head_dim();
  for (uint32_t l = 0; l < model.n_layers(); ++l) {
    auto k = RandomVector(elems, &rng), v = RandomVector(elems, &rng);
    ASSERT_THAT((*client)->WriteKV(*seq, l, 0, 36, k.data(), v.data()), IsOk());
  }
  std::vector<float> q =
      RandomVector(size_t{model.n_q_heads()} * model.head_dim(), &rng);
  std::vector<float> out(q.size());
  const uint64_t pos = 35;
  client::Client::AttendArgs a;
  a.positions = &pos;
  a.q = q.data();
  a.out = out.data();
  ASSERT_THAT((*client)->Attend(*seq, a), IsOk());

  cluster.worker_process(0)->Kill();
  ASSERT_THAT(cluster.WaitForWorkerState("w0", triax::v1::WORKER_STATE_DOWN,
                                         absl::Seconds(5)),
              IsOk());

  triax::v1::SequenceInfo info;
  ASSERT_THAT(
      Cluster::WaitFor("the sequence to be LOST", absl::Seconds(3),
                       [&]() -> absl::StatusOr<bool> {
                         auto s = (*client)->GetSequence(seq->sequence_id);
                         if (!s.ok()) return s.status();
                         info = *s;
                         return s->state() == triax::v1::SEQUENCE_STATE_LOST;
                       }),
      IsOk());
  EXPECT_THAT(std::vector<uint64_t>(info.lost_lineage_ids().begin(),
                                    info.lost_lineage_ids().end()),
              UnorderedElementsAreArray(lineages));

  // The event log, replayed from the start, tells the same story.
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  triax::v1::WatchEventsRequest req;
  req.set_from_id(1);
  auto reader = cluster.manager()->WatchEvents(&ctx, req);
  bool worker_down = false, sequence_lost = false;
  uint64_t last_id = 0;
  triax::v1::Event e;
  while (!(worker_down && sequence_lost) && reader->Read(&e)) {
    EXPECT_GT(e.id(), last_id) << "event ids must increase";
    last_id = e.id();
    if (e.kind() == triax::v1::EVENT_WORKER_DOWN && e.worker_id() == "w0") {
      worker_down = true;
    }
    if (e.kind() == triax::v1::EVENT_SEQUENCE_LOST &&
        e.sequence_id() == seq->sequence_id) {
      sequence_lost = true;
      EXPECT_THAT(
          std::vector<uint64_t>(e.lineage_ids().begin(), e.lineage_ids().end()),
          UnorderedElementsAreArray(lineages));
    }
  }
  ctx.TryCancel();
  reader->Finish();
  EXPECT_TRUE(worker_down) << "no WORKER_DOWN event for w0";
  EXPECT_TRUE(sequence_lost) << "no SEQUENCE_LOST event for the sequence";

  // The data plane is gone: the client reports UNAVAILABLE.
  EXPECT_THAT((*client)->Attend(*seq, a),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("Attend")));
  // And the manager refuses to grow a lost sequence.
  client::SequenceHandle h = *seq;
  EXPECT_THAT(
      (*client)->Extend(&h, {MakeSpan(triax::v1::ROLE_USER, 2)}, false, false),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("lost")));
}

// A second kvworker started with a live worker's id (and, to look like it,
// its address) is refused, and the live worker keeps its sequence; once the
// live one is killed, a new process under the id at the same address is a
// restart: taken, the sequence LOST.
TEST(WorkerFailureTest, ASecondWorkerUnderALiveIdIsRefusedARestartTaken) {
  ClusterOptions o;
  o.worker_timeout_ms = 2000;
  o.heartbeat_interval_ms = 100;
  auto started = Cluster::Start(o);
  ASSERT_THAT(started, IsOk());
  Cluster& cluster = **started;
  ASSERT_THAT(cluster.CreateTenant("acme"), IsOk());
  auto client = cluster.NewClient("acme");
  ASSERT_THAT(client, IsOk());
  auto seq = (*client)->Open(SmallModel(), {MakeSpan(triax::v1::ROLE_USER, 20)},
                             "bf16", 16);
  ASSERT_THAT(seq, IsOk());
  auto live = cluster.GetWorker("w0");
  ASSERT_THAT(live, IsOk());
  const std::string address = cluster.worker_process(0)->address();
  const auto worker_args = [&](const std::string& listen) {
    return std::vector<std::string>{
        "--listen=" + listen, "--manager=" + cluster.manager_address(),
        "--worker_id=w0",     "--advertise=" + address,
        "--pool_mb=16",       "--window_tokens=32"};
  };

  {
    auto dup = Process::Start("dup", "kvworker", worker_args("127.0.0.1:0"),
                              cluster.dir());
    ASSERT_THAT(dup, IsOk());
    ASSERT_THAT(Cluster::WaitFor("the duplicate's refusal", absl::Seconds(10),
                                 [&]() -> absl::StatusOr<bool> {
                                   return absl::StrContains((*dup)->Log(),
                                                            "cannot take it");
                                 }),
                IsOk());
    EXPECT_THAT((*dup)->Log(), HasSubstr("is up at address"));
    auto w0 = cluster.GetWorker("w0");
    ASSERT_THAT(w0, IsOk());
    EXPECT_EQ(w0->state(), triax::v1::WORKER_STATE_UP);
    EXPECT_EQ(w0->incarnation(), live->incarnation());
    auto info = (*client)->GetSequence(seq->sequence_id);
    ASSERT_THAT(info, IsOk());
    EXPECT_EQ(info->state(), triax::v1::SEQUENCE_STATE_OPEN);
  }

  cluster.worker_process(0)->Kill();
  auto restarted = Process::Start("w0-restarted", "kvworker",
                                  worker_args(address), cluster.dir());
  ASSERT_THAT(restarted, IsOk());
  ASSERT_THAT(Cluster::WaitFor("w0 to register again", absl::Seconds(10),
                               [&]() -> absl::StatusOr<bool> {
                                 auto w = cluster.GetWorker("w0");
                                 if (!w.ok()) return w.status();
                                 return w->state() ==
                                            triax::v1::WORKER_STATE_UP &&
                                        w->incarnation() != live->incarnation();
                               }),
              IsOk())
      << (*restarted)->Log();
  auto info = (*client)->GetSequence(seq->sequence_id);
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->state(), triax::v1::SEQUENCE_STATE_LOST);
}

}  // namespace
}  // namespace triax::testing
