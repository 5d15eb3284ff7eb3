#include "worker/tier_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "kernels/layout.h"
#include "kernels/numeric.h"
#include "kernels/ref/kv_ref.h"
#include "worker/checksum.h"

namespace triax::worker {
namespace {

namespace fs = std::filesystem;
using kernels::Encoding;
using kernels::Format;
using ::testing::_;
using ::testing::AllOf;
using ::testing::HasSubstr;
using triax::testing::IsOk;
using triax::testing::StatusIs;

// A fresh directory under $TEST_TMPDIR (else /tmp), removed afterwards.
std::string MakeTempDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string tmpl =
      std::string(base != nullptr && *base ? base : "/tmp") + "/tier.XXXXXX";
  char* made = ::mkdtemp(tmpl.data());
  return made == nullptr ? "" : std::string(made);
}

std::vector<std::string> Files(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    out.push_back(it->path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(Crc32cTest, KnownValueAndPathsAgree) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32cPortable("123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32c("", 0), 0u);
  std::mt19937 rng(7);
  std::vector<uint8_t> data(4099);
  for (uint8_t& b : data) b = static_cast<uint8_t>(rng());
  for (size_t n : {1, 7, 8, 9, 63, 64, 1000, 4099}) {
    EXPECT_EQ(Crc32c(data.data(), n), Crc32cPortable(data.data(), n)) << n;
  }
  // Incremental = one shot.
  EXPECT_EQ(Crc32c(data.data() + 5, 994, Crc32c(data.data(), 5)),
            Crc32c(data.data(), 999));
  // One flipped bit changes it.
  const uint32_t before = Crc32c(data.data(), data.size());
  data[1234] ^= 0x10;
  EXPECT_NE(Crc32c(data.data(), data.size()), before);
}

class TierStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir();
    ASSERT_FALSE(dir_.empty());
    auto a = device_.AllocateArena(kArena);
    ASSERT_THAT(a.status(), IsOk());
    arena_ = *a;
  }
  void TearDown() override {
    store_.reset();
    device_.FreeArena(arena_, kArena);
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  void Make(uint64_t host_bytes, uint64_t disk_bytes,
            const std::string& owner = "w1") {
    store_.reset();
    TierStoreOptions o;
    o.host_capacity_bytes = host_bytes;
    o.disk_dir = dir_;
    o.disk_capacity_bytes = disk_bytes;
    o.owner = owner;
    auto s = TierStore::Create(&device_, o);
    ASSERT_THAT(s.status(), IsOk());
    store_ = *std::move(s);
  }

  // `layers` device pages of `bytes` each at arena offset `at`, filled with
  // random bytes; returns their pointers.
  std::vector<uint8_t*> Pages(size_t at, int layers, size_t bytes,
                              uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<uint8_t*> out;
    for (int l = 0; l < layers; ++l) {
      uint8_t* p = arena_ + at + l * bytes;
      for (size_t i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(rng());
      out.push_back(p);
    }
    return out;
  }

  static BlockLabel Label(uint64_t lineage = 7) {
    BlockLabel l;
    l.sequence_id = "s";
    l.lineage_id = lineage;
    l.index = 2;
    return l;
  }

  // Fills a kFragCapacity host tier with blocks of cycling shapes (1 or 2
  // pages of 700 to 5000 bytes) until one is refused, then releases every
  // other block. Leaves kFragFree bytes free in kFragRuns runs, the longest
  // 5120 bytes; returns the blocks still held.
  std::vector<SpilledBlock> FragmentHost() {
    static constexpr size_t kSizes[] = {1000, 3000, 700, 5000, 2500};
    const std::vector<uint8_t*> src = Pages(3 << 20, 2, 5000, 99);
    std::vector<SpilledBlock> blocks;
    for (int i = 0;; ++i) {
      const int layers = 1 + i % 2;
      const std::vector<const uint8_t*> pages(src.begin(),
                                              src.begin() + layers);
      const std::vector<size_t> sizes(layers, kSizes[i % 5]);
      auto b = store_->Spill(Tier::kHost, pages, sizes, Label(100 + i));
      if (!b.ok()) {
        EXPECT_THAT(b.status(),
                    StatusIs(absl::StatusCode::kResourceExhausted, _));
        break;
      }
      blocks.push_back(*std::move(b));
    }
    std::vector<SpilledBlock> kept;
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (i % 2 == 0) {
        store_->Release(&blocks[i]);
      } else {
        kept.push_back(std::move(blocks[i]));
      }
    }
    const TierUsage u = store_->Usage(Tier::kHost);
    EXPECT_EQ(u.free_bytes, kFragFree);
    EXPECT_EQ(u.free_runs, kFragRuns);
    EXPECT_EQ(u.largest_free_run, 5120u);
    return kept;
  }

  // Every host extent of `blocks` is 256-aligned, whole 256-byte units, and
  // no two overlap; each page's pieces hold its bytes.
  static void ExpectDisjointExtents(const std::vector<SpilledBlock*>& blocks) {
    std::vector<std::pair<size_t, size_t>> extents;
    for (const SpilledBlock* b : blocks) {
      for (const SpilledPage& p : b->pages) {
        size_t bytes = 0, extent = 0;
        for (const HostPiece& piece : p.host_pieces) {
          EXPECT_EQ(piece.offset % 256, 0u);
          EXPECT_EQ(piece.extent % 256, 0u);
          EXPECT_LE(piece.bytes, piece.extent);
          EXPECT_GT(piece.bytes, 0u);
          bytes += piece.bytes;
          extent += piece.extent;
          extents.emplace_back(piece.offset, piece.offset + piece.extent);
        }
        EXPECT_EQ(bytes, p.bytes);
        EXPECT_EQ(extent, (p.bytes + 255) / 256 * 256);
      }
    }
    std::sort(extents.begin(), extents.end());
    for (size_t i = 1; i < extents.size(); ++i) {
      EXPECT_LE(extents[i - 1].second, extents[i].first) << "overlap";
    }
  }

  // 64 KiB: FragmentHost's blocks fill 65024 bytes, then one is refused.
  static constexpr size_t kFragCapacity = 64 << 10;
  static constexpr size_t kFragFree = 20480;
  static constexpr size_t kFragRuns = 10;
  static constexpr size_t kArena = 4 << 20;
  CpuDevice device_;
  uint8_t* arena_ = nullptr;
  std::string dir_;
  std::unique_ptr<TierStore> store_;
};

// Real encoded pages of every format go out and come back byte for byte,
// through both tiers and a move between them.
TEST_F(TierStoreTest, EveryFormatRoundTripsByteExact) {
  Make(1 << 20, 1 << 20);
  kernels::PageShape shape;
  shape.tokens = 16;
  shape.heads = 2;
  shape.head_dim = 32;
  const size_t values = size_t{16} * 2 * 32;
  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<uint16_t> k(values), v(values);
  for (size_t i = 0; i < values; ++i) {
    k[i] = kernels::FloatToBf16(dist(rng));
    v[i] = kernels::FloatToBf16(dist(rng));
  }
  for (int f = 1; f <= 8; ++f) {
    const Encoding e(static_cast<Format>(f));
    ASSERT_EQ(kernels::ValidateEncoding(e, shape), nullptr) << f;
    const size_t bytes = kernels::PageBytes(e, shape);
    uint8_t* src = arena_;
    uint8_t* dst = arena_ + (1 << 20);
    kernels::EncodePage(e, shape, k.data(), v.data(), 16, src);
    for (Tier tier : {Tier::kHost, Tier::kDisk}) {
      SCOPED_TRACE(absl::StrCat("format ", f, " ", TierName(tier)));
      const uint8_t* pages[] = {src};
      const size_t sizes[] = {bytes};
      auto b = store_->Spill(tier, pages, sizes, Label(f));
      ASSERT_THAT(b.status(), IsOk());
      EXPECT_EQ(b->bytes(), bytes);
      EXPECT_EQ(b->pages[0].crc, Crc32c(src, bytes));
      EXPECT_EQ(store_->Usage(tier).used_bytes, bytes);
      EXPECT_EQ(store_->Usage(tier).blocks, 1u);
      // Through the other tier and back.
      const Tier other = tier == Tier::kHost ? Tier::kDisk : Tier::kHost;
      auto moved = store_->Move(*b, other, Label(f));
      ASSERT_THAT(moved.status(), IsOk());
      store_->Release(&*b);
      std::memset(dst, 0xAB, bytes);
      uint8_t* dsts[] = {dst};
      ASSERT_THAT(store_->Restore(*moved, dsts, Label(f)), IsOk());
      EXPECT_EQ(std::memcmp(dst, src, bytes), 0);
      store_->Release(&*moved);
      EXPECT_EQ(store_->Usage(Tier::kHost).used_bytes, 0u);
      EXPECT_EQ(store_->Usage(Tier::kDisk).used_bytes, 0u);
      EXPECT_EQ(store_->Usage(Tier::kHost).blocks, 0u);
      EXPECT_EQ(store_->Usage(Tier::kDisk).blocks, 0u);
    }
  }
  EXPECT_TRUE(Files(store_->disk_dir()).empty());
}

TEST_F(TierStoreTest, MultiLayerBlockUsesOneFilePerPage) {
  Make(1 << 20, 1 << 20);
  const std::vector<uint8_t*> src = Pages(0, 3, 1000, 3);
  const std::vector<const uint8_t*> pages(src.begin(), src.end());
  const std::vector<size_t> sizes(3, 1000);
  auto b = store_->Spill(Tier::kDisk, pages, sizes, Label());
  ASSERT_THAT(b.status(), IsOk());
  EXPECT_EQ(Files(store_->disk_dir()),
            (std::vector<std::string>{"s.7.L0.0.kvpage", "s.7.L1.1.kvpage",
                                      "s.7.L2.2.kvpage"}));
  // Header: magic, version, layer, lineage, size, checksum.
  std::ifstream in(b->pages[1].path, std::ios::binary);
  std::string file((std::istreambuf_iterator<char>(in)),
                   std::istreambuf_iterator<char>());
  ASSERT_EQ(file.size(), TierStore::kHeaderBytes + 1000);
  EXPECT_EQ(file.substr(0, 8), "TRXKVPG1");
  uint32_t layer = 0, crc = 0;
  uint64_t lineage = 0, bytes = 0;
  std::memcpy(&layer, file.data() + 12, 4);
  std::memcpy(&lineage, file.data() + 16, 8);
  std::memcpy(&bytes, file.data() + 24, 8);
  std::memcpy(&crc, file.data() + 32, 4);
  EXPECT_EQ(layer, 1u);
  EXPECT_EQ(lineage, 7u);
  EXPECT_EQ(bytes, 1000u);
  EXPECT_EQ(crc, Crc32c(src[1], 1000));
  EXPECT_EQ(std::memcmp(file.data() + TierStore::kHeaderBytes, src[1], 1000),
            0);
  store_->Release(&*b);
  EXPECT_TRUE(Files(store_->disk_dir()).empty());
}

TEST_F(TierStoreTest, CapacityIsEnforcedAndNamesTheBytesOver) {
  Make(4096, 3000);
  const std::vector<uint8_t*> src = Pages(0, 2, 1500, 5);
  const std::vector<const uint8_t*> pages(src.begin(), src.end());
  const std::vector<size_t> sizes(2, 1500);
  auto h1 = store_->Spill(Tier::kHost, pages, sizes, Label(1));
  ASSERT_THAT(h1.status(), IsOk());  // 2 x 1536-byte extents of 4096
  EXPECT_THAT(store_->Spill(Tier::kHost, pages, sizes, Label(2)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("host tier"), HasSubstr("lineage_id=2"),
                             HasSubstr("needs 3000 bytes"),
                             HasSubstr("1024 of 4096 bytes are free"),
                             HasSubstr("2048 bytes over"))));
  EXPECT_EQ(store_->Usage(Tier::kHost).used_bytes, 3000u);
  EXPECT_EQ(store_->Usage(Tier::kHost).blocks, 1u);

  auto d1 = store_->Spill(Tier::kDisk, pages, sizes, Label(3));
  ASSERT_THAT(d1.status(), IsOk());  // exactly full
  EXPECT_THAT(store_->Spill(Tier::kDisk, pages, sizes, Label(4)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("disk tier"), HasSubstr("needs 3000"),
                             HasSubstr("0 of 3000 bytes are free"),
                             HasSubstr("3000 bytes over"))));
  // A move into a full tier changes nothing either.
  EXPECT_THAT(store_->Move(*h1, Tier::kDisk, Label(1)),
              StatusIs(absl::StatusCode::kResourceExhausted, _));
  EXPECT_EQ(store_->Usage(Tier::kDisk).pages, 2u);
  EXPECT_EQ(Files(store_->disk_dir()).size(), 2u);
  store_->Release(&*h1);
  store_->Release(&*d1);
  EXPECT_EQ(store_->Usage(Tier::kHost).used_bytes, 0u);
  EXPECT_EQ(store_->Usage(Tier::kDisk).used_bytes, 0u);
}

