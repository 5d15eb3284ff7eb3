// The fixture of the store-level transfer tests (store_transfer_test.cc:
// the stream path; store_transfer_shared_test.cc: the ipc path's shared
// exports): a source store with spill tiers and a destination store on one
// RecordingDevice, plans of kBlock-token blocks, writes of seeded random
// KV, and the comparisons of what two stores hold.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "kernels/layout.h"
#include "worker/page_allocator.h"
#include "worker/recording_device.h"
#include "worker/sequence_store.h"
#include "worker/store_transfer.h"
#include "worker/tier_store.h"

namespace triax::worker::transfer_testing {

namespace fs = std::filesystem;
using kernels::Encoding;
using kernels::Format;
using triax::testing::IsOk;

inline constexpr char kTenant[] = "tenant-a";
inline constexpr uint32_t kLayers = 2, kKv = 2, kQ = 4, kDim = 32, kBlock = 16;
inline constexpr size_t kPerToken = size_t{kKv} * kDim;

inline ModelShape Model() {
  ModelShape m;
  m.name = "test";
  m.n_layers = kLayers;
  m.n_kv_heads = kKv;
  m.n_q_heads = kQ;
  m.head_dim = kDim;
  return m;
}

// Blocks of kBlock tokens covering `tokens` (the last one partial), in `e`.
inline std::vector<BlockSpec> Plan(uint32_t tokens, const Encoding& e) {
  std::vector<BlockSpec> plan;
  for (uint32_t first = 0, i = 0; first < tokens; first += kBlock, ++i) {
    BlockSpec b;
    b.index = i;
    b.lineage_id = 100 + i;
    b.first_token = first;
    b.num_tokens = std::min(kBlock, tokens - first);
    b.encoding = e;
    plan.push_back(b);
  }
  return plan;
}

inline std::vector<ExportBlock> ExportList(const std::vector<BlockSpec>& plan) {
  std::vector<ExportBlock> out;
  for (const BlockSpec& b : plan) {
    if (!b.evicted) out.push_back({b.index, b.lineage_id, b.encoding});
  }
  return out;
}

inline std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> x(n);
  for (float& f : x) f = dist(rng);
  return x;
}

inline std::string Name(const Encoding& e) {
  char buf[96];
  return kernels::EncodingName(e, buf, sizeof(buf));
}

class TransferTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("triax_transfer_test_" + std::to_string(::getpid()));
    auto a = PageAllocator::Create(&device_, 16 << 20);
    ASSERT_THAT(a.status(), IsOk());
    src_alloc_ = *std::move(a);
    a = PageAllocator::Create(&device_, 16 << 20);
    ASSERT_THAT(a.status(), IsOk());
    dst_alloc_ = *std::move(a);
    TierStoreOptions to;
    to.host_capacity_bytes = 1 << 20;
    to.disk_dir = dir_.string();
    to.disk_capacity_bytes = 4 << 20;
    to.owner = "src";
    auto t = TierStore::Create(&device_, to);
    ASSERT_THAT(t.status(), IsOk());
    tiers_ = *std::move(t);
    StoreOptions so;
    so.window_tokens = 16;
    so.tiers = tiers_.get();
    so.prefetch_thread = false;
    src_ = std::make_unique<SequenceStore>(&device_, src_alloc_.get(), so);
    so.tiers = nullptr;
    dst_ = std::make_unique<SequenceStore>(&device_, dst_alloc_.get(), so);
  }
  void TearDown() override {
    src_.reset();
    dst_.reset();
    tiers_.reset();
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  // Installs `seq` on `store` and writes `written` tokens on every layer.
  void Install(SequenceStore* store, const std::string& seq,
               const std::vector<BlockSpec>& plan, uint32_t written,
               uint32_t seed = 1) {
    ASSERT_THAT(
        store->AllocatePages(kTenant, seq, Model(), kBlock, plan).status(),
        IsOk());
    for (uint32_t l = 0; l < kLayers; ++l)
      Write(store, seq, l, 0, written, seed);
  }
  void Write(SequenceStore* store, const std::string& seq, uint32_t layer,
             uint32_t first, uint32_t n, uint32_t seed = 1) {
    const std::vector<float> k =
        Random((first + n) * kPerToken, seed + 2 * layer);
    const std::vector<float> v =
        Random((first + n) * kPerToken, seed + 2 * layer + 1);
    const std::string kb(
        reinterpret_cast<const char*>(k.data() + first * kPerToken),
        n * kPerToken * 4);
    const std::string vb(
        reinterpret_cast<const char*>(v.data() + first * kPerToken),
        n * kPerToken * 4);
    KvWrite w;
    w.layer = layer;
    w.first_token = first;
    w.num_tokens = n;
    w.dtype = static_cast<int>(KvDtype::kF32);
    w.k = kb;
    w.v = vb;
    ASSERT_THAT(store->Write(kTenant, seq, w).status(), IsOk());
  }

  absl::StatusOr<std::vector<TransferPage>> Export(
      const std::string& seq, const std::vector<ExportBlock>& blocks,
      ExportOptions options = {}) {
    std::vector<TransferPage> all;
    std::vector<uint32_t> layers;
    absl::Status s =
        src_->Export(kTenant, seq, blocks, options,
                     [&](uint32_t layer, std::vector<TransferPage>* pages) {
                       layers.push_back(layer);
                       for (TransferPage& p : *pages)
                         all.push_back(std::move(p));
                       return absl::OkStatus();
                     });
    if (!s.ok()) return s;
    // Layer by layer, in order.
    for (size_t i = 0; i < layers.size(); ++i) EXPECT_EQ(layers[i], i);
    return all;
  }

  ImportPlan DstPlan(const std::string& seq, std::vector<BlockSpec> blocks) {
    ImportPlan p;
    p.tenant_id = kTenant;
    p.sequence_id = seq;
    p.model = Model();
    p.block_tokens = kBlock;
    p.window_tokens = 16;
    p.blocks = std::move(blocks);
    p.source = "source worker-a at 127.0.0.1:1";
    return p;
  }

  absl::StatusOr<ImportResult> Import(const ImportPlan& plan,
                                      const std::vector<TransferPage>& pages) {
    auto session = dst_->BeginImport(plan);
    if (!session.ok()) return session.status();
    for (const TransferPage& p : pages) {
      if (absl::Status s = (*session)->Install(p); !s.ok()) return s;
    }
    return (*session)->Commit();
  }

  // Read of every layer, src `a` vs dst `b`, equal float for float.
  void ExpectSameReads(SequenceStore* sa, const std::string& a,
                       SequenceStore* sb, const std::string& b) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      auto ra = sa->Read(kTenant, a, l, 0, 0);
      auto rb = sb->Read(kTenant, b, l, 0, 0);
      ASSERT_THAT(ra.status(), IsOk());
      ASSERT_THAT(rb.status(), IsOk());
      ASSERT_EQ(ra->num_tokens, rb->num_tokens);
      EXPECT_EQ(0, std::memcmp(ra->k.data(), rb->k.data(), ra->k.size() * 4));
      EXPECT_EQ(0, std::memcmp(ra->v.data(), rb->v.data(), ra->v.size() * 4));
    }
  }
  void ExpectSameAttention(SequenceStore* sa, const std::string& a,
                           SequenceStore* sb, const std::string& b) {
    const std::vector<float> q = Random(size_t{2} * kQ * kDim, 77);
    const std::string qb(reinterpret_cast<const char*>(q.data()), q.size() * 4);
    for (uint32_t l = 0; l < kLayers; ++l) {
      auto written = sa->Describe(a);
      ASSERT_THAT(written.status(), IsOk());
      const std::vector<uint64_t> pos = {20, written->written[l] - 1};
      AttendSpec spec;
      spec.layer = l;
      spec.num_queries = 2;
      spec.positions = pos;
      spec.queries = qb;
      auto oa = sa->Attend(kTenant, a, spec);
      auto ob = sb->Attend(kTenant, b, spec);
      ASSERT_THAT(oa.status(), IsOk());
      ASSERT_THAT(ob.status(), IsOk());
      ASSERT_EQ(oa->size(), ob->size());
      EXPECT_EQ(0, std::memcmp(oa->data(), ob->data(), oa->size() * 4));
    }
  }
  void ExpectSameTargetBytes(SequenceStore* sa, const std::string& a,
                             SequenceStore* sb, const std::string& b,
                             uint32_t blocks) {
    auto da = sa->Describe(a);
    ASSERT_THAT(da.status(), IsOk());
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (uint32_t i = 0; i < std::min(blocks, da->sealed[l]); ++i) {
        auto pa = sa->TargetPage(a, i, l);
        auto pb = sb->TargetPage(b, i, l);
        ASSERT_THAT(pa.status(), IsOk());
        ASSERT_THAT(pb.status(), IsOk());
        ASSERT_EQ((*pa)->bytes, (*pb)->bytes);
        EXPECT_EQ(0, std::memcmp((*pa)->data, (*pb)->data, (*pa)->bytes))
            << "block " << i << " layer " << l;
      }
    }
  }

  RecordingDevice device_;
  fs::path dir_;
  std::unique_ptr<PageAllocator> src_alloc_, dst_alloc_;
  std::unique_ptr<TierStore> tiers_;
  std::unique_ptr<SequenceStore> src_, dst_;
};

// 71 tokens in blocks of 16: blocks 0..2 sealed, 3 and 4 (partial) in the
// window (window_tokens 16).
inline constexpr uint32_t kTokens = 71;

}  // namespace triax::worker::transfer_testing
