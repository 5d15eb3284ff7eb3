// A worker paused with SIGSTOP and continued with SIGCONT, as an operator
// might: past --worker_timeout_ms it is SUSPECT (its sequences stay OPEN,
// calls that need it are UNAVAILABLE), past --worker_down_timeout_ms DOWN
// (its sequences LOST); once continued it comes back with the same
// incarnation and nothing is lost (sequences OPEN with their blocks, Attend
// and ReadKV give the same bytes) and nothing leaks (a sequence closed while
// it was paused is freed on the worker; after closing everything the
// worker's inventory is empty). Waits on conditions, no fixed sleeps.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <random>
#include <string>
#include <vector>

#include "client/kv_client.h"
#include "common/status_matchers.h"
#include "tests/integration/cluster.h"
#include "tests/integration/reference.h"

namespace triax::testing {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

absl::StatusOr<triax::v1::Inventory> WorkerInventory(client::Client* client,
                                                     const std::string& addr) {
  auto w = client->worker(addr);
  if (!w.ok()) return w.status();
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  triax::v1::GetInventoryRequest req;
  triax::v1::Inventory inv;
  const grpc::Status s = (*w)->GetInventory(&ctx, req, &inv);
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        s.error_message());
  }
  return inv;
}

bool Holds(const triax::v1::Inventory& inv, const std::string& seq) {
  for (const std::string& id : inv.sequence_ids()) {
    if (id == seq) return true;
  }
  return false;
}

std::vector<uint64_t> Lineages(const triax::v1::SequenceInfo& info) {
  std::vector<uint64_t> out;
  for (const auto& b : info.blocks()) out.push_back(b.lineage_id());
  return out;
}

// Every event kind the manager logged for worker w0, from the start.
std::vector<triax::v1::EventKind> WorkerEvents(Cluster* cluster) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(500));
  triax::v1::WatchEventsRequest req;
  req.set_from_id(1);
  auto reader = cluster->manager()->WatchEvents(&ctx, req);
  std::vector<triax::v1::EventKind> out;
  triax::v1::Event e;
  while (reader->Read(&e)) {
    if (e.sequence_id().empty() && e.worker_id() == "w0") {
      out.push_back(e.kind());
    }
  }
  reader->Finish();
  return out;
}