TEST_F(TierStoreTest, DisabledAndNonSpillTiersAreRefused) {
  Make(0, 0);
  EXPECT_FALSE(store_->Enabled(Tier::kHost));
  EXPECT_FALSE(store_->Enabled(Tier::kDisk));
  const std::vector<uint8_t*> src = Pages(0, 1, 64, 1);
  const uint8_t* pages[] = {src[0]};
  const size_t sizes[] = {64};
  EXPECT_THAT(store_->Spill(Tier::kHost, pages, sizes, Label()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("host_tier_mb=0")));
  EXPECT_THAT(store_->Spill(Tier::kDisk, pages, sizes, Label()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("disk_tier_dir")));
  EXPECT_THAT(
      store_->Spill(Tier::kDevice, pages, sizes, Label()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tier=1")));
  EXPECT_EQ(store_->Usage(Tier::kDisk).capacity_bytes, 0u);
}

TEST_F(TierStoreTest, CorruptHostByteIsDataLoss) {
  Make(1 << 20, 0);
  const std::vector<uint8_t*> src = Pages(0, 2, 512, 9);
  const std::vector<const uint8_t*> pages(src.begin(), src.end());
  const std::vector<size_t> sizes(2, 512);
  auto b = store_->Spill(Tier::kHost, pages, sizes, Label());
  ASSERT_THAT(b.status(), IsOk());
  store_->HostPageBytes(b->pages[1])[100] ^= 0x01;
  uint8_t* dst[] = {arena_ + 8192, arena_ + 16384};
  const absl::Status s = store_->Restore(*b, dst, Label());
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kDataLoss,
                          AllOf(HasSubstr("sequence_id=\"s\""),
                                HasSubstr("lineage_id=7"), HasSubstr("layer 1"),
                                HasSubstr("host tier"),
                                HasSubstr("checksum mismatch"))));
  // Still refused on a second try, still held until released.
  EXPECT_THAT(store_->Restore(*b, dst, Label()),
              StatusIs(absl::StatusCode::kDataLoss, _));
  EXPECT_THAT(store_->Move(*b, Tier::kDisk, Label()),
              StatusIs(absl::StatusCode::kFailedPrecondition, _));
  EXPECT_EQ(store_->Usage(Tier::kHost).blocks, 1u);
  store_->Release(&*b);
  EXPECT_EQ(store_->Usage(Tier::kHost).used_bytes, 0u);
}

