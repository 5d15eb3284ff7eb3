// ManagerCore with the embedded store (metadata_store.h): what a restarted
// core recovers from the store, and the reconciliation of sequences that
// were in doubt — a DemoteBlocks prepared (its worker may have applied it)
// but not committed when the manager stopped.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <memory>
#include <string>

#include "common/clock.h"
#include "common/status_matchers.h"
#include "kvmanager/manager_core.h"
#include "kvmanager/metadata_store.h"

namespace triax::manager {
namespace {

using ::testing::ElementsAre;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

constexpr uint64_t kBf16 = 16384;  // a block of Model() in BF16
constexpr uint64_t kInt4 = 5632;   // ... in INT4

ModelShape Model() { return ModelShape{"test", 2, 2, 4, 64}; }

class DurableCoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl =
        (std::filesystem::temp_directory_path() / "durable-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    Start();
  }

  // A core on the store in dir_ (recovering what it holds).
  void Start() {
    core_.reset();
    store_.reset();
    MetadataStoreOptions o;
    o.dir = dir_;
    RecoveredState recovered;
    auto store = MetadataStore::Open(o, &recovered);
    ASSERT_THAT(store, IsOk());
    store_ = std::move(*store);
    auto core = ManagerCore::Create(ManagerOptions{}, &clock_);
    ASSERT_THAT(core, IsOk());
    core_ = std::move(*core);
    ASSERT_THAT(core_->Restore(std::move(recovered)), IsOk());
    core_->SetJournal(store_.get());
  }

  // The manager "crashes": the core goes without finishing anything.
  void Restart() {
    core_->SetJournal(nullptr);
    Start();
  }

  Inventory Holding(const std::string& seq) {
    Inventory inv;
    inv.capacity_bytes = 1ull << 40;
    inv.sequence_ids = {seq};
    return inv;
  }

