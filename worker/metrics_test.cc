// WorkerMetrics over a real store on a recording CPU device: the pool,
// encoding and tier series follow allocations and frees; readiness follows
// serving, the device's health and registration.
#include "worker/metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/metrics.h"
#include "common/status_matchers.h"
#include "worker/recording_device.h"
#include "worker/tier_store.h"

namespace triax::worker {
namespace {

using ::testing::HasSubstr;
using ::testing::Optional;
using triax::testing::IsOk;

std::optional<double> Sample(const std::vector<prometheus::MetricFamily>& fs,
                             const std::string& name,
                             const std::map<std::string, std::string>& labels) {
  for (const auto& f : fs) {
    if (f.name != name) continue;
    for (const auto& m : f.metric) {
      std::map<std::string, std::string> have;
      for (const auto& l : m.label) have[l.name] = l.value;
      if (have != labels) continue;
      return f.type == prometheus::MetricType::Counter ? m.counter.value
                                                       : m.gauge.value;
    }
  }
  return std::nullopt;
}

AllocatePagesRequest Alloc(const std::string& seq, uint32_t tokens) {
  AllocatePagesRequest r;
  r.tenant_id = "t";
  r.sequence_id = seq;
  r.model = ModelShape{"test", 2, 2, 4, 32};
  r.block_tokens = 16;
  for (uint32_t first = 0, i = 0; first < tokens; first += 16, ++i) {
    BlockSpec b;
    b.index = i;
    b.lineage_id = 1000 + i;
    b.first_token = first;
    b.num_tokens = std::min(16u, tokens - first);
    b.encoding = kernels::Format::kINT4;
    r.blocks.push_back(b);
  }
  return r;
}

class WorkerMetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto a = PageAllocator::Create(&device_, 4 << 20);
    ASSERT_TRUE(a.ok()) << a.status();
    alloc_ = *std::move(a);
    TierStoreOptions to;
    to.host_capacity_bytes = 256 << 10;
    to.owner = "metrics-test";
    auto t = TierStore::Create(&device_, to);
    ASSERT_TRUE(t.ok()) << t.status();
    tiers_ = *std::move(t);
    StoreOptions so;
    so.window_tokens = 4;
    so.tiers = tiers_.get();
    so.prefetch_thread = false;
    store_ = std::make_unique<SequenceStore>(&device_, alloc_.get(), so);
    core_ = std::make_unique<WorkerCore>(store_.get(), &device_);
  }
  void TearDown() override {
    core_.reset();
    store_.reset();
    tiers_.reset();
    alloc_.reset();
  }

  RecordingDevice device_;
  std::unique_ptr<PageAllocator> alloc_;
  std::unique_ptr<TierStore> tiers_;
  std::unique_ptr<SequenceStore> store_;
  std::unique_ptr<WorkerCore> core_;
};

TEST_F(WorkerMetricsTest, PoolSeriesFollowAllocationsAndFrees) {
  WorkerMetrics metrics(core_.get());
  auto fs = metrics.Collect();
  EXPECT_THAT(Sample(fs, "triaxkv_worker_pool_capacity_bytes", {}),
              Optional(static_cast<double>(4 << 20)));
  EXPECT_THAT(Sample(fs, "triaxkv_worker_pool_used_bytes", {}), Optional(0.0));
  EXPECT_THAT(Sample(fs, "triaxkv_worker_sequences", {}), Optional(0.0));
  EXPECT_THAT(
      Sample(fs, "triaxkv_worker_tier_capacity_bytes", {{"tier", "host"}}),
      Optional(static_cast<double>(256 << 10)));
  EXPECT_THAT(
      Sample(fs, "triaxkv_worker_tier_capacity_bytes", {{"tier", "disk"}}),
      Optional(0.0));
  EXPECT_THAT(Sample(fs, "triaxkv_worker_device_healthy", {}), Optional(1.0));

  ASSERT_THAT(core_->AllocatePages(Alloc("s", 40)), IsOk());
  fs = metrics.Collect();
  const InventorySnapshot inv = core_->Inventory();
  ASSERT_GT(inv.used_bytes, 0u);
  EXPECT_THAT(Sample(fs, "triaxkv_worker_pool_used_bytes", {}),
              Optional(static_cast<double>(inv.used_bytes)));
  EXPECT_THAT(Sample(fs, "triaxkv_worker_sequences", {}), Optional(1.0));
  // Three INT4 blocks on two layers: six target pages.
  EXPECT_THAT(
      Sample(fs, "triaxkv_worker_encoding_pages", {{"encoding", "int4"}}),
      Optional(6.0));
  EXPECT_THAT(Sample(fs, "triaxkv_worker_pages", {{"format", "int4"}}),
              Optional(6.0));
  const auto frames =
      Sample(fs, "triaxkv_worker_pool_frames", {{"encoding", "int4"}});
  ASSERT_TRUE(frames.has_value());
  EXPECT_GE(*frames, 1.0);

  FreeRequest free;
  free.tenant_id = "t";
  free.sequence_id = "s";
  ASSERT_THAT(core_->Free(free), IsOk());
  fs = metrics.Collect();
  EXPECT_THAT(Sample(fs, "triaxkv_worker_pool_used_bytes", {}), Optional(0.0));
  EXPECT_THAT(Sample(fs, "triaxkv_worker_sequences", {}), Optional(0.0));
  // The text exposition holds the families.
  const std::string text = MetricsResponse({&metrics}).body;
  EXPECT_THAT(text, HasSubstr("# TYPE triaxkv_worker_spills_total counter"));
  EXPECT_THAT(text, HasSubstr("triaxkv_worker_checksum_failures_total 0\n"));
}