// A host tier fragmented so that no free run holds a 7000-byte page still
// takes a block of two such pages (the free bytes cover them), scattered
// over several runs; it comes back byte for byte, survives a move to disk
// and back, and releasing everything leaves the tier whole.
TEST_F(TierStoreTest, FragmentedHostTierScattersPagesAndRoundTrips) {
  Make(kFragCapacity, 1 << 20);
  std::vector<SpilledBlock> held = FragmentHost();
  ASSERT_FALSE(held.empty());
  const TierUsage before = store_->Usage(Tier::kHost);
  ASSERT_LT(before.largest_free_run, 7168u);  // no run holds one page
  ASSERT_GE(before.free_bytes, 2 * 7168u);    // the free bytes hold both

  const std::vector<uint8_t*> src = Pages(0, 2, 7000, 21);
  const std::vector<const uint8_t*> pages(src.begin(), src.end());
  const std::vector<size_t> sizes(2, 7000);
  auto b = store_->Spill(Tier::kHost, pages, sizes, Label(1));
  ASSERT_THAT(b.status(), IsOk());
  for (int l = 0; l < 2; ++l) {
    EXPECT_GT(b->pages[l].host_pieces.size(), 1u) << "layer " << l;
    EXPECT_EQ(b->pages[l].crc, Crc32c(src[l], 7000)) << "layer " << l;
  }
  std::vector<SpilledBlock*> all = {&*b};
  for (SpilledBlock& h : held) all.push_back(&h);
  ExpectDisjointExtents(all);
  TierUsage u = store_->Usage(Tier::kHost);
  EXPECT_EQ(u.used_bytes, before.used_bytes + 14000);
  EXPECT_EQ(u.free_bytes, before.free_bytes - 2 * 7168);
  EXPECT_EQ(u.scattered_pages, 2u);
  EXPECT_EQ(u.blocks, before.blocks + 1);

  // Restore: gathered, checked, byte-exact.
  uint8_t* dst[] = {arena_ + (1 << 20), arena_ + (1 << 20) + 8192};
  auto restore_and_check = [&](const SpilledBlock& from) {
    for (uint8_t* d : dst) std::memset(d, 0xCD, 7000);
    ASSERT_THAT(store_->Restore(from, dst, Label(1)), IsOk());
    for (int l = 0; l < 2; ++l) {
      EXPECT_EQ(std::memcmp(dst[l], src[l], 7000), 0) << "layer " << l;
      EXPECT_EQ(Crc32c(dst[l], 7000), from.pages[l].crc);
    }
  };
  restore_and_check(*b);

  // To disk and back: the files hold the page contiguous, and the way back
  // scatters it again over the same free runs.
  auto on_disk = store_->Move(*b, Tier::kDisk, Label(1));
  ASSERT_THAT(on_disk.status(), IsOk());
  store_->Release(&*b);
  EXPECT_EQ(store_->Usage(Tier::kHost).free_bytes, before.free_bytes);
  EXPECT_EQ(store_->Usage(Tier::kHost).scattered_pages, 0u);
  restore_and_check(*on_disk);
  auto back = store_->Move(*on_disk, Tier::kHost, Label(1));
  ASSERT_THAT(back.status(), IsOk());
  store_->Release(&*on_disk);
  EXPECT_GT(back->pages[0].host_pieces.size(), 1u);
  EXPECT_EQ(store_->Usage(Tier::kHost).scattered_pages, 2u);
  restore_and_check(*back);

  // A block that takes exactly the rest of the free bytes fits as well.
  store_->Release(&*back);
  const std::vector<size_t> rest(2, kFragFree / 2);
  const std::vector<uint8_t*> big = Pages(1 << 20, 2, kFragFree / 2, 23);
  const std::vector<const uint8_t*> big_pages(big.begin(), big.end());
  auto full = store_->Spill(Tier::kHost, big_pages, rest, Label(2));
  ASSERT_THAT(full.status(), IsOk());
  EXPECT_EQ(store_->Usage(Tier::kHost).free_bytes, 0u);
  EXPECT_EQ(store_->Usage(Tier::kHost).free_runs, 0u);
  const std::vector<uint8_t*> out = {arena_ + (2 << 20),
                                     arena_ + (2 << 20) + kFragFree};
  ASSERT_THAT(store_->Restore(*full, out, Label(2)), IsOk());
  EXPECT_EQ(std::memcmp(out[0], big[0], kFragFree / 2), 0);
  EXPECT_EQ(std::memcmp(out[1], big[1], kFragFree / 2), 0);
  store_->Release(&*full);

  for (SpilledBlock& h : held) store_->Release(&h);
  u = store_->Usage(Tier::kHost);
  EXPECT_EQ(u.free_bytes, kFragCapacity);
  EXPECT_EQ(u.free_runs, 1u);
  EXPECT_EQ(u.largest_free_run, kFragCapacity);
  EXPECT_EQ(u.used_bytes, 0u);
  EXPECT_EQ(u.pages, 0u);
  EXPECT_EQ(u.blocks, 0u);
  EXPECT_EQ(u.scattered_pages, 0u);
  EXPECT_EQ(store_->Usage(Tier::kDisk).used_bytes, 0u);
  EXPECT_TRUE(Files(store_->disk_dir()).empty());
}

