// Placement and admission on the worker's reported frames
// (worker_registry.h, "Room"): the registry's room checks, and OpenSequence
// through ManagerCore refused or placed by the heartbeat's free frames and
// pool slots rather than by capacity - reserved alone; the room refreshed
// from an inventory answer after a reclaim stage (RefreshWorkerRoom).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "common/status_matchers.h"
#include "kvmanager/manager_core_test_fixture.h"
#include "kvmanager/worker_registry.h"

namespace triax::manager {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;
using C = absl::StatusCode;

constexpr uint64_t kFrame = 64 << 10;
const ModelShape kModel{"test", 2, 2, 4, 64};  // BF16 page 8192, INT4 2816

RegisterWorkerRequest Req(const std::string& id, uint64_t capacity) {
  RegisterWorkerRequest req;
  req.worker_id = id;
  req.address = "127.0.0.1:" + std::to_string(9000 + id.size());
  req.backend = "cpu";
  req.capacity_bytes = capacity;
  return req;
}

// A heartbeat inventory of `free_frames` free frames (after compaction) and
// an INT4 pool with `int4_slots` free slots.
Inventory Frames(uint64_t free_frames, uint64_t int4_slots = 0) {
  Inventory inv;
  inv.frame_bytes = kFrame;
  inv.frames = 100;
  inv.free_frames = free_frames;
  inv.free_frames_compacted = free_frames;
  if (int4_slots > 0) {
    PoolInventory p;
    p.encoding = Format::kINT4;
    p.page_bytes = kernels::PageBytes(Format::kINT4, {16, 2, 64});
    p.pages_per_frame = kFrame / p.page_bytes;
    p.frames = 1;
    p.pages_used = p.pages_per_frame - int4_slots;
    p.free_slots = int4_slots;
    p.free_slots_compacted = int4_slots;
    inv.pools.push_back(p);
  }
  return inv;
}

TEST(WorkerRoomTest, FitsCountsFramesPoolSlotsAndWhatWasPlannedSince) {
  WorkerRegistry reg;
  WorkerRecord* w = reg.Register(Req("w1", 1ull << 30), 0);
  Demand bf16;  // 10 BF16 blocks: 20 pages of 8 KiB, 8 a frame: 3 frames
  WorkerRegistry::AddBlocks(kModel, 16, Format::kBF16, 10, &bf16);
  ASSERT_EQ(bf16.size(), 1u);
  EXPECT_EQ(bf16[0].pages, 20u);
  const uint64_t bytes = uint64_t{20} * 8192;
  // No frames reported yet: bytes only.
  EXPECT_THAT(WorkerRegistry::Fits(*w, bytes, bf16), IsOk());
  EXPECT_EQ(WorkerRegistry::FrameRoomBytes(*w), -1);

  ASSERT_THAT(reg.Heartbeat("w1", Frames(2), 10).status(), IsOk());
  EXPECT_THAT(WorkerRegistry::Fits(*w, bytes, bf16),
              StatusIs(C::kResourceExhausted,
                       AllOf(HasSubstr("room for 2 more frames"),
                             HasSubstr("needs 3 frames"),
                             HasSubstr("20 bf16 pages of 8192 bytes"))));
  EXPECT_EQ(WorkerRegistry::RoomBytes(*w), 2 * kFrame);
  ASSERT_THAT(reg.Heartbeat("w1", Frames(3), 20).status(), IsOk());
  EXPECT_THAT(WorkerRegistry::Fits(*w, bytes, bf16), IsOk());

  // INT4 pages (2816 bytes, 23 a frame) go into the pool's free slots first.
  Demand int4;
  WorkerRegistry::AddBlocks(kModel, 16, Format::kINT4, 12, &int4);  // 24
  ASSERT_THAT(reg.Heartbeat("w1", Frames(0, 24), 30).status(), IsOk());
  EXPECT_THAT(WorkerRegistry::Fits(*w, uint64_t{24} * 2816, int4), IsOk());
  ASSERT_THAT(reg.Heartbeat("w1", Frames(0, 23), 40).status(), IsOk());
  EXPECT_THAT(WorkerRegistry::Fits(*w, uint64_t{24} * 2816, int4),
              StatusIs(C::kResourceExhausted, HasSubstr("23 free slots")));

  // Bytes planned since the heartbeat come off its free frames.
  ASSERT_THAT(reg.Heartbeat("w1", Frames(3), 50).status(), IsOk());
  w->Reserve(1);
  EXPECT_EQ(WorkerRegistry::FrameRoomBytes(*w), int64_t{3 * kFrame - 1});
  EXPECT_THAT(WorkerRegistry::Fits(*w, bytes, bf16),
              StatusIs(C::kResourceExhausted,
                       AllOf(HasSubstr("room for 2 more frames"),
                             HasSubstr("1 bytes planned since"))));
  // New pages of demotions in flight are not free either.
  w->transient = 1;
  EXPECT_EQ(WorkerRegistry::FrameRoomBytes(*w), int64_t{3 * kFrame - 2});
  w->transient = 0;
  // The shortfall asks the coordinator for the byte the frames lack.
  EXPECT_EQ(WorkerRegistry::AdmissionBytes(*w, bytes, bf16),
            WorkerRegistry::FreeBytes(*w) + 1);
  EXPECT_EQ(WorkerRegistry::AdmissionBytes(*w, bytes, {}), bytes);
  // The next heartbeat counts them itself.
  ASSERT_THAT(reg.Heartbeat("w1", Frames(3), 60).status(), IsOk());
  EXPECT_EQ(WorkerRegistry::FrameRoomBytes(*w), int64_t{3 * kFrame});
  EXPECT_EQ(WorkerRegistry::AdmissionBytes(*w, bytes, bf16), bytes);

  // A page larger than the worker's frame can never be placed there.
  Demand huge;
  WorkerRegistry::AddBlocks(ModelShape{"big", 2, 8, 8, 128}, 64, Format::kBF16,
                            1, &huge);
  EXPECT_THAT(WorkerRegistry::Fits(*w, 1, huge),
              StatusIs(C::kInvalidArgument, HasSubstr("frame_bytes 65536")));
}

TEST(WorkerRoomTest, PlacementGoesToAWorkerWhoseFramesFit) {
  WorkerRegistry reg;
  reg.Register(Req("big", 1ull << 30), 0);     // most capacity, few frames
  reg.Register(Req("small", 64ull << 20), 0);  // less capacity, room
  ASSERT_THAT(reg.Heartbeat("big", Frames(1), 1).status(), IsOk());
  ASSERT_THAT(reg.Heartbeat("small", Frames(8), 1).status(), IsOk());
  Demand bf16;
  WorkerRegistry::AddBlocks(kModel, 16, Format::kBF16, 10, &bf16);
  auto w = reg.Place(uint64_t{20} * 8192, bf16);
  ASSERT_THAT(w, IsOk());
  EXPECT_EQ((*w)->info.worker_id, "small");
  // Neither fits 100 blocks (25 frames): the refusal names the roomiest.
  Demand more;
  WorkerRegistry::AddBlocks(kModel, 16, Format::kBF16, 100, &more);
  EXPECT_THAT(reg.Place(uint64_t{200} * 8192, more).status(),
              StatusIs(C::kResourceExhausted,
                       AllOf(HasSubstr("no worker has room"),
                             HasSubstr("small"), HasSubstr("25 frames"))));
}

// Through ManagerCore: a 1 TiB worker whose heartbeat reports few free
// frames refuses an Open its byte count would take, and takes it once the
// heartbeat reports room.
TEST_F(CoreTest, OpenIsAdmittedOnTheReportedFramesNotTheByteCount) {
  auto probe = Open({S(Role::kUser, 160)});
  ASSERT_THAT(probe, IsOk());
  const uint64_t blocks = probe->blocks.size();
  ASSERT_THAT(core_->CloseSequence({"", "acme", probe->sequence_id}), IsOk());
  Demand demand;
  for (const BlockPlan& b : probe->blocks) {
    WorkerRegistry::AddBlocks(Model(), 16, b.encoding, 1, &demand);
  }
  uint64_t frames = 0;
  for (const PageDemand& d : demand) {
    const uint64_t per = kFrame / d.page_bytes;
    frames += (d.pages + per - 1) / per;
  }
  ASSERT_GT(blocks, 0u);
  ASSERT_GT(frames, 0u);

  ASSERT_THAT(core_->Heartbeat("w1", Frames(frames - 1)), IsOk());
  EXPECT_THAT(
      Open({S(Role::kUser, 160)}).status(),
      StatusIs(C::kResourceExhausted,
               AllOf(HasSubstr("no worker has room"),
                     HasSubstr(absl::StrCat("needs ", frames, " frames")))));
  ASSERT_THAT(core_->Heartbeat("w1", Frames(frames)), IsOk());
  auto opened = Open({S(Role::kUser, 160)});
  ASSERT_THAT(opened, IsOk());
  // Planned since that heartbeat: the same Open no longer fits.
  EXPECT_THAT(Open({S(Role::kUser, 160)}).status(),
              StatusIs(C::kResourceExhausted, HasSubstr("planned since")));
}

// Bytes freed since a heartbeat do not become frames until the worker says
// so: its pools may hold the freed pages in frames that other pages still
// use. (Netting frees against what was planned let an Open through that the
// worker then refused: memory_pressure_test, CI of 2026-11-23.)
TEST_F(CoreTest, FreesSinceAHeartbeatAreNotRoomUntilTheWorkerReportsThem) {
  auto probe = Open({S(Role::kUser, 160)});
  ASSERT_THAT(probe, IsOk());
  ASSERT_THAT(core_->CloseSequence({"", "acme", probe->sequence_id}), IsOk());
  Demand demand;
  uint64_t frames = 0;
  for (const auto& b : probe->blocks) {
    WorkerRegistry::AddBlocks(Model(), 16, b.encoding, 1, &demand);
  }
  for (const PageDemand& d : demand) {
    const uint64_t per = kFrame / d.page_bytes;
    frames += (d.pages + per - 1) / per;
  }
  // Room for exactly one such sequence.
  ASSERT_THAT(core_->Heartbeat("w1", Frames(frames)), IsOk());
  auto a = Open({S(Role::kUser, 160)});
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(core_->CloseSequence({"", "acme", a->sequence_id}), IsOk());
  EXPECT_THAT(Open({S(Role::kUser, 160)}).status(),
              StatusIs(C::kResourceExhausted, HasSubstr("planned since")));
  // The worker's next report has the frames back.
  ASSERT_THAT(core_->Heartbeat("w1", Frames(frames)), IsOk());
  EXPECT_THAT(Open({S(Role::kUser, 160)}), IsOk());
}

// A request refused for frames asks reclaim for the frames' worth on the
// worker, while the tenant's ceiling is checked on the request's own bytes.
TEST_F(CoreTest, AFrameShortfallDoesNotInflateTheTenantsNeed) {
  auto probe = Open({S(Role::kUser, 160)});
  ASSERT_THAT(probe, IsOk());
  const uint64_t bytes = probe->bytes;
  ASSERT_THAT(core_->CloseSequence({"", "acme", probe->sequence_id}), IsOk());
  // The ceiling fits the request exactly; the worker reports one frame.
  ASSERT_THAT(core_->SetBudget({"", "acme", Budget{Tier::kDevice, 0, bytes}}),
              IsOk());
  ASSERT_THAT(core_->Heartbeat("w1", Frames(1)), IsOk());
  OpenSequenceRequest req;
  req.tenant_id = "acme";
  req.model = Model();
  req.spans = {S(Role::kUser, 160)};
  AdmissionShortfall sf;
  EXPECT_THAT(core_->OpenSequence(req, &sf).status(),
              StatusIs(C::kResourceExhausted, HasSubstr("frames")));
  EXPECT_EQ(sf.request_bytes, bytes);
  EXPECT_GT(sf.worker_request_bytes, bytes);
  EXPECT_EQ(sf.WorkerRequestBytes(), sf.worker_request_bytes);
  // Short by the frame bytes the worker lacks (its 1 TiB is free), not by
  // anything of the tenant.
  const uint64_t missing = sf.worker_request_bytes - (uint64_t{1} << 40);
  EXPECT_GT(missing, 0u);
  EXPECT_LE(missing, bytes);
  EXPECT_EQ(core_->ShortBytes(sf), missing);
}

// After a reclaim stage the service asks the worker for its inventory: the
// frames it reports replace the heartbeat's, and what was planned while
// the call ran still counts as taken.
TEST_F(CoreTest, RefreshWorkerRoomTakesTheFramesOfAnInventoryAnswer) {
  ASSERT_THAT(core_->Heartbeat("w1", Frames(1)), IsOk());
  EXPECT_THAT(Open({S(Role::kUser, 160)}).status(),
              StatusIs(C::kResourceExhausted, HasSubstr("needs")));
  const uint64_t before = core_->PlannedOn("w1");
  core_->RefreshWorkerRoom("w1", Frames(64), before);
  auto a = Open({S(Role::kUser, 160)});
  ASSERT_THAT(a, IsOk());
  // Planned after `before` was read: not in that answer's frames.
  core_->RefreshWorkerRoom("w1", Frames(1), before);
  EXPECT_THAT(Open({S(Role::kUser, 160)}).status(),
              StatusIs(C::kResourceExhausted, HasSubstr("planned since")));
  // Unknown workers are ignored; nothing else of the worker changes.
  core_->RefreshWorkerRoom("ghost", Frames(64), 0);
  const std::vector<WorkerInfo> w = core_->ListWorkers();
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].state, WorkerState::kUp);
  EXPECT_EQ(w[0].inventory.free_frames_compacted, 1u);
  EXPECT_EQ(core_->PlannedOn("ghost"), 0u);
}

}  // namespace
}  // namespace triax::manager
