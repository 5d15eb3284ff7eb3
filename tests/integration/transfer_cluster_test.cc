// TransferSequence through a real kvmanager and real kvworker processes on
// loopback, driven by the client library (and kvctl): the sequence moves
// to the destination with its bytes (ReadKV and Attend equal before and
// after), the source frees its pages, the events say where each block went;
// re-encoding on the way; the destination killed and the source stopped
// mid-transfer (follow_writes keeps the transfer waiting for writes that
// have not come): the caller gets a definite error within the bound, the
// reservation comes back, the source keeps serving and a retry succeeds;
// a corrupted page (the source's --testing_corrupt_export_pages) is
// DATA_LOSS and nothing moves; transfers run while Attend runs on the same
// worker; bad requests name the field; the window named at Open moves
// with the sequence between workers of different --window_tokens; a
// prefix hit moves only the blocks the destination lacks.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/kv_client.h"
#include "common/status_matchers.h"
#include "tests/integration/cluster.h"
#include "tests/integration/reference.h"
#include "triax/v1/worker.grpc.pb.h"

namespace triax::testing {
namespace {

using ::testing::HasSubstr;
namespace v1 = triax::v1;

constexpr char kTenant[] = "acme";

class TransferClusterTest : public ::testing::Test {
 protected:
  void Start(int workers, std::vector<std::string> worker_flags = {}) {
    ClusterOptions o;
    o.num_workers = workers;
    o.worker_flags = std::move(worker_flags);
    Start(o);
  }
  void Start(const ClusterOptions& o) {
    auto c = Cluster::Start(o);
    ASSERT_THAT(c, IsOk());
    cluster_ = std::move(*c);
    ASSERT_THAT(cluster_->CreateTenant(kTenant), IsOk());
    auto cl = cluster_->NewClient(kTenant);
    ASSERT_THAT(cl, IsOk());
    client_ = std::move(*cl);
  }

  size_t Elems() const {
    return size_t{model_.n_kv_heads()} * model_.head_dim();
  }

  // Opens a sequence of `tokens` tokens under `policy`; writes every layer
  // unless `write` is false.
  client::SequenceHandle Open(uint32_t tokens, const std::string& policy = "",
                              bool write = true) {
    auto h = client_->Open(model_,
                           {MakeSpan(v1::ROLE_SYSTEM, tokens / 2),
                            MakeSpan(v1::ROLE_USER, tokens - tokens / 2)},
                           policy);
    EXPECT_THAT(h, IsOk());
    if (!h.ok()) return {};
    if (write) {
      for (uint32_t l = 0; l < model_.n_layers(); ++l) WriteLayer(*h, l);
    }
    return *h;
  }

  void WriteLayer(const client::SequenceHandle& h, uint32_t layer) {
    const uint32_t n = static_cast<uint32_t>(h.num_tokens);
    auto k = RandomVector(n * Elems(), &rng_);
    auto v = RandomVector(n * Elems(), &rng_);
    ASSERT_THAT(client_->WriteKV(h, layer, 0, n, k.data(), v.data()), IsOk());
  }

  // ReadKV of every layer as BF16 bytes (what the pages hold).
  std::vector<std::string> ReadAll(const client::SequenceHandle& h) {
    std::vector<std::string> out;
    for (uint32_t l = 0; l < model_.n_layers(); ++l) {
      std::vector<float> k, v;
      EXPECT_THAT(
          client_->ReadKV(h, l, 0, static_cast<uint32_t>(h.num_tokens), &k, &v),
          IsOk());
      out.push_back(
          std::string(reinterpret_cast<const char*>(k.data()), k.size() * 4) +
          std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4));
    }
    return out;
  }