// Fragmented or not, the host tier refuses only when the free bytes (in
// 256-byte units) do not cover the block, and then changes nothing.
TEST_F(TierStoreTest, FragmentedHostTierRefusesOnlyWhenFreeBytesFallShort) {
  Make(kFragCapacity, 0);
  std::vector<SpilledBlock> held = FragmentHost();
  const TierUsage before = store_->Usage(Tier::kHost);
  const std::vector<uint8_t*> src = Pages(0, 3, 7000, 31);
  const std::vector<const uint8_t*> pages(src.begin(), src.end());
  const std::vector<size_t> sizes(3, 7000);  // 3 x 7168 = 21504 > 20480
  EXPECT_THAT(
      store_->Spill(Tier::kHost, pages, sizes, Label(3)),
      StatusIs(absl::StatusCode::kResourceExhausted,
               AllOf(HasSubstr("host tier"), HasSubstr("lineage_id=3"),
                     HasSubstr("needs 21000 bytes (21504 in 256-byte extents)"),
                     HasSubstr("20480 of 65536 bytes are free (10 free runs)"),
                     HasSubstr("1024 bytes over"))));
  const TierUsage after = store_->Usage(Tier::kHost);
  EXPECT_EQ(after.free_bytes, before.free_bytes);
  EXPECT_EQ(after.free_runs, before.free_runs);
  EXPECT_EQ(after.pages, before.pages);
  EXPECT_EQ(after.used_bytes, before.used_bytes);
  // Two of the pages fit (scattered).
  auto two = store_->Spill(Tier::kHost, absl::MakeSpan(pages).first(2),
                           absl::MakeSpan(sizes).first(2), Label(4));
  ASSERT_THAT(two.status(), IsOk());
  store_->Release(&*two);
  for (SpilledBlock& h : held) store_->Release(&h);
  EXPECT_EQ(store_->Usage(Tier::kHost).free_runs, 1u);
}

