// BlockGraph (block_graph.h): nodes, edges and the degree cap, access
// records, importance and its decay. Deterministic: explicit times, no clock.
#include "kvmanager/block_graph.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "kvmanager/block_ranker.h"

namespace triax::manager {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

TEST(BlockGraphTest, AddRemoveAndLink) {
  BlockGraph g;
  g.AddBlock(1, 100);
  g.AddBlock(2, 100);
  g.AddBlock(3, 100);
  g.AddBlock(1, 500);  // already known: unchanged
  EXPECT_EQ(g.size(), 3u);
  ASSERT_NE(g.Find(1), nullptr);
  EXPECT_EQ(g.Find(1)->last_access_ms, 100);
  EXPECT_EQ(g.Find(9), nullptr);
  g.Link(1, 2, EdgeKind::kCoAttention, 1.0);
  g.Link(1, 3, EdgeKind::kToolCallResult, 0.5);
  g.Link(1, 1, EdgeKind::kCoAttention);      // self: no-op
  g.Link(1, 9, EdgeKind::kCoAttention);      // unknown: no-op
  g.Link(1, 2, EdgeKind::kCoAttention, -1);  // non-positive: no-op
  EXPECT_EQ(g.edges(), 2u);
  g.Link(2, 1, EdgeKind::kCoAttention, 0.5);  // strengthens 1-2 to 1.5
  EXPECT_EQ(g.edges(), 2u);
  EXPECT_DOUBLE_EQ(g.WeightedDegree(1), 2.0);
  EXPECT_DOUBLE_EQ(g.WeightedDegree(2), 1.5);
  EXPECT_THAT(g.Neighbours(1), ElementsAre(2u, 3u));
  EXPECT_THAT(g.Neighbours(3), ElementsAre(1u));
  g.RemoveBlock(1);
  g.RemoveBlock(42);  // unknown: no-op
  EXPECT_EQ(g.size(), 2u);
  EXPECT_EQ(g.edges(), 0u);
  EXPECT_THAT(g.Neighbours(2), IsEmpty());
  EXPECT_DOUBLE_EQ(g.WeightedDegree(2), 0);
}

TEST(BlockGraphTest, DegreeCapDropsTheWeakestCoAttentionEdgeFirst) {
  BlockGraph::Options o;
  o.max_degree = 3;
  BlockGraph g(o);
  for (uint64_t id = 1; id <= 10; ++id) g.AddBlock(id, 0);
  g.Link(1, 2, EdgeKind::kToolCallResult, 0.1);  // weak but structural
  g.Link(1, 3, EdgeKind::kCoAttention, 1.0);
  g.Link(1, 4, EdgeKind::kCoAttention, 2.0);
  EXPECT_EQ(g.edges(), 3u);
  g.Link(1, 5, EdgeKind::kCoAttention, 0.5);  // weaker than every edge: out
  EXPECT_THAT(g.Neighbours(1), ElementsAre(4u, 3u, 2u));
  g.Link(1, 6, EdgeKind::kCoAttention, 1.5);  // replaces 1-3
  EXPECT_THAT(g.Neighbours(1), ElementsAre(4u, 6u, 2u));
  EXPECT_THAT(g.Neighbours(3), IsEmpty());
  g.Link(1, 7, EdgeKind::kSpill, 0.01);  // structural beats 1-6
  EXPECT_THAT(g.Neighbours(1), ElementsAre(4u, 2u, 7u));
  g.Link(1, 8, EdgeKind::kSpill, 0.05);  // co-attention 1-4 goes first
  EXPECT_THAT(g.Neighbours(1), ElementsAre(2u, 8u, 7u));
  g.Link(1, 9, EdgeKind::kSpill, 0.01);  // not stronger than 1-7: out
  EXPECT_THAT(g.Neighbours(1), ElementsAre(2u, 8u, 7u));
  g.Link(1, 10, EdgeKind::kSpill, 0.02);  // replaces 1-7
  EXPECT_THAT(g.Neighbours(1), ElementsAre(2u, 8u, 10u));
  EXPECT_EQ(g.edges(), 3u);
  EXPECT_THAT(g.Neighbours(7), IsEmpty());
  EXPECT_THAT(g.Neighbours(9), IsEmpty());
  // The cap holds at both ends: 20 has room, 21 is full of stronger edges.
  BlockGraph c(o);
  for (uint64_t id = 20; id <= 24; ++id) c.AddBlock(id, 0);
  for (uint64_t id = 22; id <= 24; ++id) {
    c.Link(21, id, EdgeKind::kCoAttention, 5);
  }
  c.Link(20, 21, EdgeKind::kCoAttention, 1);
  EXPECT_THAT(c.Neighbours(20), IsEmpty());
  EXPECT_EQ(c.edges(), 3u);
  // Linking again a co-attention edge as structural upgrades its kind.
  BlockGraph h(o);
  for (uint64_t id = 1; id <= 5; ++id) h.AddBlock(id, 0);
  h.Link(1, 2, EdgeKind::kCoAttention, 0.1);
  h.Link(1, 2, EdgeKind::kToolCallResult, 0.1);
  h.Link(1, 3, EdgeKind::kCoAttention, 5);
  h.Link(1, 4, EdgeKind::kCoAttention, 5);
  h.Link(1, 5, EdgeKind::kCoAttention, 4);  // 1-2 is structural now: stays
  EXPECT_THAT(h.Neighbours(1), ElementsAre(3u, 4u, 2u));
}

TEST(BlockGraphTest, RecordAccessHitsMassAndCoAttention) {
  BlockGraph::Options o;
  o.max_degree = 2;
  o.mass_half_life_ms = 1000;
  BlockGraph g(o);
  for (uint64_t id = 1; id <= 5; ++id) g.AddBlock(id, 0);
  // Weights: 4 -> 0.4, 2 -> 0.3, 1 -> 0.2 (+0.1 from its repeat), 3 -> 0.
  g.RecordAccess({1, 2, 3, 4, 1, 99}, {0.2f, 0.3f, 0.0f, 0.4f, 0.1f, 1.0f},
                 1000);
  EXPECT_EQ(g.Find(1)->hits, 1u);
  EXPECT_EQ(g.Find(3)->hits, 1u);
  EXPECT_EQ(g.Find(5)->hits, 0u);
  EXPECT_NEAR(g.Find(1)->mass, 0.3, 1e-6);
  EXPECT_EQ(g.Find(1)->last_access_ms, 1000);
  // Order by weight: 4 (0.4), 1 (0.3, id 1 < 2), 2 (0.3), 3 (0).
  // Top max_degree = 2: {4, 1}. Links: 1-4, 2-4, 2-1; 3 has a zero share.
  EXPECT_EQ(g.edges(), 3u);
  EXPECT_THAT(g.Neighbours(3), IsEmpty());
  EXPECT_NEAR(g.WeightedDegree(4), 0.75 + 0.75, 1e-6);
  EXPECT_NEAR(g.WeightedDegree(2), 0.75 + 0.5625, 1e-6);
  // Mass decays by half per half-life before the next share is added.
  g.RecordAccess({1}, {}, 2000);
  EXPECT_NEAR(g.Find(1)->mass, 0.15 + 1.0, 1e-6);
  EXPECT_EQ(g.Find(1)->hits, 2u);
  // Equal shares when weights are absent.
  g.RecordAccess({3, 5}, {}, 3000);
  EXPECT_NEAR(g.Find(5)->mass, 0.5, 1e-9);
  EXPECT_THAT(g.Neighbours(5), ElementsAre(3u));
}

TEST(BlockGraphTest, ImportanceFormulaAndDecay) {
  BlockGraph::Options o;
  o.mass_half_life_ms = 1000;
  BlockGraph g(o);
  g.AddBlock(1, 0);
  g.AddBlock(2, 0);
  EXPECT_DOUBLE_EQ(g.Importance(1, 0), 0);
  EXPECT_DOUBLE_EQ(g.Importance(77, 0), 0);  // unknown
  g.RecordAccess({1}, {0.8f}, 1000);
  g.RecordAccess({1}, {0.0f}, 1000);
  g.Link(1, 2, EdgeKind::kToolCallResult, 3.0);
  const double mass = static_cast<double>(0.8f);
  EXPECT_NEAR(g.Importance(1, 1000),
              std::log1p(2.0) + mass + 0.5 * std::log1p(3.0), 1e-12);
  EXPECT_NEAR(g.Importance(1, 3000),
              std::log1p(2.0) + mass / 4 + 0.5 * std::log1p(3.0), 1e-12);
  EXPECT_NEAR(g.Importance(1, 500),  // before the last access: no growth
              std::log1p(2.0) + mass + 0.5 * std::log1p(3.0), 1e-12);
  EXPECT_NEAR(g.Importance(2, 1000), 0.5 * std::log1p(3.0), 1e-12);
  BlockView v;
  ASSERT_TRUE(g.Snapshot(1, 3000, &v));
  EXPECT_DOUBLE_EQ(v.importance, g.Importance(1, 3000));
  EXPECT_EQ(v.hits, 2u);
  EXPECT_EQ(v.last_access_ms, 1000);
  EXPECT_FALSE(g.Snapshot(77, 3000, &v));
}

}  // namespace
}  // namespace triax::manager