  std::vector<float> Attend(const client::SequenceHandle& h, uint32_t layer,
                            const std::vector<float>& q,
                            absl::Status* status = nullptr) {
    std::vector<float> out(q.size(), 0);
    const uint64_t pos = h.num_tokens - 1;
    client::Client::AttendArgs a;
    a.layer = layer;
    a.num_queries = 1;
    a.positions = &pos;
    a.q = q.data();
    a.out = out.data();
    const absl::Status s = client_->Attend(h, a);
    if (status != nullptr) {
      *status = s;
    } else {
      EXPECT_THAT(s, IsOk());
    }
    return out;
  }

  std::vector<float> Query() {
    return RandomVector(size_t{model_.n_q_heads()} * model_.head_dim(), &rng_);
  }

  // The sequences a worker holds and the pool bytes in use (GetInventory).
  v1::Inventory Inventory(int worker) {
    auto stub = v1::Worker::NewStub(
        grpc::CreateChannel(cluster_->worker_process(worker)->address(),
                            grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    v1::Inventory inv;
    EXPECT_TRUE(stub->GetInventory(&ctx, v1::GetInventoryRequest(), &inv).ok());
    return inv;
  }

  static bool Holds(const v1::Inventory& inv, const std::string& seq) {
    for (const std::string& s : inv.sequence_ids()) {
      if (s == seq) return true;
    }
    return false;
  }

  static int WorkerIndex(const std::string& id) {
    return std::stoi(id.substr(1));
  }

  // Every stored event of `seq` (WatchEvents with replay_only).
  std::vector<v1::Event> Events(const std::string& seq) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    v1::WatchEventsRequest req;
    req.set_from_id(1);  // from the first retained event
    req.set_sequence_id(seq);
    req.set_replay_only(true);
    auto reader = cluster_->manager()->WatchEvents(&ctx, req);
    std::vector<v1::Event> out;
    v1::Event e;
    while (reader->Read(&e)) out.push_back(e);
    EXPECT_TRUE(reader->Finish().ok());
    return out;
  }

  uint64_t TenantBytes() {
    auto t = cluster_->GetTenant(kTenant);
    EXPECT_THAT(t, IsOk());
    uint64_t bytes = 0;
    for (const auto& u : t->usage()) bytes += u.used_bytes();
    return bytes;
  }

  static v1::ModelShape FourLayers() {
    v1::ModelShape m = SmallModel();
    m.set_n_layers(4);
    return m;
  }
  v1::ModelShape model_ = FourLayers();
  std::mt19937 rng_{11};
  std::unique_ptr<Cluster> cluster_;
  std::unique_ptr<client::Client> client_;
};

TEST_F(TransferClusterTest, MovesTheSequenceWithItsBytesAndTheSourceFrees) {
  Start(2);
  client::SequenceHandle h = Open(100);
  auto info = client_->GetSequence(h.sequence_id);
  ASSERT_THAT(info, IsOk());
  const std::string src = info->worker_id();
  const std::string dst = src == "w0" ? "w1" : "w0";
  const std::vector<std::string> before = ReadAll(h);
  const std::vector<float> q = Query();
  const std::vector<float> attend_before = Attend(h, 1, q);
  const uint64_t tenant_before = TenantBytes();

  client::Client::TransferOptions o;
  o.destination_worker_id = dst;
  auto r = client_->TransferSequence(&h, o);
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->source_worker_id(), src);
  EXPECT_EQ(r->destination_worker_id(), dst);
  EXPECT_EQ(r->sequence().worker_id(), dst);
  EXPECT_TRUE(r->sequence().transfer_id().empty());
  EXPECT_EQ(r->blocks(), h.blocks.size());
  EXPECT_EQ(r->pages(), h.blocks.size() * model_.n_layers());
  EXPECT_GT(r->wire_bytes(), 0u);
  EXPECT_EQ(h.worker_address,
            cluster_->worker_process(WorkerIndex(dst))->address());