TEST_F(TierStoreTest, CorruptByteInAScatteredPageIsDataLoss) {
  Make(kFragCapacity, 1 << 20);
  std::vector<SpilledBlock> held = FragmentHost();
  const std::vector<uint8_t*> src = Pages(0, 2, 7000, 41);
  const std::vector<const uint8_t*> pages(src.begin(), src.end());
  const std::vector<size_t> sizes(2, 7000);
  auto b = store_->Spill(Tier::kHost, pages, sizes, Label(5));
  ASSERT_THAT(b.status(), IsOk());
  const SpilledPage& page = b->pages[1];
  ASSERT_GT(page.host_pieces.size(), 1u);
  // A byte of the second piece: the view walks the pieces in page order.
  const size_t at = page.host_pieces[0].bytes + 3;
  HostPageView view = store_->HostPageBytes(page);
  ASSERT_EQ(view.size(), 7000u);
  EXPECT_EQ(view[at], src[1][at]);
  view[at] ^= 0x20;
  uint8_t* dst[] = {arena_ + (1 << 20), arena_ + (1 << 20) + 8192};
  EXPECT_THAT(
      store_->Restore(*b, dst, Label(5)),
      StatusIs(absl::StatusCode::kDataLoss,
               AllOf(HasSubstr("lineage_id=5"), HasSubstr("layer 1"),
                     HasSubstr("host tier"), HasSubstr("checksum mismatch"))));
  // A move verifies too, and keeps nothing of what it started.
  EXPECT_THAT(store_->Move(*b, Tier::kDisk, Label(5)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("layer 1")));
  EXPECT_EQ(store_->Usage(Tier::kDisk).used_bytes, 0u);
  EXPECT_TRUE(Files(store_->disk_dir()).empty());
  // Flipped back, it restores.
  view[at] ^= 0x20;
  ASSERT_THAT(store_->Restore(*b, dst, Label(5)), IsOk());
  EXPECT_EQ(std::memcmp(dst[1], src[1], 7000), 0);
  store_->Release(&*b);
  for (SpilledBlock& h : held) store_->Release(&h);
  EXPECT_EQ(store_->Usage(Tier::kHost).free_bytes, kFragCapacity);
}