// Opens two sequences with KV, pauses the worker until it is SUSPECT (and
// DOWN when `past_down`), closes one of them through the manager while it
// is paused, continues it and checks that nothing was lost or leaked.
void PauseAndResume(const ClusterOptions& o, bool past_down) {
  auto started = Cluster::Start(o);
  ASSERT_THAT(started, IsOk());
  Cluster& cluster = **started;
  ASSERT_THAT(cluster.CreateTenant("acme"), IsOk());
  auto client = cluster.NewClient("acme");
  ASSERT_THAT(client, IsOk());

  const triax::v1::ModelShape model = SmallModel();
  auto kept = (*client)->Open(model,
                              {MakeSpan(triax::v1::ROLE_SYSTEM, 16),
                               MakeSpan(triax::v1::ROLE_USER, 20)},
                              "bf16", 16);
  ASSERT_THAT(kept, IsOk());
  auto closed =
      (*client)->Open(model, {MakeSpan(triax::v1::ROLE_USER, 16)}, "bf16", 16);
  ASSERT_THAT(closed, IsOk());
  std::mt19937 rng(2026);
  const size_t per_token = size_t{model.n_kv_heads()} * model.head_dim();
  for (uint32_t l = 0; l < model.n_layers(); ++l) {
    auto k = RandomVector(36 * per_token, &rng);
    auto v = RandomVector(36 * per_token, &rng);
    ASSERT_THAT((*client)->WriteKV(*kept, l, 0, 36, k.data(), v.data()),
                IsOk());
    ASSERT_THAT((*client)->WriteKV(*closed, l, 0, 16, k.data(), v.data()),
                IsOk());
  }
  std::vector<float> q =
      RandomVector(size_t{model.n_q_heads()} * model.head_dim(), &rng);
  std::vector<float> before(q.size()), after(q.size());
  const uint64_t pos = 35;
  client::Client::AttendArgs a;
  a.positions = &pos;
  a.q = q.data();
  a.out = before.data();
  ASSERT_THAT((*client)->Attend(*kept, a), IsOk());
  std::vector<float> k_before, v_before;
  ASSERT_THAT((*client)->ReadKV(*kept, 1, 0, 36, &k_before, &v_before), IsOk());
  auto plan = (*client)->GetSequence(kept->sequence_id);
  ASSERT_THAT(plan, IsOk());
  const std::vector<uint64_t> lineages = Lineages(*plan);
  ASSERT_EQ(lineages.size(), 3u);
  auto inv = WorkerInventory(client->get(), kept->worker_address);
  ASSERT_THAT(inv, IsOk());
  ASSERT_GT(inv->used_bytes(), 0u);
  ASSERT_TRUE(Holds(*inv, closed->sequence_id));

  Process* worker = cluster.worker_process(0);
  ASSERT_THAT(worker->Pause(), IsOk());
  ASSERT_THAT(cluster.WaitForWorkerState("w0", triax::v1::WORKER_STATE_SUSPECT),
              IsOk());
  auto suspect = (*client)->GetSequence(kept->sequence_id);
  ASSERT_THAT(suspect, IsOk());
  EXPECT_EQ(suspect->state(), triax::v1::SEQUENCE_STATE_OPEN);
  // Growing needs the worker: UNAVAILABLE naming it.
  client::SequenceHandle grow = *kept;
  EXPECT_THAT((*client)->Extend(&grow, {MakeSpan(triax::v1::ROLE_USER, 2)},
                                false, false),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("worker \"w0\" of sequence_id")));
  // The client gives up on the paused worker and closes through the
  // manager alone.
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(5));
    triax::v1::CloseSequenceRequest req;
    req.set_tenant_id("acme");
    req.set_sequence_id(closed->sequence_id);
    triax::v1::CloseSequenceResponse resp;
    const grpc::Status s = cluster.manager()->CloseSequence(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  if (past_down) {
    ASSERT_THAT(cluster.WaitForWorkerState("w0", triax::v1::WORKER_STATE_DOWN),
                IsOk());
    auto lost = (*client)->GetSequence(kept->sequence_id);
    ASSERT_THAT(lost, IsOk());
    EXPECT_EQ(lost->state(), triax::v1::SEQUENCE_STATE_LOST);
    auto w = cluster.GetWorker("w0");
    ASSERT_THAT(w, IsOk());
    EXPECT_EQ(w->reserved_bytes(), 0u);
  }

  ASSERT_THAT(worker->Resume(), IsOk());
  ASSERT_THAT(cluster.WaitForWorkerState("w0", triax::v1::WORKER_STATE_UP),
              IsOk());
  ASSERT_THAT(
      Cluster::WaitFor("the kept sequence to be OPEN", absl::Seconds(10),
                       [&]() -> absl::StatusOr<bool> {
                         auto s = (*client)->GetSequence(kept->sequence_id);
                         if (!s.ok()) return s.status();
                         return s->state() == triax::v1::SEQUENCE_STATE_OPEN;
                       }),
      IsOk());

  // Nothing lost: the same blocks, the same bytes.
  auto back = (*client)->GetSequence(kept->sequence_id);
  ASSERT_THAT(back, IsOk());
  EXPECT_THAT(Lineages(*back), ElementsAreArray(lineages));
  EXPECT_EQ(back->bytes(), plan->bytes());
  a.out = after.data();
  ASSERT_THAT((*client)->Attend(*kept, a), IsOk());
  EXPECT_EQ(after, before);
  std::vector<float> k_after, v_after;
  ASSERT_THAT((*client)->ReadKV(*kept, 1, 0, 36, &k_after, &v_after), IsOk());
  EXPECT_EQ(k_after, k_before);
  EXPECT_EQ(v_after, v_before);
  client::SequenceHandle grown = *kept;
  EXPECT_THAT((*client)->Extend(&grown, {MakeSpan(triax::v1::ROLE_USER, 2)},
                                false, false),
              IsOk());

  // Nothing leaks: the sequence closed meanwhile is freed on the worker...
  ASSERT_THAT(
      Cluster::WaitFor("the worker to free the sequence closed while paused",
                       absl::Seconds(10),
                       [&]() -> absl::StatusOr<bool> {
                         auto inv = WorkerInventory(client->get(),
                                                    kept->worker_address);
                         if (!inv.ok()) return inv.status();
                         return !Holds(*inv, closed->sequence_id);
                       }),
      IsOk());
  // ...and closing the rest leaves nothing held.
  ASSERT_THAT((*client)->Close(grown), IsOk());
  triax::v1::Inventory last;
  ASSERT_THAT(
      Cluster::WaitFor("the worker's inventory to be empty", absl::Seconds(10),
                       [&]() -> absl::StatusOr<bool> {
                         auto inv = WorkerInventory(client->get(),
                                                    kept->worker_address);
                         if (!inv.ok()) return inv.status();
                         last = *inv;
                         return inv->sequence_ids_size() == 0;
                       }),
      IsOk());
  EXPECT_EQ(last.used_bytes(), 0u);
  auto w = cluster.GetWorker("w0");
  ASSERT_THAT(w, IsOk());
  EXPECT_EQ(w->reserved_bytes(), 0u);
  EXPECT_EQ(w->sequences(), 0u);
  auto tenant = cluster.GetTenant("acme");
  ASSERT_THAT(tenant, IsOk());
  for (const auto& u : tenant->usage()) EXPECT_EQ(u.used_bytes(), 0u);

  // The event log tells the story: suspect, (down,) recovered, and the
  // worker came back under the same incarnation (one WORKER_UP only when
  // it never went down).
  const std::vector<triax::v1::EventKind> events = WorkerEvents(&cluster);
  std::vector<triax::v1::EventKind> want = {triax::v1::EVENT_WORKER_UP,
                                            triax::v1::EVENT_WORKER_SUSPECT};
  if (past_down) {
    want.push_back(triax::v1::EVENT_WORKER_DOWN);
    want.push_back(triax::v1::EVENT_WORKER_UP);
  }
  want.push_back(triax::v1::EVENT_WORKER_RECOVERED);
  EXPECT_THAT(events, ElementsAreArray(want));
}

TEST(WorkerPauseTest, PausedPastTheSuspectTimeoutLosesNothing) {
  ClusterOptions o;
  o.worker_timeout_ms = 400;
  o.worker_down_timeout_ms = 60000;
  o.heartbeat_interval_ms = 100;
  PauseAndResume(o, /*past_down=*/false);
}

TEST(WorkerPauseTest, PausedPastTheDownTimeoutComesBackWithItsSequences) {
  ClusterOptions o;
  o.worker_timeout_ms = 300;
  o.worker_down_timeout_ms = 900;
  o.heartbeat_interval_ms = 100;
  PauseAndResume(o, /*past_down=*/true);
}

}  // namespace
}  // namespace triax::testing