  // Same bytes and the same attention output on the destination.
  EXPECT_EQ(ReadAll(h), before);
  EXPECT_EQ(Attend(h, 1, q), attend_before);
  EXPECT_EQ(TenantBytes(), tenant_before);
  // The source let go of its copy, the destination holds it.
  ASSERT_THAT(Cluster::WaitFor("source frees", absl::Seconds(10),
                               [&]() -> absl::StatusOr<bool> {
                                 return !Holds(Inventory(WorkerIndex(src)),
                                               h.sequence_id);
                               }),
              IsOk());
  EXPECT_TRUE(Holds(Inventory(WorkerIndex(dst)), h.sequence_id));

  // Lineage ids kept; every block's path is in its events.
  std::map<uint64_t, int> transferred;
  bool started = false, committed = false;
  for (const v1::Event& e : Events(h.sequence_id)) {
    if (e.kind() == v1::EVENT_TRANSFER_STARTED) {
      started = true;
      EXPECT_EQ(e.worker_id(), dst);
      EXPECT_EQ(e.source_worker_id(), src);
    }
    if (e.kind() == v1::EVENT_BLOCK_TRANSFERRED) {
      ++transferred[e.lineage_id()];
      EXPECT_EQ(e.worker_id(), dst);
      EXPECT_EQ(e.source_worker_id(), src);
    }
    if (e.kind() == v1::EVENT_SEQUENCE_TRANSFERRED) committed = true;
  }
  EXPECT_TRUE(started);
  EXPECT_TRUE(committed);
  ASSERT_EQ(transferred.size(), h.blocks.size());
  for (const v1::BlockPlan& b : h.blocks) {
    EXPECT_EQ(transferred[b.lineage_id()], 1) << b.lineage_id();
  }

  // The moved sequence keeps working: extend on the destination, close.
  ASSERT_THAT(client_->Close(h), IsOk());
  EXPECT_FALSE(Holds(Inventory(WorkerIndex(dst)), h.sequence_id));
}

// A prefix hit (disaggregated prefill/decode): S0 (a system prompt) and S1,
// a fork of its first 64 tokens extended by a user turn, live on A. S0
// moves to B (its blocks shared with S1 move as copies); then S1 moves to B
// with first_block 4 and S0 as the prefix: only S1's own blocks travel,
// and S1 on B reads and attends as on A, also after S0 is closed.
TEST_F(TransferClusterTest, APrefixHitMovesOnlyTheBlocksTheDestinationLacks) {
  Start(2);
  // 96 tokens of bf16: 6 blocks of 16; a worker window of 32 leaves blocks
  // 0..3 sealed.
  auto s0 = client_->Open(model_, {MakeSpan(v1::ROLE_SYSTEM, 96)}, "bf16");
  ASSERT_THAT(s0, IsOk());
  for (uint32_t l = 0; l < model_.n_layers(); ++l) WriteLayer(*s0, l);
  auto s1 = client_->Fork(*s0, 64);
  ASSERT_THAT(s1, IsOk());
  ASSERT_THAT(client_->Extend(&*s1, {MakeSpan(v1::ROLE_USER, 40)},
                              /*new_turn=*/true, /*continue_last_span=*/false),
              IsOk());
  ASSERT_EQ(s1->num_tokens, 104u);
  ASSERT_EQ(s1->blocks.size(), 7u);
  for (uint32_t l = 0; l < model_.n_layers(); ++l) {
    auto k = RandomVector(40 * Elems(), &rng_);
    auto v = RandomVector(40 * Elems(), &rng_);
    ASSERT_THAT(client_->WriteKV(*s1, l, 64, 40, k.data(), v.data()), IsOk());
  }
  for (uint32_t i = 0; i < 4; ++i) {
    ASSERT_EQ(s1->blocks[i].lineage_id(), s0->blocks[i].lineage_id());
  }
  auto info = client_->GetSequence(s0->sequence_id);
  ASSERT_THAT(info, IsOk());
  const std::string src = info->worker_id();
  const std::string dst = src == "w0" ? "w1" : "w0";
  const std::vector<std::string> before = ReadAll(*s1);
  const std::vector<float> q = Query();
  const std::vector<float> attend_before = Attend(*s1, 1, q);

  client::Client::TransferOptions o;
  o.destination_worker_id = dst;
  auto r0 = client_->TransferSequence(&*s0, o);
  ASSERT_THAT(r0, IsOk());
  EXPECT_EQ(r0->blocks(), 6u);
  EXPECT_EQ(r0->shared_blocks(), 0u);

  // Through the real service: block 4 of S1 is its own, not S0's.
  client::Client::TransferOptions bad;
  bad.first_block = 5;
  bad.destination_prefix_sequence_id = s0->sequence_id;
  auto refused = client_->TransferSequence(s1->sequence_id, bad);
  EXPECT_THAT(
      refused.status(),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr(absl::StrCat(
                   "block 4: lineage ", s1->blocks[4].lineage_id(),
                   " of sequence \"", s1->sequence_id,
                   "\" differs from lineage ", s0->blocks[4].lineage_id()))));