// A CPU device whose CopyToHost fails from call `fail_from` on; counts
// both copy directions.
class FailingCopyDevice final : public Device {
 public:
  int calls = 0;  // CopyToHost
  int fail_from = 1 << 30;
  int from_host_calls = 0;

  const char* Name() const override { return "failing-copy"; }
  absl::StatusOr<uint8_t*> AllocateArena(size_t bytes) override {
    return cpu_.AllocateArena(bytes);
  }
  void FreeArena(uint8_t* base, size_t bytes) override {
    cpu_.FreeArena(base, bytes);
  }
  absl::Status EncodePage(const Encoding& e, const kernels::PageShape& shape,
                          const uint16_t* k, const uint16_t* v, int n,
                          uint8_t* page) override {
    return cpu_.EncodePage(e, shape, k, v, n, page);
  }
  absl::Status DecodePage(const Encoding& e, const kernels::PageShape& shape,
                          const uint8_t* page, int n, float* k,
                          float* v) override {
    return cpu_.DecodePage(e, shape, page, n, k, v);
  }
  absl::Status WriteBf16Tokens(const kernels::PageShape& shape,
                               const uint16_t* k, const uint16_t* v, int first,
                               int n, uint8_t* page) override {
    return cpu_.WriteBf16Tokens(shape, k, v, first, n, page);
  }
  absl::Status CopyPage(uint8_t* dst, const uint8_t* src,
                        size_t bytes) override {
    return cpu_.CopyPage(dst, src, bytes);
  }
  absl::Status DecodeAttention(const kernels::DecodeParams& p) override {
    return cpu_.DecodeAttention(p);
  }
  absl::Status CopyToHost(void* dst, const uint8_t* src,
                          size_t bytes) override {
    if (++calls >= fail_from) return absl::InternalError("copy failed");
    return cpu_.CopyToHost(dst, src, bytes);
  }
  absl::Status CopyFromHost(uint8_t* dst, const void* src,
                            size_t bytes) override {
    ++from_host_calls;
    return cpu_.CopyFromHost(dst, src, bytes);
  }
  absl::StatusOr<uint8_t*> AllocateHostTier(size_t bytes) override {
    return cpu_.AllocateHostTier(bytes);
  }
  void FreeHostTier(uint8_t* base, size_t bytes) override {
    cpu_.FreeHostTier(base, bytes);
  }

 private:
  CpuDevice cpu_;
};

