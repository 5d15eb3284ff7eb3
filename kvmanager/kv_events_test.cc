// KV events (kv_events.h): the exact msgpack bytes of vLLM's array_like
// encoding, the endpoint offset by data-parallel rank, and the mirror's
// diff of block states into BlockStored / BlockRemoved.
#include "kvmanager/kv_events.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace triax::manager {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string Bytes(std::initializer_list<int> b) {
  std::string s;
  for (int c : b) s.push_back(static_cast<char>(c));
  return s;
}

TEST(EncodeKvEventBatchTest, MatchesMsgspecArrayLikeBytes) {
  const std::string h1(32, '\x11'), h0(32, '\x00');
  KvBlockStored stored{{h1}, h0, {1, 300}, 2, "GPU"};
  KvBlockRemoved removed{{h1}, "CPU"};
  const std::string got =
      EncodeKvEventBatch(1.5, {stored, removed, KvAllBlocksCleared{}}, 3);
  std::string want = Bytes({0x93, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0x93});
  // ["BlockStored", [bin32 h1], bin32 h0, [1, 300], 2, nil, "GPU"]
  want += Bytes({0x97, 0xab}) + "BlockStored";
  want += Bytes({0x91, 0xc4, 0x20}) + h1;
  want += Bytes({0xc4, 0x20}) + h0;
  want += Bytes({0x92, 0x01, 0xcd, 0x01, 0x2c, 0x02, 0xc0, 0xa3}) + "GPU";
  // ["BlockRemoved", [bin32 h1], "CPU"]
  want += Bytes({0x93, 0xac}) + "BlockRemoved";
  want += Bytes({0x91, 0xc4, 0x20}) + h1 + Bytes({0xa3}) + "CPU";
  // ["AllBlocksCleared"], then data_parallel_rank 3
  want += Bytes({0x91, 0xb0}) + "AllBlocksCleared" + Bytes({0x03});
  EXPECT_EQ(got, want);
}

TEST(EncodeKvEventBatchTest, FirstBlockHasNilParent) {
  const std::string h(32, '\x22');
  const std::string got = EncodeKvEventBatch(
      0.0, {KvBlockStored{{h}, std::nullopt, {}, 16, "DISK"}}, 0);
  std::string want =
      Bytes({0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x97, 0xab}) +
      "BlockStored" + Bytes({0x91, 0xc4, 0x20}) + h +
      Bytes({0xc0, 0x90, 0x10, 0xc0, 0xa4}) + "DISK" + Bytes({0x00});
  EXPECT_EQ(got, want);
}

TEST(OffsetEndpointPortTest, FollowsVllm) {
  EXPECT_EQ(*OffsetEndpointPort("tcp://*:5557", 0, "--f"), "tcp://*:5557");
  EXPECT_EQ(*OffsetEndpointPort("tcp://*:5557", 2, "--f"), "tcp://*:5559");
  EXPECT_EQ(*OffsetEndpointPort("inproc://kv", 1, "--f"), "inproc://kv_dp1");
  EXPECT_EQ(*OffsetEndpointPort("", 4, "--f"), "");
  auto bad = OffsetEndpointPort("tcp://*:x", 1, "--kv_events_endpoint");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(),
              HasSubstr("--kv_events_endpoint=tcp://*:x"));
  EXPECT_FALSE(OffsetEndpointPort("ipc:///tmp/kv", 1, "--f").ok());
}

ManagerCore::HashedBlock Block(uint64_t lineage, uint32_t index,
                               std::string hash, std::string parent,
                               Tier tier = Tier::kDevice) {
  ManagerCore::HashedBlock b;
  b.lineage_id = lineage;
  b.index = index;
  b.hash = std::move(hash);
  b.parent_hash = std::move(parent);
  b.token_ids = {index * 2, index * 2 + 1};
  b.num_tokens = 2;
  b.tier = tier;
  return b;
}

TEST(KvEventMirrorTest, ChainOfBlocksIsOneStoredEvent) {
  KvEventMirror m;
  const std::string a(32, 'a'), b(32, 'b'), c(32, 'c');
  auto ev =
      m.Update({Block(1, 0, a, ""), Block(2, 1, b, a), Block(3, 2, "", b)}, {});
  ASSERT_EQ(ev.size(), 1u);
  const auto& s = std::get<KvBlockStored>(ev[0]);
  EXPECT_THAT(s.block_hashes, ElementsAre(a, b));
  EXPECT_FALSE(s.parent_block_hash.has_value());
  EXPECT_THAT(s.token_ids, ElementsAre(0, 1, 2, 3));
  EXPECT_EQ(s.block_size, 2u);
  EXPECT_EQ(s.medium, "GPU");
  EXPECT_EQ(m.size(), 2u);
  // Nothing changed: nothing to say. Block 3 sealed: stored with parent b.
  EXPECT_TRUE(m.Update({Block(1, 0, a, ""), Block(2, 1, b, a)}, {}).empty());
  ev = m.Update({Block(3, 2, c, b)}, {3});
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(std::get<KvBlockStored>(ev[0]).parent_block_hash, b);
}

TEST(KvEventMirrorTest, TierChangeAndGoneBlocksAreRemoved) {
  KvEventMirror m;
  const std::string a(32, 'a'), b(32, 'b');
  m.Update({Block(1, 0, a, ""), Block(2, 1, b, a)}, {});
  // Block 2 spilled to the host tier: removed from GPU, stored on CPU.
  auto ev = m.Update({Block(2, 1, b, a, Tier::kHost)}, {2});
  ASSERT_EQ(ev.size(), 2u);
  const auto& r = std::get<KvBlockRemoved>(ev[0]);
  EXPECT_THAT(r.block_hashes, ElementsAre(b));
  EXPECT_EQ(r.medium, "GPU");
  EXPECT_EQ(std::get<KvBlockStored>(ev[1]).medium, "CPU");
  // Block 1 freed (named, absent), block 2 evicted: both removed, per medium.
  ManagerCore::HashedBlock evicted = Block(2, 1, b, a, Tier::kHost);
  evicted.evicted = true;
  ev = m.Update({evicted}, {1, 2});
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(std::get<KvBlockRemoved>(ev[0]).medium, "GPU");
  EXPECT_THAT(std::get<KvBlockRemoved>(ev[0]).block_hashes, ElementsAre(a));
  EXPECT_EQ(std::get<KvBlockRemoved>(ev[1]).medium, "CPU");
  EXPECT_EQ(m.size(), 0u);
  // A named lineage never announced says nothing.
  EXPECT_TRUE(m.Update({}, {7}).empty());
}

TEST(KvEventMirrorTest, ResetClearsThenStoresEverything) {
  KvEventMirror m;
  const std::string a(32, 'a');
  m.Update({Block(1, 0, a, "")}, {});
  auto ev = m.Reset({Block(5, 0, a, "", Tier::kDisk)});
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_TRUE(std::holds_alternative<KvAllBlocksCleared>(ev[0]));
  EXPECT_EQ(std::get<KvBlockStored>(ev[1]).medium, "DISK");
  EXPECT_EQ(m.size(), 1u);
}

}  // namespace
}  // namespace triax::manager
