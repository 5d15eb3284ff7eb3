// Backend choice (CreateDevice / CudaAvailable) in whichever build this is,
// and the store refusing encodings and shapes its backend does not support
// before it reserves anything; the CPU backend's batched token writes.
// Runs everywhere (no GPU needed).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "kernels/layout.h"
#include "worker/device.h"
#include "worker/page_allocator.h"
#include "worker/sequence_store.h"

namespace triax::worker {
namespace {

using kernels::Encoding;
using kernels::Format;
using kernels::PageShape;
using ::testing::AllOf;
using ::testing::HasSubstr;
using triax::testing::IsOk;
using triax::testing::StatusIs;

TEST(CreateDeviceTest, CpuIsAlwaysThere) {
  auto cpu = CreateDevice("cpu");
  ASSERT_THAT(cpu.status(), IsOk());
  EXPECT_STREQ((*cpu)->Name(), "cpu");
  EXPECT_THAT((*cpu)->Health(), IsOk());
  // The CPU reference runs every valid encoding, TQ included.
  EXPECT_THAT((*cpu)->SupportsEncoding(Format::kTQ4, PageShape{16, 2, 64}),
              IsOk());
  EXPECT_THAT((*cpu)->SupportsAttention(PageShape{16, 1, 512}, 64), IsOk());
}

// The default WriteBf16TokensBatch (the CPU backend's) writes as the
// writes one by one would, and checks every write before writing any:
// a bad one fails the batch naming writes[i] and leaves the pages as they
// were.
TEST(CpuDeviceTest, WriteBf16TokensBatchChecksFirstThenWritesEach) {
  CpuDevice cpu;
  const PageShape shape{4, 2, 8};
  const size_t bytes = kernels::PageBytes(Format::kBF16, shape);
  std::vector<uint8_t> batched(2 * bytes, 0), single(2 * bytes, 0);
  std::vector<uint16_t> k(3 * 2 * 8), v(3 * 2 * 8);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<uint16_t>(0x3f80 + i);
    v[i] = static_cast<uint16_t>(0xbf80 + i);
  }
  const std::vector<TokenWrite> writes = {
      {k.data(), v.data(), 1, 3, batched.data()},
      {k.data(), v.data(), 0, 1, batched.data() + bytes}};
  ASSERT_THAT(cpu.WriteBf16TokensBatch(shape, writes), IsOk());
  ASSERT_THAT(
      cpu.WriteBf16Tokens(shape, k.data(), v.data(), 1, 3, single.data()),
      IsOk());
  ASSERT_THAT(cpu.WriteBf16Tokens(shape, k.data(), v.data(), 0, 1,
                                  single.data() + bytes),
              IsOk());
  EXPECT_EQ(batched, single);
  EXPECT_NE(batched, std::vector<uint8_t>(2 * bytes, 0));

  std::vector<uint8_t> pages(2 * bytes, 0);
  std::vector<TokenWrite> bad = {{k.data(), v.data(), 0, 1, pages.data()},
                                 {k.data(), v.data(), 3, 2, pages.data()}};
  EXPECT_THAT(cpu.WriteBf16TokensBatch(shape, bad),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("writes[1]: slots [3, 5)")));
  bad[1] = {k.data(), nullptr, 0, 1, pages.data()};
  EXPECT_THAT(cpu.WriteBf16TokensBatch(shape, bad),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("writes[1]: page, k_bf16 and v_bf16")));
  bad[1] = {k.data(), v.data(), 1, 0, pages.data()};
  EXPECT_THAT(cpu.WriteBf16TokensBatch(shape, bad),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("writes[1]: slots [1, 1)")));
  EXPECT_EQ(pages, std::vector<uint8_t>(2 * bytes, 0));
}

TEST(CreateDeviceTest, UnknownBackendNamesTheValue) {
  EXPECT_THAT(CreateDevice("tpu").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("backend=\"tpu\""),
                             HasSubstr("auto, cpu, cuda"))));
  EXPECT_THAT(CreateDevice("").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
}

// What CudaAvailable says depends on the build (TRIAX_TEST_CUDA_BUILD, set
// by worker/CMakeLists.txt) and on the machine; "cuda" and "auto" follow it.
TEST(CreateDeviceTest, CudaAndAutoFollowAvailability) {
  const absl::Status avail = CudaAvailable();
  if (!TRIAX_TEST_CUDA_BUILD) {
    EXPECT_THAT(avail, StatusIs(absl::StatusCode::kFailedPrecondition,
                                HasSubstr("built without CUDA")));
  } else if (!avail.ok()) {
    EXPECT_THAT(avail, StatusIs(absl::StatusCode::kFailedPrecondition,
                                HasSubstr("no CUDA device")));
  }
  auto cuda = CreateDevice("cuda");
  auto automatic = CreateDevice("auto");
  ASSERT_THAT(automatic.status(), IsOk());
  if (avail.ok()) {
    ASSERT_THAT(cuda.status(), IsOk());
    EXPECT_STREQ((*cuda)->Name(), "cuda");
    EXPECT_STREQ((*automatic)->Name(), "cuda");
    DeviceOptions bad;
    bad.cuda_device = 1 << 20;
    EXPECT_THAT(CreateDevice("cuda", bad).status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("cuda_device=1048576")));
  } else {
    EXPECT_THAT(cuda.status(),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         AllOf(HasSubstr("backend=\"cuda\""),
                               HasSubstr(std::string(avail.message())))));
    EXPECT_STREQ((*automatic)->Name(), "cpu");
    EXPECT_THAT(CreateCudaDevice(0).status(),
                StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  }
}