// A copy failing halfway through a scattered page gives every reserved
// piece back: the tier is exactly as before.
TEST_F(TierStoreTest, FailedCopyOfAScatteredPageGivesBackEveryPiece) {
  FailingCopyDevice dev;
  TierStoreOptions o;
  o.host_capacity_bytes = 8192;
  auto made = TierStore::Create(&dev, o);
  ASSERT_THAT(made.status(), IsOk());
  std::unique_ptr<TierStore> tiers = *std::move(made);
  // Free runs of 1024 at 0, 2048 and 4096 and 6144..8192 (2048).
  const std::vector<uint8_t*> src = Pages(0, 1, 3000, 51);
  const uint8_t* one[] = {src[0]};
  std::vector<SpilledBlock> blocks;
  for (int i = 0; i < 8; ++i) {
    const size_t size[] = {1024};
    auto b = tiers->Spill(Tier::kHost, one, size, Label(10 + i));
    ASSERT_THAT(b.status(), IsOk());
    blocks.push_back(*std::move(b));
  }
  for (int i : {0, 2, 4, 6, 7}) tiers->Release(&blocks[i]);
  const TierUsage before = tiers->Usage(Tier::kHost);
  ASSERT_EQ(before.free_bytes, 5120u);
  ASSERT_EQ(before.free_runs, 4u);
  ASSERT_EQ(before.largest_free_run, 2048u);

  // 3072 bytes: no run holds them, so 2048 at 6144, then 1024 at 0.
  const size_t size[] = {3000};
  dev.calls = 0;
  dev.fail_from = 2;  // the second piece's copy fails
  EXPECT_THAT(tiers->Spill(Tier::kHost, one, size, Label(20)),
              StatusIs(absl::StatusCode::kInternal,
                       AllOf(HasSubstr("lineage_id=20"), HasSubstr("layer 0"),
                             HasSubstr("copy failed"))));
  EXPECT_EQ(dev.calls, 2);
  TierUsage after = tiers->Usage(Tier::kHost);
  EXPECT_EQ(after.free_bytes, before.free_bytes);
  EXPECT_EQ(after.free_runs, before.free_runs);
  EXPECT_EQ(after.used_bytes, before.used_bytes);
  EXPECT_EQ(after.pages, before.pages);
  EXPECT_EQ(after.scattered_pages, 0u);
  EXPECT_EQ(after.blocks, before.blocks);

  dev.fail_from = 1 << 30;
  dev.calls = 0;
  auto ok = tiers->Spill(Tier::kHost, one, size, Label(21));
  ASSERT_THAT(ok.status(), IsOk());
  EXPECT_EQ(dev.calls, static_cast<int>(ok->pages[0].host_pieces.size()));
  EXPECT_GT(ok->pages[0].host_pieces.size(), 1u);
  // Restore copies piece by piece too, straight from the extents.
  std::vector<uint8_t> back(3000);
  uint8_t* dst[] = {back.data()};
  dev.from_host_calls = 0;
  ASSERT_THAT(tiers->Restore(*ok, dst, Label(21)), IsOk());
  EXPECT_EQ(dev.from_host_calls,
            static_cast<int>(ok->pages[0].host_pieces.size()));
  EXPECT_EQ(std::memcmp(back.data(), src[0], 3000), 0);
  tiers->Release(&*ok);
  for (int i : {1, 3, 5}) tiers->Release(&blocks[i]);
  after = tiers->Usage(Tier::kHost);
  EXPECT_EQ(after.free_bytes, 8192u);
  EXPECT_EQ(after.free_runs, 1u);
}

