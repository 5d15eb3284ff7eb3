// CudaDevice's checked copies in a pipeline (Device::NewCheckedCopies, the
// ipc import's copies): batches started two deep on the device's stream,
// their CRC32Cs against the CPU's of the same bytes, every copied byte
// compared, a third batch in flight refused, and a copier dropped with a
// batch in flight. Skips without a CUDA device.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "common/status_matchers.h"
#include "worker/checksum.h"
#include "worker/cuda_device.h"
#include "worker/cuda_test_fixture.h"
#include "worker/device.h"

namespace triax::worker {
namespace {

using ::testing::HasSubstr;
using triax::testing::IsOk;
using triax::testing::StatusIs;

using CudaCopyTest = CudaArenaTest;

// The pipeline of checked copies: two batches in flight on the pipeline's
// stream, each finished in order with the CRC32Cs CopyPagesChecked gives
// (the CPU's Crc32c of the bytes), a third refused until one finishes, a
// pipeline dropped with a batch in flight waits for it, and its stream is
// reused by the next pipeline.
TEST_F(CudaCopyTest, CheckedCopiesPipelineMatchesCopyPagesChecked) {
  std::mt19937 rng(41);
  std::vector<uint8_t> bytes(3 << 20);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  ASSERT_EQ(cudaMemcpy(gpu_arena_, bytes.data(), bytes.size(),
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  uint8_t* dst = gpu_arena_ + (4 << 20);
  // Batch b: pages of 4 KiB .. 64 KiB from the source's first 3 MiB.
  auto batch = [&](int b) {
    std::vector<PageCopy> jobs;
    size_t at = 0;
    for (int i = 0; i < 20 + 7 * b; ++i) {
      const size_t n = size_t{4096} << (i % 5);
      const size_t from =
          (static_cast<size_t>(b) * 131072 + at) % (bytes.size() - n);
      jobs.push_back(PageCopy{dst + (static_cast<size_t>(b) << 20) + at,
                              gpu_arena_ + from, n});
      at += n;
      if (at > (1 << 20) - (64 << 10)) break;
    }
    return jobs;
  };
  auto want = [&](const std::vector<PageCopy>& jobs) {
    std::vector<uint32_t> crcs;
    crcs.reserve(jobs.size());
    for (const PageCopy& j : jobs) {
      crcs.push_back(Crc32c(bytes.data() + (j.src - gpu_arena_), j.bytes));
    }
    return crcs;
  };
  for (int round = 0; round < 2; ++round) {
    auto copies = gpu_->NewCheckedCopies();
    ASSERT_THAT(copies.status(), IsOk());
    CheckedCopies& c = **copies;
    const std::vector<PageCopy> b0 = batch(0), b1 = batch(1), b2 = batch(2);
    ASSERT_THAT(c.Start(b0), IsOk());
    ASSERT_THAT(c.Start(b1), IsOk());
    EXPECT_EQ(c.in_flight(), 2u);
    EXPECT_THAT(c.Start(b2), StatusIs(absl::StatusCode::kFailedPrecondition,
                                      HasSubstr("in flight")));
    std::vector<uint32_t> got(b0.size());
    ASSERT_THAT(c.Finish(absl::MakeSpan(got)), IsOk());
    EXPECT_EQ(got, want(b0));
    ASSERT_THAT(c.Start(b2), IsOk());
    got.assign(b1.size(), 0);
    ASSERT_THAT(c.Finish(absl::MakeSpan(got)), IsOk());
    EXPECT_EQ(got, want(b1));
    got.assign(b2.size(), 0);
    ASSERT_THAT(c.Finish(absl::MakeSpan(got)), IsOk());
    EXPECT_EQ(got, want(b2));
    EXPECT_THAT(c.Finish(absl::MakeSpan(got)),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("in flight")));
    for (const std::vector<PageCopy>* jobs : {&b0, &b1, &b2}) {
      for (const PageCopy& j : *jobs) {
        ASSERT_EQ(CountDiff(Download(j.dst, j.bytes),
                            std::vector<uint8_t>(
                                bytes.data() + (j.src - gpu_arena_),
                                bytes.data() + (j.src - gpu_arena_) + j.bytes)),
                  0u);
      }
    }
    // Dropped with a batch in flight: the destructor waits for it.
    ASSERT_THAT(c.Start(b0), IsOk());
  }
}

}  // namespace
}  // namespace triax::worker