// triaxkv_worker_attention_kernel_seconds_total is the device's kernel
// time: 0 before any attention, more after a DecodeAttentionBatch (on the
// CPU backend the reference kernel's wall time).
TEST_F(WorkerMetricsTest, AttentionKernelSecondsFollowTheDevice) {
  WorkerMetrics metrics(core_.get());
  const char* kName = "triaxkv_worker_attention_kernel_seconds_total";
  EXPECT_THAT(Sample(metrics.Collect(), kName, {}), Optional(0.0));
  const kernels::PageShape shape{16, 2, 32};
  const kernels::Encoding e(kernels::Format::kBF16);
  std::vector<uint8_t> page(kernels::PageBytes(e, shape));
  const std::vector<uint16_t> kv(size_t{16} * 2 * 32, 0x3F80);  // 1.0
  ASSERT_THAT(
      device_.EncodePage(e, shape, kv.data(), kv.data(), 16, page.data()),
      IsOk());
  const kernels::PageRef ref{e, page.data(), 16};
  std::vector<float> q(size_t{4} * 32, 1.f), out(q.size(), -1.f);
  kernels::DecodeParams p;
  p.q = q.data();
  p.out = out.data();
  p.n_q_heads = 4;
  p.shape = shape;
  p.scale = 0.125f;
  p.pages = &ref;
  p.num_pages = 1;
  p.attend_tokens = 16;
  const std::vector<kernels::DecodeParams> batch(64, p);
  ASSERT_THAT(device_.DecodeAttentionBatch(batch), IsOk());
  EXPECT_FLOAT_EQ(out[0], 1.f);  // every value is 1
  const std::optional<double> after = Sample(metrics.Collect(), kName, {});
  ASSERT_TRUE(after.has_value());
  EXPECT_GT(*after, 0.0);
  EXPECT_LT(*after, 60.0);
}

TEST_F(WorkerMetricsTest, ReadinessAndHealth) {
  bool registered = false;
  WorkerReadiness r(core_.get(), [&registered] { return registered; });
  EXPECT_EQ(r.Ready().status, 503);
  EXPECT_EQ(r.Ready().body, "not serving\n");
  r.SetServing(true);
  EXPECT_EQ(r.Ready().status, 503);
  EXPECT_EQ(r.Ready().body, "not registered with the manager yet\n");
  registered = true;
  EXPECT_EQ(r.Ready().status, 200);
  EXPECT_EQ(r.Health().status, 200);

  device_.SetUnhealthy("sticky CUDA error 700");
  EXPECT_EQ(r.Ready().status, 503);
  EXPECT_THAT(r.Ready().body, HasSubstr("sticky CUDA error 700"));
  EXPECT_EQ(r.Health().status, 503);
  WorkerMetrics metrics(core_.get());
  EXPECT_THAT(Sample(metrics.Collect(), "triaxkv_worker_device_healthy", {}),
              Optional(0.0));

  WorkerReadiness standalone(core_.get(), nullptr);
  standalone.SetServing(true);
  device_.SetUnhealthy("");
  EXPECT_EQ(standalone.Ready().status, 200);
}

TEST(OpTimingsTest, AttentionByFormatMixAndImportsByPath) {
  OpTimings t;
  std::vector<uint64_t> bf16_only(9, 0), mixed(9, 0), none(9, 0);
  bf16_only[static_cast<size_t>(kernels::Format::kBF16)] = 4;
  mixed[static_cast<size_t>(kernels::Format::kBF16)] = 1;
  mixed[static_cast<size_t>(kernels::Format::kINT4)] = 6;
  t.RecordAttention(bf16_only, 0.002);
  t.RecordAttention(bf16_only, 0.004);
  t.RecordAttention(mixed, 0.5);
  t.RecordAttention(none, 1);  // nothing attended: not observed
  t.RecordImport("stream", true, 1000, 0.2);
  t.RecordImport("unknown", false, 0, 0.1);
  const std::string text = [&] {
    class Wrap : public prometheus::Collectable {
     public:
      explicit Wrap(const OpTimings* t) : t_(t) {}
      std::vector<prometheus::MetricFamily> Collect() const override {
        return t_->Collect("triaxkv_worker_");
      }

     private:
      const OpTimings* t_;
    } wrap(&t);
    return MetricsResponse({&wrap}).body;
  }();
  EXPECT_THAT(text, HasSubstr("triaxkv_worker_attention_seconds_count{"
                              "formats=\"bf16\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("triaxkv_worker_attention_seconds_sum{"
                              "formats=\"bf16\"} 0.006\n"));
  EXPECT_THAT(text, HasSubstr("triaxkv_worker_attention_seconds_count{"
                              "formats=\"bf16+int4\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("triaxkv_worker_attention_pages_total{format="
                              "\"bf16\"} 9\n"));
  EXPECT_THAT(text, HasSubstr("triaxkv_worker_attention_pages_total{format="
                              "\"int4\"} 6\n"));
  EXPECT_THAT(text, HasSubstr("triaxkv_worker_import_seconds_count{path="
                              "\"stream\",result=\"ok\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("triaxkv_worker_import_seconds_count{path="
                              "\"unknown\",result=\"error\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("triaxkv_worker_import_wire_bytes_total{path="
                              "\"stream\"} 1000\n"));
}

}  // namespace
}  // namespace triax::worker