// A CPU device that, like the CUDA backend, refuses TQ formats and query
// groups with group * head_dim > 128.
class PickyDevice final : public Device {
 public:
  const char* Name() const override { return "picky"; }
  absl::Status SupportsEncoding(const Encoding& e,
                                const PageShape& shape) const override {
    if (kernels::IsTqFormat(e.k) || kernels::IsTqFormat(e.v)) {
      return absl::InvalidArgumentError("tq is not supported here");
    }
    return absl::OkStatus();
  }
  absl::Status SupportsAttention(const PageShape& shape,
                                 int n_q_heads) const override {
    if (n_q_heads / shape.heads * shape.head_dim > 128) {
      return absl::InvalidArgumentError("query group too wide");
    }
    return absl::OkStatus();
  }
  absl::StatusOr<uint8_t*> AllocateArena(size_t bytes) override {
    return cpu_.AllocateArena(bytes);
  }
  void FreeArena(uint8_t* base, size_t bytes) override {
    cpu_.FreeArena(base, bytes);
  }
  absl::Status EncodePage(const Encoding& e, const PageShape& shape,
                          const uint16_t* k, const uint16_t* v, int n,
                          uint8_t* page) override {
    return cpu_.EncodePage(e, shape, k, v, n, page);
  }
  absl::Status DecodePage(const Encoding& e, const PageShape& shape,
                          const uint8_t* page, int n, float* k,
                          float* v) override {
    return cpu_.DecodePage(e, shape, page, n, k, v);
  }
  absl::Status WriteBf16Tokens(const PageShape& shape, const uint16_t* k,
                               const uint16_t* v, int first, int n,
                               uint8_t* page) override {
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
    return cpu_.CopyToHost(dst, src, bytes);
  }
  absl::Status CopyFromHost(uint8_t* dst, const void* src,
                            size_t bytes) override {
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

class UnsupportedPlanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto a = PageAllocator::Create(&device_, 16 << 20);
    ASSERT_THAT(a.status(), IsOk());
    alloc_ = std::move(*a);
    store_ = std::make_unique<SequenceStore>(&device_, alloc_.get());
  }

  static ModelShape Model(uint32_t q_heads) {
    ModelShape m;
    m.name = "m";
    m.n_layers = 2;
    m.n_kv_heads = 2;
    m.n_q_heads = q_heads;
    m.head_dim = 32;
    return m;
  }
  static std::vector<BlockSpec> Plan(Format second) {
    std::vector<BlockSpec> plan(2);
    for (uint32_t i = 0; i < 2; ++i) {
      plan[i].index = i;
      plan[i].lineage_id = 7 + i;
      plan[i].first_token = uint64_t{16} * i;
      plan[i].num_tokens = 16;
      plan[i].encoding = i == 0 ? Format::kINT4 : second;
    }
    return plan;
  }

  PickyDevice device_;
  std::unique_ptr<PageAllocator> alloc_;
  std::unique_ptr<SequenceStore> store_;
};

TEST_F(UnsupportedPlanTest, AllocateRefusesBeforeReserving) {
  EXPECT_THAT(store_->AllocatePages("t", "s", Model(4), 16, Plan(Format::kTQ4)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("blocks[1]"), HasSubstr("tq4"),
                             HasSubstr("not supported by the picky backend"),
                             HasSubstr("tq is not supported here"))));
  EXPECT_EQ(store_->Inventory().used_bytes, 0u);
  EXPECT_THAT(store_->Describe("s").status(),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));

  EXPECT_THAT(
      store_->AllocatePages("t", "s", Model(16), 16, Plan(Format::kINT2)),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("n_q_heads=16"), HasSubstr("picky backend"),
                     HasSubstr("query group too wide"))));
  EXPECT_EQ(store_->Inventory().used_bytes, 0u);

  EXPECT_THAT(store_->AllocatePages("t", "s", Model(4), 16, Plan(Format::kINT2))
                  .status(),
              IsOk());
}

TEST_F(UnsupportedPlanTest, DemoteAndForkRefuseToo) {
  ASSERT_THAT(store_->AllocatePages("t", "s", Model(4), 16, Plan(Format::kINT2))
                  .status(),
              IsOk());
  const uint64_t used = store_->Inventory().used_bytes;
  BlockSpec to_tq;
  to_tq.index = 0;
  to_tq.lineage_id = 7;
  to_tq.encoding = Encoding(Format::kINT8, Format::kTQ2);
  EXPECT_THAT(store_->Demote("t", "s", {to_tq}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("not supported by the picky backend")));
  EXPECT_EQ(store_->Describe("s")->blocks[0].encoding.k, Format::kINT4);
  EXPECT_EQ(store_->Inventory().used_bytes, used);

  std::vector<BlockSpec> child = Plan(Format::kTQ3);
  child[1].lineage_id = 99;
  EXPECT_THAT(store_->Fork("t", "s", "c", 32, child),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("not supported by the picky backend")));
  EXPECT_THAT(store_->Describe("c").status(),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

}  // namespace
}  // namespace triax::worker
