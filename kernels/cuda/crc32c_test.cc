// Crc32cCuda against a bitwise CRC32C on the host: known answers, every
// length around the slice boundaries, unaligned starts, many ranges in one
// launch, and bad arguments. Skips without a CUDA device.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/kv_cuda.cuh"

namespace triax::kernels::cuda {
namespace {

// The definition, one bit at a time (reflected 0x82F63B78, conditioned).
uint32_t HostCrc32c(const uint8_t* p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
  }
  return ~c;
}

class Crc32cCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
      GTEST_SKIP() << "no CUDA device (" << cudaGetErrorString(e) << ", count "
                   << n << ")";
    }
  }
  void TearDown() override {
    for (void* p : allocs_) cudaFree(p);
  }
  template <typename T>
  T* Upload(const std::vector<T>& v) {
    void* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, v.size() * sizeof(T) + 16), cudaSuccess);
    allocs_.push_back(d);
    EXPECT_EQ(
        cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice),
        cudaSuccess);
    return static_cast<T*>(d);
  }
  // CRCs of ranges [offset, offset + len) of `host` (uploaded once).
  std::vector<uint32_t> Run(const std::vector<uint8_t>& host,
                            const std::vector<std::pair<size_t, size_t>>& rs) {
    const uint8_t* base = Upload(host);
    std::vector<ByteRange> ranges;
    for (auto [off, len] : rs) ranges.push_back({base + off, len});
    const ByteRange* d_ranges = Upload(ranges);
    uint32_t* d_out = Upload(std::vector<uint32_t>(rs.size(), 0xDEADBEEFu));
    Crc32cParams p;
    p.ranges = d_ranges;
    p.num_ranges = static_cast<int>(rs.size());
    p.out = d_out;
    EXPECT_TRUE(Crc32cCuda(p).ok());
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint32_t> out(rs.size());
    EXPECT_EQ(
        cudaMemcpy(out.data(), d_out, out.size() * 4, cudaMemcpyDeviceToHost),
        cudaSuccess);
    return out;
  }
  std::vector<void*> allocs_;
};

TEST_F(Crc32cCudaTest, KnownAnswers) {
  const std::string s = "123456789";
  std::vector<uint8_t> host(s.begin(), s.end());
  host.resize(64, 0);
  const std::vector<uint32_t> out = Run(host, {{0, 9}, {0, 0}, {0, 32}});
  EXPECT_EQ(out[0], 0xE3069283u);
  EXPECT_EQ(out[1], 0u);
  EXPECT_EQ(out[2], HostCrc32c(host.data(), 32));
}

TEST_F(Crc32cCudaTest, EveryLengthAndOffsetAgreesWithTheHost) {
  std::mt19937 rng(7);
  std::vector<uint8_t> host(300000);
  for (uint8_t& b : host) b = static_cast<uint8_t>(rng());
  std::vector<std::pair<size_t, size_t>> rs;
  // Short lengths, lengths around 256 slices of 16 bytes, page sizes, and
  // starts that are not 16-byte aligned.
  for (size_t len = 0; len < 70; ++len) rs.push_back({len % 16, len});
  for (size_t len : {4095, 4096, 4097, 4111, 4112, 4113, 8191, 65536, 65537,
                     262143, 262144, 262145}) {
    for (size_t off : {0, 1, 3, 8, 15}) rs.push_back({off, len});
  }
  const std::vector<uint32_t> out = Run(host, rs);
  for (size_t i = 0; i < rs.size(); ++i) {
    EXPECT_EQ(out[i], HostCrc32c(host.data() + rs[i].first, rs[i].second))
        << "offset " << rs[i].first << " length " << rs[i].second;
  }
}

TEST_F(Crc32cCudaTest, OneFlippedBitChangesTheChecksum) {
  std::vector<uint8_t> host(262144, 0x5A);
  const uint32_t before = Run(host, {{0, host.size()}})[0];
  host[131071] ^= 0x10;
  EXPECT_NE(Run(host, {{0, host.size()}})[0], before);
}

TEST_F(Crc32cCudaTest, BadArguments) {
  Crc32cParams p;
  p.num_ranges = -1;
  EXPECT_THAT(Crc32cCuda(p).message(), ::testing::HasSubstr("num_ranges -1"));
  p.num_ranges = 2;
  EXPECT_THAT(Crc32cCuda(p).message(),
              ::testing::HasSubstr("ranges is null with num_ranges 2"));
  p.num_ranges = 0;
  EXPECT_TRUE(Crc32cCuda(p).ok());
}

}  // namespace
}  // namespace triax::kernels::cuda