  client::Client::TransferOptions hit;
  hit.first_block = 4;
  hit.destination_prefix_sequence_id = s0->sequence_id;
  auto r1 = client_->TransferSequence(&*s1, hit);
  ASSERT_THAT(r1, IsOk());
  EXPECT_EQ(r1->destination_worker_id(), dst);  // the prefix's worker
  EXPECT_EQ(r1->shared_blocks(), 4u);
  EXPECT_EQ(r1->blocks(), 3u);
  EXPECT_EQ(r1->pages(), 3u * model_.n_layers());
  // Only blocks 4..6 travelled, each page a BF16 page.
  const uint64_t page = 2ull * 16 * Elems() * 2;
  EXPECT_EQ(r1->wire_bytes(), 3u * model_.n_layers() * page);
  EXPECT_EQ(r1->bf16_bytes(), r1->wire_bytes());
  EXPECT_EQ(r1->sequence().worker_id(), dst);

  EXPECT_EQ(ReadAll(*s1), before);
  EXPECT_EQ(Attend(*s1, 1, q), attend_before);
  ASSERT_THAT(Cluster::WaitFor(
                  "source frees", absl::Seconds(10),
                  [&]() -> absl::StatusOr<bool> {
                    return Inventory(WorkerIndex(src)).sequence_ids_size() == 0;
                  }),
              IsOk());
  // The events say which blocks were shared there.
  int shared = 0;
  for (const v1::Event& e : Events(s1->sequence_id)) {
    if (e.kind() == v1::EVENT_BLOCK_TRANSFERRED &&
        absl::StrContains(e.detail(), "shared=true")) {
      ++shared;
      EXPECT_EQ(e.worker_id(), dst);
    }
  }
  EXPECT_EQ(shared, 4);

  // Closing the prefix leaves S1 whole on B.
  ASSERT_THAT(client_->Close(*s0), IsOk());
  EXPECT_EQ(ReadAll(*s1), before);
  EXPECT_EQ(Attend(*s1, 1, q), attend_before);
  ASSERT_THAT(client_->Close(*s1), IsOk());
  EXPECT_EQ(Inventory(WorkerIndex(dst)).sequence_ids_size(), 0);
  EXPECT_EQ(TenantBytes(), 0u);
}