TEST_F(TierStoreTest, CorruptDiskFilesAreDataLoss) {
  Make(1 << 20, 1 << 20);
  const std::vector<uint8_t*> src = Pages(0, 1, 700, 13);
  const uint8_t* pages[] = {src[0]};
  const size_t sizes[] = {700};
  uint8_t* dst[] = {arena_ + 8192};
  auto flip = [](const std::string& path, size_t at) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(at);
    char c;
    f.get(c);
    f.seekp(at);
    f.put(static_cast<char>(c ^ 0x40));
  };
  {  // a flipped payload byte
    auto b = store_->Spill(Tier::kDisk, pages, sizes, Label());
    ASSERT_THAT(b.status(), IsOk());
    flip(b->pages[0].path, TierStore::kHeaderBytes + 321);
    EXPECT_THAT(store_->Restore(*b, dst, Label()),
                StatusIs(absl::StatusCode::kDataLoss,
                         AllOf(HasSubstr("lineage_id=7"), HasSubstr("layer 0"),
                               HasSubstr("disk tier"),
                               HasSubstr("checksum mismatch"))));
    // A move out of a bad file is refused too, and keeps nothing.
    EXPECT_THAT(store_->Move(*b, Tier::kHost, Label()),
                StatusIs(absl::StatusCode::kDataLoss, _));
    EXPECT_EQ(store_->Usage(Tier::kHost).used_bytes, 0u);
    store_->Release(&*b);
  }
  {  // a flipped header byte
    auto b = store_->Spill(Tier::kDisk, pages, sizes, Label());
    ASSERT_THAT(b.status(), IsOk());
    flip(b->pages[0].path, 20);
    EXPECT_THAT(store_->Restore(*b, dst, Label()),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("header")));
    store_->Release(&*b);
  }
  {  // a truncated file
    auto b = store_->Spill(Tier::kDisk, pages, sizes, Label());
    ASSERT_THAT(b.status(), IsOk());
    fs::resize_file(b->pages[0].path, 500);
    EXPECT_THAT(store_->Restore(*b, dst, Label()),
                StatusIs(absl::StatusCode::kDataLoss,
                         HasSubstr("has 500 bytes, expected 740")));
    store_->Release(&*b);
  }
  {  // a deleted file
    auto b = store_->Spill(Tier::kDisk, pages, sizes, Label());
    ASSERT_THAT(b.status(), IsOk());
    fs::remove(b->pages[0].path);
    EXPECT_THAT(store_->Restore(*b, dst, Label()),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("missing")));
    store_->Release(&*b);
  }
  EXPECT_EQ(store_->Usage(Tier::kDisk).used_bytes, 0u);
  EXPECT_TRUE(Files(store_->disk_dir()).empty());
}

// Page files appear only under their final name; a failed write leaves no
// temp file and keeps nothing of the block.
TEST_F(TierStoreTest, FailedRenameLeavesNoTempFileAndNothingKept) {
  Make(0, 1 << 20);
  // The second page's final name is taken by a directory: its rename fails.
  ASSERT_TRUE(
      fs::create_directory(fs::path(store_->disk_dir()) / "s.7.L1.1.kvpage"));
  const std::vector<uint8_t*> src = Pages(0, 2, 256, 17);
  const std::vector<const uint8_t*> pages(src.begin(), src.end());
  const std::vector<size_t> sizes(2, 256);
  EXPECT_THAT(store_->Spill(Tier::kDisk, pages, sizes, Label()),
              StatusIs(absl::StatusCode::kInternal,
                       AllOf(HasSubstr("rename"), HasSubstr("layer 1"))));
  EXPECT_EQ(Files(store_->disk_dir()),
            (std::vector<std::string>{"s.7.L1.1.kvpage"}));  // the directory
  EXPECT_EQ(store_->Usage(Tier::kDisk).used_bytes, 0u);
  EXPECT_EQ(store_->Usage(Tier::kDisk).pages, 0u);
  EXPECT_EQ(store_->Usage(Tier::kDisk).blocks, 0u);
}

TEST_F(TierStoreTest, StartupCleansLeftoversAndShutdownRemovesTheDirectory) {
  const fs::path own = fs::path(dir_) / "w1";
  // 999999999 is above any pid_max, so that "process" is gone.
  const fs::path dead = fs::path(dir_) / "pid-999999999";
  const fs::path live = fs::path(dir_) / absl::StrCat("pid-", ::getpid());
  for (const fs::path& d : {own, dead, live}) fs::create_directories(d);
  for (const fs::path& f :
       {own / "a.1.L0.0.kvpage", own / "a.1.L1.1.kvpage.tmp",
        dead / "b.2.L0.0.kvpage", live / "c.3.L0.0.kvpage"}) {
    std::ofstream(f) << "stale";
  }
  std::ofstream(own / "notes.txt") << "not ours";
  Make(0, 1 << 20, "w1");
  EXPECT_EQ(store_->disk_dir(), own.string());
  EXPECT_EQ(Files(own.string()), (std::vector<std::string>{"notes.txt"}));
  EXPECT_FALSE(fs::exists(dead));
  // A live process's directory is not ours to clean.
  EXPECT_TRUE(fs::exists(live / "c.3.L0.0.kvpage"));
  fs::remove(own / "notes.txt");
  store_.reset();
  EXPECT_FALSE(fs::exists(own));  // emptied on release, removed on shutdown
}

TEST_F(TierStoreTest, DefaultOwnerIsThePid) {
  Make(0, 1 << 20, "");
  EXPECT_EQ(store_->disk_dir(),
            (fs::path(dir_) / absl::StrCat("pid-", ::getpid())).string());
  TierStoreOptions bad;
  bad.disk_dir = dir_;
  bad.disk_capacity_bytes = 1;
  bad.owner = "../escape";
  EXPECT_THAT(TierStore::Create(&device_, bad).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("owner")));
}

}  // namespace
}  // namespace triax::worker
