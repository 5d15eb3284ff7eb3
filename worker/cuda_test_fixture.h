// What the CUDA device tests share (cuda_device_test, cuda_copy_test): a
// fixture that skips without a CUDA device and otherwise holds a CudaDevice
// with an 8 MiB arena (its health checked and the arena freed at the end),
// and byte helpers for comparing device memory with the host's.
#pragma once

#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "common/status_matchers.h"
#include "worker/cuda_device.h"

namespace triax::worker {

// `bytes` bytes of device memory at `dev`, copied to the host.
inline std::vector<uint8_t> Download(const uint8_t* dev, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  EXPECT_EQ(cudaMemcpy(out.data(), dev, bytes, cudaMemcpyDeviceToHost),
            cudaSuccess);
  return out;
}

// Bytes that differ between `a` and `b`, a length difference counting as
// that many.
inline size_t CountDiff(const std::vector<uint8_t>& a,
                        const std::vector<uint8_t>& b) {
  size_t n = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) n += a[i] != b[i];
  return n + (a.size() > b.size() ? a.size() - b.size() : b.size() - a.size());
}

class CudaArenaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (absl::Status s = CudaAvailable(); !s.ok()) {
      GTEST_SKIP() << s.message();
    }
    auto d = CudaDevice::Create(0);
    ASSERT_THAT(d.status(), triax::testing::IsOk());
    gpu_ = std::move(*d);
    auto arena = gpu_->AllocateArena(kArena);
    ASSERT_THAT(arena.status(), triax::testing::IsOk());
    gpu_arena_ = *arena;
  }
  void TearDown() override {
    if (gpu_ != nullptr) {
      EXPECT_THAT(gpu_->Health(), triax::testing::IsOk());
      gpu_->FreeArena(gpu_arena_, kArena);
    }
  }

  static constexpr size_t kArena = 8 << 20;
  std::unique_ptr<CudaDevice> gpu_;
  uint8_t* gpu_arena_ = nullptr;
};

}  // namespace triax::worker