TEST_F(TransferClusterTest, ReencodesOnTheWayIntoTheDestinationPolicy) {
  Start(2);
  client::SequenceHandle h = Open(160, "bf16");
  auto info = client_->GetSequence(h.sequence_id);
  ASSERT_THAT(info, IsOk());
  const uint64_t bf16_bytes = info->bytes();
  const std::vector<float> q = Query();
  const std::vector<float> exact = Attend(h, 0, q);

  client::Client::TransferOptions o;
  o.destination_policy = "int4";
  auto r = client_->TransferSequence(&h, o);
  ASSERT_THAT(r, IsOk());
  EXPECT_NE(r->destination_worker_id(), info->worker_id());
  // Sealed blocks travel as INT4; the wire carries well under BF16's bytes.
  EXPECT_LT(r->wire_bytes() * 2, r->bf16_bytes())
      << r->wire_bytes() << " of " << r->bf16_bytes();
  EXPECT_LT(r->sequence().bytes() * 2, bf16_bytes);
  for (const v1::BlockPlan& b : r->sequence().blocks()) {
    EXPECT_EQ(b.format(), v1::FORMAT_INT4) << b.lineage_id();
  }
  // Close to the BF16 output (INT4), not equal.
  const std::vector<float> after = Attend(h, 0, q);
  double err = 0, norm = 0;
  for (size_t i = 0; i < q.size(); ++i) {
    err += (after[i] - exact[i]) * (after[i] - exact[i]);
    norm += exact[i] * exact[i];
  }
  EXPECT_GT(err, 0);
  EXPECT_LT(err, 0.01 * norm);
}

// follow_writes with layers 1.. not written: the transfer waits for them,
// so a worker can be stopped or killed while it is in flight.
TEST_F(TransferClusterTest, DestinationKilledMidTransferAbortsAndARetryMoves) {
  Start(3);
  client::SequenceHandle h = Open(64, "", /*write=*/false);
  WriteLayer(h, 0);
  auto info = client_->GetSequence(h.sequence_id);
  ASSERT_THAT(info, IsOk());
  const std::string src = info->worker_id();
  std::vector<std::string> others;
  for (const std::string w : {"w0", "w1", "w2"}) {
    if (w != src) others.push_back(w);
  }
  const uint64_t tenant_before = TenantBytes();

  client::Client::TransferOptions o;
  o.destination_worker_id = others[0];
  o.follow_writes = true;
  o.timeout_ms = 8000;
  absl::StatusOr<v1::TransferSequenceResponse> r;
  std::thread t([&] { r = client_->TransferSequence(h.sequence_id, o); });
  // In flight: the sequence shows the transfer.
  ASSERT_THAT(Cluster::WaitFor("transfer in flight", absl::Seconds(10),
                               [&]() -> absl::StatusOr<bool> {
                                 auto s = client_->GetSequence(h.sequence_id);
                                 if (!s.ok()) return s.status();
                                 return !s->transfer_id().empty();
                               }),
              IsOk());
  const auto t0 = absl::Now();
  cluster_->worker_process(WorkerIndex(others[0]))->Kill();
  t.join();
  EXPECT_FALSE(r.ok());
  EXPECT_LT(absl::Now() - t0, absl::Seconds(8 + 5));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(others[0]));

  // Nothing moved: still on the source, no transfer, reservation back, the
  // source serves the rest of the writes and Attend.
  info = client_->GetSequence(h.sequence_id);
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->worker_id(), src);
  EXPECT_TRUE(info->transfer_id().empty());
  EXPECT_EQ(TenantBytes(), tenant_before);
  for (uint32_t l = 1; l < model_.n_layers(); ++l) WriteLayer(h, l);
  const std::vector<float> q = Query();
  const std::vector<float> out = Attend(h, 2, q);
  const std::vector<std::string> bytes = ReadAll(h);

  o.destination_worker_id = others[1];
  o.follow_writes = false;
  auto again = client_->TransferSequence(&h, o);
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(again->destination_worker_id(), others[1]);
  EXPECT_EQ(ReadAll(h), bytes);
  EXPECT_EQ(Attend(h, 2, q), out);
  bool failed_event = false;
  for (const v1::Event& e : Events(h.sequence_id)) {
    if (e.kind() == v1::EVENT_TRANSFER_FAILED) {
      failed_event = true;
      EXPECT_EQ(e.worker_id(), others[0]);
      EXPECT_EQ(e.source_worker_id(), src);
    }
  }
  EXPECT_TRUE(failed_event);
}

