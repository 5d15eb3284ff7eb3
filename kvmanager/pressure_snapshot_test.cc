// SnapshotBuilder (pressure_snapshot.h) through its own interface: what is
// copied (UP workers, tenants, open sequences, exclusively held idle
// blocks), the window guard, option sets from a calibration table or the
// fallback noise model, temporal adjacency of importance, and the copy in
// chunks. Records from manager_parts_testing.h; explicit times.
#include "kvmanager/pressure_snapshot.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "kvmanager/manager_parts_testing.h"

namespace triax::manager {
namespace {

using ::testing::ElementsAre;
using ::triax::testing::IsOk;

constexpr int kDev = static_cast<int>(Tier::kDevice);
constexpr int kHost = static_cast<int>(Tier::kHost);

struct SnapshotWorld : PartsWorld {
  BlockGraph graph;
  SnapshotBuilder::Options options;

  SnapshotBuilder Builder() {
    return SnapshotBuilder(options, workers, tenants, sequences, calibrations,
                           graph);
  }
  // Begin plus every chunk; returns the number of chunks.
  int Build(SnapshotBuilder* b) {
    b->Begin(clock.NowMs());
    int chunks = 0;
    while (!b->done()) {
      b->CopyChunk();
      ++chunks;
    }
    return chunks;
  }
  SequenceRecord* Add(TenantRecord* t, WorkerRecord* w, int blocks) {
    SequenceRecord* s =
        AddSequence(t, w, std::vector<Role>(blocks, Role::kUser));
    for (const BlockRecord* b : s->blocks) {
      graph.AddBlock(b->lineage_id, clock.NowMs());
    }
    return s;
  }
};

std::vector<uint64_t> Lineages(const PressureInput& in) {
  std::vector<uint64_t> out;
  for (const BlockView& v : in.blocks) out.push_back(v.lineage_id);
  return out;
}

TEST(PressureSnapshotTest, CopiesWhatTheRankerMayActOn) {
  SnapshotWorld w;
  w.options.window_guard_tokens = 16;
  TenantRecord* t = w.AddTenant("t", /*ceiling=*/1 << 30, /*floor=*/1000);
  WorkerRecord* up = w.AddWorker("up", 1 << 30, /*host=*/1 << 20);
  WorkerRecord* down = w.AddWorker("down", 1 << 30);
  SequenceRecord* s = w.Add(t, up, 5);       // lineages 1..5
  w.Add(t, down, 2);                         // 6, 7: on a DOWN worker
  SequenceRecord* closed = w.Add(t, up, 1);  // 8
  down->info.state = WorkerState::kDown;
  closed->state = SequenceState::kClosed;
  s->blocks[1]->refcount = 2;    // shared with a fork
  s->blocks[2]->busy = 4;        // in a tier plan
  s->blocks[3]->num_tokens = 9;  // partial, followed by block 4: sealed
  SnapshotBuilder b = w.Builder();
  w.Build(&b);
  const PressureInput& in = b.input();
  EXPECT_EQ(in.now_ms, w.clock.NowMs());
  ASSERT_EQ(in.workers.size(), 1u);
  EXPECT_EQ(in.workers[0].worker_id, "up");
  EXPECT_EQ(in.workers[0].capacity[kHost], 1u << 20);
  EXPECT_EQ(in.workers[0].used[kDev], up->reserved);
  ASSERT_EQ(in.tenants.size(), 1u);
  EXPECT_EQ(in.tenants[0].floor[kDev], 1000u);
  ASSERT_EQ(in.sequences.size(), 1u);
  EXPECT_EQ(in.sequences[0].sequence_id, "seq-1");
  EXPECT_THAT(Lineages(in), ElementsAre(1u, 4u, 5u));
  // Sealed: final and at least window_guard_tokens before the end (80).
  EXPECT_TRUE(in.blocks[0].sealed);
  EXPECT_TRUE(in.blocks[1].sealed);   // partial, ends at 57
  EXPECT_FALSE(in.blocks[2].sealed);  // ends at 80: in the window
  EXPECT_THAT(b.snapshot().worker_ids, ElementsAre("up"));
  EXPECT_THAT(b.snapshot().sequence_ids, ElementsAre("seq-1"));
  EXPECT_EQ(b.snapshot().built_ms, w.clock.NowMs());
}

TEST(PressureSnapshotTest, OnlyTheLastBlockOfASequenceMayStillGrow) {
  // A span that ends short of a block boundary leaves a partial block; once
  // a later block follows it, it can no longer grow and the worker seals it
  // like a full one. The last block, partial, may still grow.
  SnapshotWorld w;
  w.options.window_guard_tokens = 0;
  TenantRecord* t = w.AddTenant("t", /*ceiling=*/1 << 30, /*floor=*/0);
  WorkerRecord* up = w.AddWorker("up", 1 << 30);
  SequenceRecord* s = w.Add(t, up, 3);
  s->blocks[1]->num_tokens = 5;    // [16, 21): a short span
  s->blocks[2]->first_token = 21;  // [21, 28): the last block, partial
  s->blocks[2]->num_tokens = 7;
  s->num_tokens = 28;
  SnapshotBuilder b = w.Builder();
  w.Build(&b);
  const PressureInput& in = b.input();
  ASSERT_EQ(in.blocks.size(), 3u);
  EXPECT_TRUE(in.blocks[0].sealed);
  EXPECT_TRUE(in.blocks[1].sealed);
  EXPECT_FALSE(in.blocks[2].sealed);
  // Full, it is final too.
  s->blocks[2]->num_tokens = 16;
  s->num_tokens = 37;
  SnapshotBuilder full = w.Builder();
  w.Build(&full);
  EXPECT_TRUE(full.input().blocks[2].sealed);
}

TEST(PressureSnapshotTest, OptionSetsFromTheTableOrTheFallbackModel) {
  SnapshotWorld w;
  TenantRecord* t = w.AddTenant("t");
  WorkerRecord* wk = w.AddWorker("w", 1 << 30);
  SequenceRecord* plain = w.Add(t, wk, 2);
  // A table stored under the model's name (same shape) is used.
  CalibrationTableInfo info;
  info.model = "test";
  info.shape = PartsModel();
  info.block_tokens = 16;
  CalibrationEntryInfo e;
  e.tag = plain->blocks[1]->tag;
  e.encoding.format = Format::kINT4;
  e.distortion = 0.25;
  info.entries = {e};
  ASSERT_THAT(w.calibrations.Put(*CalibrationStore::Build(info)), IsOk());
  SnapshotBuilder b = w.Builder();
  w.Build(&b);
  const PressureInput& in = b.input();
  ASSERT_EQ(in.blocks.size(), 2u);
  // The sink's tag has no entry: the fallback noise model.
  const OptionSet& sink = in.option_sets[in.blocks[0].option_set];
  std::vector<Format> formats;
  for (const DemoteOption& o : sink.options) formats.push_back(o.encoding.k);
  EXPECT_THAT(formats, ElementsAre(Format::kBF16, Format::kINT8, Format::kFP8,
                                   Format::kINT4, Format::kINT2));
  EXPECT_EQ(sink.options[0].distortion, 0);
  const double int2_bits = kernels::EffectiveBits(
      Encoding(Format::kINT2), PageShapeOf(PartsModel(), 16));
  EXPECT_DOUBLE_EQ(sink.options[4].distortion,
                   std::pow(2.0, -2.0 * (int2_bits - 2.0)));
  EXPECT_DOUBLE_EQ(sink.evict_distortion,
                   w.options.evict_factor * sink.options[4].distortion);
  // The user tag: the table's INT4 entry, plus BF16.
  const OptionSet& user = in.option_sets[in.blocks[1].option_set];
  ASSERT_EQ(user.options.size(), 2u);
  EXPECT_EQ(user.options[0].encoding, Format::kBF16);
  EXPECT_EQ(user.options[0].bytes, PartsBytes(Format::kBF16));
  EXPECT_EQ(user.options[1].encoding, Format::kINT4);
  EXPECT_DOUBLE_EQ(user.evict_distortion, w.options.evict_factor * 0.25);
  EXPECT_EQ(in.blocks[1].distortion, 0);  // BF16 now
}

TEST(PressureSnapshotTest, NeighboursShareImportanceAndChunksCoverAll) {
  SnapshotWorld w;
  w.options.chunk_blocks = 4;
  TenantRecord* t = w.AddTenant("t");
  WorkerRecord* wk = w.AddWorker("w", 1 << 30);
  SequenceRecord* s = w.Add(t, wk, 4);
  for (int i = 0; i < 3; ++i) w.Add(t, wk, 4);
  w.graph.RecordAccess({s->blocks[1]->lineage_id}, {1.0f}, w.clock.NowMs());
  SnapshotBuilder b = w.Builder();
  // Whole sequences per chunk, about chunk_blocks blocks each.
  EXPECT_EQ(w.Build(&b), 4);
  const PressureInput& in = b.input();
  EXPECT_EQ(in.blocks.size(), 16u);
  EXPECT_EQ(in.sequences.size(), 4u);
  const double own =
      w.graph.Importance(s->blocks[1]->lineage_id, w.clock.NowMs());
  ASSERT_GT(own, 0);
  std::vector<double> imp;
  for (const BlockView& v : in.blocks) {
    if (in.sequences[v.sequence].sequence_id == s->id) {
      imp.push_back(v.importance);
    }
  }
  ASSERT_EQ(imp.size(), 4u);
  EXPECT_DOUBLE_EQ(imp[0], kAdjacencyShare * own);
  EXPECT_DOUBLE_EQ(imp[1], own);
  EXPECT_DOUBLE_EQ(imp[2], kAdjacencyShare * own);
  EXPECT_DOUBLE_EQ(imp[3], 0);
  EXPECT_GE(b.snapshot().longest_hold_ms, 0);
  EXPECT_NE(b.TakeSnapshot(), nullptr);
}

}  // namespace
}  // namespace triax::manager