  FakeClock clock_;
  std::string dir_;
  std::unique_ptr<MetadataStore> store_;
  std::unique_ptr<ManagerCore> core_;
};

TEST_F(DurableCoreTest, APreparedDemoteIsReconciledWithWhatTheWorkerHolds) {
  RegisterWorkerRequest w{"", "w1", "127.0.0.1:9001", "cpu", 1ull << 40};
  w.incarnation = "inc-1";
  ASSERT_THAT(core_->RegisterWorker(w), IsOk());
  ASSERT_THAT(core_->CreateTenant({"", "acme", {}, ""}), IsOk());
  OpenSequenceRequest open;
  open.tenant_id = "acme";
  open.model = Model();
  open.policy = "bf16";
  open.spans = {Span{Role::kUser, Modality::kText, 32}};
  auto s = core_->OpenSequence(open);
  ASSERT_THAT(s, IsOk());
  ASSERT_EQ(s->blocks.size(), 2u);
  const uint64_t l0 = s->blocks[0].lineage_id;
  const uint64_t l1 = s->blocks[1].lineage_id;
  DemoteBlocksRequest demote;
  demote.tenant_id = "acme";
  demote.sequence_id = s->sequence_id;
  demote.blocks = {
      BlockEncoding{l0, EncodingSpec{Format::kINT4, Format(0), 0, 0}}};
  auto prepared = core_->PrepareDemote(demote);
  ASSERT_THAT(prepared, IsOk());

  // Stopped before CommitDemote: the worker may or may not have demoted.
  Restart();
  auto back = core_->GetSequence("acme", s->sequence_id);
  ASSERT_THAT(back, IsOk());
  EXPECT_EQ(back->blocks[0].encoding.k, Format::kBF16);  // as committed
  EXPECT_EQ(back->bytes, 2 * kBf16);

  // Its first heartbeat: the sequence is held, and in doubt.
  auto hb = core_->Heartbeat("w1", Holding(s->sequence_id), "inc-1");
  ASSERT_THAT(hb, IsOk());
  EXPECT_THAT(hb->describe_sequence_ids, ElementsAre(s->sequence_id));
  EXPECT_EQ(hb->worker_address, "127.0.0.1:9001");
  // Only the first report asks.
  auto again = core_->Heartbeat("w1", Holding(s->sequence_id), "inc-1");
  ASSERT_THAT(again, IsOk());
  EXPECT_TRUE(again->describe_sequence_ids.empty());

  // The worker had applied it: block 0 is INT4 there, block 1 spilled to
  // host (a tier plan it finished too).
  Inventory described;
  Inventory::Described d;
  d.sequence_id = s->sequence_id;
  BlockSpec b0;
  b0.index = 0;
  b0.lineage_id = l0;
  b0.encoding = Encoding(Format::kINT4);
  b0.tier = Tier::kDevice;
  BlockSpec b1;
  b1.index = 1;
  b1.lineage_id = l1;
  b1.encoding = Encoding(Format::kBF16);
  b1.tier = Tier::kHost;
  d.blocks = {b0, b1};
  described.described = {d};
  ASSERT_THAT(core_->AdoptWorkerBlocks("w1", described), IsOk());
  auto now = core_->GetSequence("acme", s->sequence_id);
  ASSERT_THAT(now, IsOk());
  EXPECT_EQ(now->blocks[0].encoding.k, Format::kINT4);
  EXPECT_EQ(now->blocks[1].tier, Tier::kHost);
  auto t = core_->GetTenant("acme");
  ASSERT_THAT(t, IsOk());
  EXPECT_EQ(t->usage[0].used_bytes, kInt4);  // device: block 0 only
  EXPECT_EQ(t->usage[1].used_bytes, kBf16);  // host: block 1
  // The adoption is durable too.
  Restart();
  auto after = core_->GetSequence("acme", s->sequence_id);
  ASSERT_THAT(after, IsOk());
  EXPECT_EQ(after->blocks[0].encoding.k, Format::kINT4);
  EXPECT_EQ(after->blocks[1].tier, Tier::kHost);
  // A sequence that was not in doubt is not asked for.
  auto hb2 = core_->Heartbeat("w1", Holding(s->sequence_id), "inc-1");
  ASSERT_THAT(hb2, IsOk());
  EXPECT_TRUE(hb2->describe_sequence_ids.empty());
  EXPECT_THAT(
      core_->AdoptWorkerBlocks("nobody", described),
      StatusIs(absl::StatusCode::kNotFound, ::testing::HasSubstr("nobody")));
}

TEST_F(DurableCoreTest, ASequenceTheWorkerDoesNotHoldIsLostAfterARestart) {
  RegisterWorkerRequest w{"", "w1", "127.0.0.1:9001", "cpu", 1ull << 40};
  w.incarnation = "inc-1";
  ASSERT_THAT(core_->RegisterWorker(w), IsOk());
  ASSERT_THAT(core_->CreateTenant({"", "acme", {}, ""}), IsOk());
  OpenSequenceRequest open;
  open.tenant_id = "acme";
  open.model = Model();
  open.spans = {Span{Role::kUser, Modality::kText, 16}};
  auto kept = core_->OpenSequence(open);
  auto gone = core_->OpenSequence(open);
  ASSERT_THAT(kept, IsOk());
  ASSERT_THAT(gone, IsOk());
  Restart();
  // Recovered workers are SUSPECT until they report.
  auto workers = core_->ListWorkers();
  ASSERT_EQ(workers.size(), 1u);
  EXPECT_EQ(workers[0].state, WorkerState::kSuspect);
  ASSERT_THAT(core_->Heartbeat("w1", Holding(kept->sequence_id), "inc-1"),
              IsOk());
  auto k = core_->GetSequence("acme", kept->sequence_id);
  auto g = core_->GetSequence("acme", gone->sequence_id);
  ASSERT_THAT(k, IsOk());
  ASSERT_THAT(g, IsOk());
  EXPECT_EQ(k->state, SequenceState::kOpen);
  EXPECT_EQ(g->state, SequenceState::kLost);
  EXPECT_EQ(g->lost_lineage_ids.size(), 1u);
  EXPECT_EQ(core_->ListWorkers()[0].state, WorkerState::kUp);
}

}  // namespace
}  // namespace triax::manager