TEST_F(TransferClusterTest, SourceStoppedMidTransferIsADeadlineThenARetry) {
  Start(2);
  client::SequenceHandle h = Open(64, "", /*write=*/false);
  WriteLayer(h, 0);
  auto info = client_->GetSequence(h.sequence_id);
  ASSERT_THAT(info, IsOk());
  const std::string src = info->worker_id();
  const std::string dst = src == "w0" ? "w1" : "w0";
  Process* source = cluster_->worker_process(WorkerIndex(src));

  client::Client::TransferOptions o;
  o.destination_worker_id = dst;
  o.follow_writes = true;
  o.timeout_ms = 1500;
  absl::StatusOr<v1::TransferSequenceResponse> r;
  const auto t0 = absl::Now();
  std::thread t([&] { r = client_->TransferSequence(h.sequence_id, o); });
  ASSERT_THAT(Cluster::WaitFor("transfer in flight", absl::Seconds(10),
                               [&]() -> absl::StatusOr<bool> {
                                 auto s = client_->GetSequence(h.sequence_id);
                                 if (!s.ok()) return s.status();
                                 return !s->transfer_id().empty();
                               }),
              IsOk());
  ASSERT_THAT(source->Pause(), IsOk());
  t.join();
  const absl::Duration took = absl::Now() - t0;
  ASSERT_THAT(source->Resume(), IsOk());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded)
      << r.status();
  EXPECT_LT(took, absl::Seconds(1.5 + 5));
  // The destination holds nothing; the source finishes the writes; a retry
  // without follow_writes moves it.
  ASSERT_THAT(Cluster::WaitFor("destination empty", absl::Seconds(10),
                               [&]() -> absl::StatusOr<bool> {
                                 return !Holds(Inventory(WorkerIndex(dst)),
                                               h.sequence_id);
                               }),
              IsOk());
  for (uint32_t l = 1; l < model_.n_layers(); ++l) WriteLayer(h, l);
  const std::vector<std::string> bytes = ReadAll(h);
  o.follow_writes = false;
  o.timeout_ms = 10000;
  auto again = client_->TransferSequence(&h, o);
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(ReadAll(h), bytes);
}

TEST_F(TransferClusterTest, CorruptedPageIsDataLossAndNothingMoves) {
  Start(2, {"--testing_corrupt_export_pages=3"});
  client::SequenceHandle h = Open(100);
  auto info = client_->GetSequence(h.sequence_id);
  ASSERT_THAT(info, IsOk());
  const std::vector<std::string> bytes = ReadAll(h);
  const uint64_t tenant_before = TenantBytes();
  auto r = client_->TransferSequence(&h, {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("CRC32C"));
  info = client_->GetSequence(h.sequence_id);
  ASSERT_THAT(info, IsOk());
  EXPECT_TRUE(info->transfer_id().empty());
  EXPECT_EQ(TenantBytes(), tenant_before);
  // The source copy is intact and still served.
  EXPECT_EQ(ReadAll(h), bytes);
}

TEST_F(TransferClusterTest, TransfersRunWhileAttendRuns) {
  Start(2);
  // Three sequences on one worker (w0 is placed first when both are empty
  // or not; use the first one's worker for the others by retrying Opens).
  client::SequenceHandle busy = Open(96);
  auto busy_info = client_->GetSequence(busy.sequence_id);
  ASSERT_THAT(busy_info, IsOk());
  const std::vector<float> q = Query();
  const std::vector<float> busy_out = Attend(busy, 3, q);
  std::vector<client::SequenceHandle> moving;
  std::vector<std::vector<std::string>> moving_bytes;
  for (int i = 0; i < 4; ++i) {
    moving.push_back(Open(80));
    moving_bytes.push_back(ReadAll(moving.back()));
  }
  std::atomic<bool> stop{false};
  std::atomic<int> attends{0}, mismatches{0};
  std::thread attender([&] {
    while (!stop.load()) {
      absl::Status s;
      if (Attend(busy, 3, q, &s) != busy_out || !s.ok()) ++mismatches;
      ++attends;
    }
  });
  std::vector<std::thread> movers;
  std::vector<absl::Status> results(moving.size());
  for (size_t i = 0; i < moving.size(); ++i) {
    movers.emplace_back([&, i] {
      auto r = client_->TransferSequence(&moving[i], {});
      results[i] = r.status();
    });
  }
  for (std::thread& t : movers) t.join();
  stop = true;
  attender.join();
  EXPECT_GT(attends.load(), 0);
  EXPECT_EQ(mismatches.load(), 0);
  for (size_t i = 0; i < moving.size(); ++i) {
    ASSERT_THAT(results[i], IsOk()) << i;
    EXPECT_EQ(ReadAll(moving[i]), moving_bytes[i]) << i;
  }
}

TEST_F(TransferClusterTest, BadRequestsNameTheField) {
  Start(2);
  client::SequenceHandle h = Open(40);
  auto info = client_->GetSequence(h.sequence_id);
  ASSERT_THAT(info, IsOk());
  client::Client::TransferOptions o;
  o.destination_worker_id = "w9";
  auto r = client_->TransferSequence(h.sequence_id, o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("w9"));
  o.destination_worker_id = info->worker_id();
  r = client_->TransferSequence(h.sequence_id, o);
  EXPECT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(info->worker_id()));
  o.destination_worker_id = "";
  o.destination_policy = "no-such-policy";
  r = client_->TransferSequence(h.sequence_id, o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("no-such-policy"));
  r = client_->TransferSequence("no-such-sequence", {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  // None of them left a mark.
  info = client_->GetSequence(h.sequence_id);
  ASSERT_THAT(info, IsOk());
  EXPECT_TRUE(info->transfer_id().empty());
}

TEST_F(TransferClusterTest, KvctlTransferMovesASequence) {
  Start(2);
  client::SequenceHandle h = Open(48);
  auto info = client_->GetSequence(h.sequence_id);
  ASSERT_THAT(info, IsOk());
  const std::string dst = info->worker_id() == "w0" ? "w1" : "w0";
  std::string out, err;
  auto rc =
      RunToCompletion("kvctl",
                      {absl::StrCat("--manager=", cluster_->manager_address()),
                       absl::StrCat("--tenant=", kTenant), "transfer",
                       h.sequence_id, absl::StrCat("--to=", dst)},
                      cluster_->dir(), &out, &err);
  ASSERT_THAT(rc, IsOk());
  EXPECT_EQ(*rc, 0) << err;
  EXPECT_THAT(out, HasSubstr(dst));
  info = client_->GetSequence(h.sequence_id);
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->worker_id(), dst);
  rc = RunToCompletion("kvctl",
                       {absl::StrCat("--manager=", cluster_->manager_address()),
                        "trace", std::to_string(h.blocks[0].lineage_id())},
                       cluster_->dir(), &out, &err);
  ASSERT_THAT(rc, IsOk());
  EXPECT_EQ(*rc, 0) << err;
  EXPECT_THAT(out, HasSubstr(dst));
}

// Tokens of `layer` that read back exactly as written (BF16: still in the
// window), counted from the end; the others were sealed into INT4. Sealing
// goes block by block from the front, so written - this is the seal point.
uint64_t SealedTokens(client::Client* c, const client::SequenceHandle& h,
                      uint32_t layer, const std::vector<float>& k_written,
                      size_t elems) {
  std::vector<float> k, v;
  EXPECT_THAT(
      c->ReadKV(h, layer, 0, static_cast<uint32_t>(h.num_tokens), &k, &v),
      IsOk());
  const std::vector<float> want = RoundToBf16(k_written);
  EXPECT_EQ(k.size(), want.size());
  uint64_t exact_tail = 0;
  for (uint64_t t = h.num_tokens; t > 0 && k.size() == want.size(); --t) {
    bool exact = true;
    for (size_t i = (t - 1) * elems; i < t * elems; ++i) {
      exact = exact && k[i] == want[i];
    }
    if (!exact) break;
    ++exact_tail;
  }
  return h.num_tokens - exact_tail;
}

TEST_F(TransferClusterTest, WindowNamedAtOpenTravelsWithTheSequence) {
  // The workers' own windows (8 and 48 tokens) differ from the sequence's
  // (16): blocks of 16 tokens seal once 16 tokens follow them.
  ClusterOptions o;
  o.num_workers = 2;
  o.per_worker_flags = {{"--window_tokens=8"}, {"--window_tokens=48"}};
  Start(o);
  client::OpenOptions open;
  open.policy = "int4";
  open.window_tokens = 16;
  auto opened = client_->Open(
      model_, {MakeSpan(v1::ROLE_SYSTEM, 32), MakeSpan(v1::ROLE_USER, 32)},
      open);
  ASSERT_THAT(opened, IsOk());
  client::SequenceHandle h = *opened;
  const size_t elems = Elems();
  std::vector<std::vector<float>> k_all(model_.n_layers());
  auto write = [&](uint64_t first, uint32_t n) {
    for (uint32_t l = 0; l < model_.n_layers(); ++l) {
      auto k = RandomVector(n * elems, &rng_);
      auto v = RandomVector(n * elems, &rng_);
      ASSERT_THAT(client_->WriteKV(h, l, first, n, k.data(), v.data()), IsOk());
      k_all[l].insert(k_all[l].end(), k.begin(), k.end());
    }
  };
  write(0, 64);
  // 64 written, window 16: blocks ending at or before 48 are sealed (with
  // the source's own 8 they would be the same; 48 would seal only 16).
  for (uint32_t l = 0; l < model_.n_layers(); ++l) {
    ASSERT_EQ(SealedTokens(client_.get(), h, l, k_all[l], elems), 48u);
  }
  const std::vector<std::string> bytes_before = ReadAll(h);
  const std::vector<float> q = Query();
  const std::vector<float> attend_before = Attend(h, 1, q);

  auto moved = client_->TransferSequence(&h, {});
  ASSERT_THAT(moved, IsOk());
  ASSERT_NE(moved->destination_worker_id(), moved->source_worker_id());
  EXPECT_EQ(ReadAll(h), bytes_before);
  EXPECT_EQ(Attend(h, 1, q), attend_before);

  // 8 more tokens (72): window 16 seals nothing new (the next block ends
  // at 64 > 56); the destination's own window would seal 64 (w0's 8) or
  // unseal nothing but have sealed only 16 (w1's 48). The client sends the
  // sequence's window with the Extend's AllocatePages: the destination
  // must hold the same one or it refuses the plan.
  ASSERT_THAT(client_->Extend(&h, {MakeSpan(v1::ROLE_USER, 8)},
                              /*new_turn=*/false, /*continue_last_span=*/true),
              IsOk());
  write(64, 8);
  for (uint32_t l = 0; l < model_.n_layers(); ++l) {
    EXPECT_EQ(SealedTokens(client_.get(), h, l, k_all[l], elems), 48u)
        << "layer " << l << " on " << moved->destination_worker_id();
  }
  // 8 more (80): block 3 (ending at 64) seals, as window 16 says.
  ASSERT_THAT(client_->Extend(&h, {MakeSpan(v1::ROLE_USER, 8)},
                              /*new_turn=*/false, /*continue_last_span=*/true),
              IsOk());
  write(72, 8);
  for (uint32_t l = 0; l < model_.n_layers(); ++l) {
    EXPECT_EQ(SealedTokens(client_.get(), h, l, k_all[l], elems), 64u)
        << "layer " << l << " on " << moved->destination_worker_id();
  }
  ASSERT_THAT(client_->Close(h), IsOk());
}

}  // namespace
}  // namespace triax::testing
