// Crc32cCuda against a bitwise CRC32C on the host: known answers, every
// length around the slice boundaries, unaligned starts, many ranges in one
// launch, and bad arguments. Skips without a CUDA device.
#include <cuda_runtime_api.h>

#include <algorithm>
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

// The kernels, and for the striped one the bound on the ranges' bytes it
// is given: none (one warp per range), a bound (several warps per large
// range), and one smaller than some ranges (warps loop over the rest).
struct Config {
  Crc32cKernel kernel;
  uint64_t max_range_bytes;
  const char* name;
};
constexpr Config kKernels[] = {
    {Crc32cKernel::kStriped, 0, "striped, no bound"},
    {Crc32cKernel::kStriped, 1 << 20, "striped, 1 MiB bound"},
    {Crc32cKernel::kStriped, 20000, "striped, a bound below some ranges"},
    {Crc32cKernel::kPerCta, 0, "one CTA per range"}};

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
                            const std::vector<std::pair<size_t, size_t>>& rs,
                            const Config& config = kKernels[0]) {
    const uint8_t* base = Upload(host);
    std::vector<ByteRange> ranges;
    for (auto [off, len] : rs) ranges.push_back({base + off, len});
    const ByteRange* d_ranges = Upload(ranges);
    uint32_t* d_out = Upload(std::vector<uint32_t>(rs.size(), 0xDEADBEEFu));
    Crc32cParams p;
    p.ranges = d_ranges;
    p.num_ranges = static_cast<int>(rs.size());
    p.out = d_out;
    p.kernel = config.kernel;
    p.max_range_bytes = config.max_range_bytes;
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
  // Short lengths, lengths around 256 slices of 16 bytes and the striped
  // kernel's 16 KiB segments, page sizes, and starts that are not 16-byte
  // aligned.
  for (size_t len = 0; len < 70; ++len) rs.push_back({len % 16, len});
  for (size_t len :
       {4095, 4096, 4097, 4111, 4112, 4113, 8191, 16383, 16384, 16385, 16389,
        32773, 65536, 65537, 262143, 262144, 262145}) {
    for (size_t off : {0, 1, 3, 8, 15}) rs.push_back({off, len});
  }
  // Many small ranges too: more than a resident grid's warps take at once.
  std::mt19937 pick(3);
  for (int i = 0; i < 20000; ++i) rs.push_back({pick() % 1000, pick() % 700});
  for (const Config& config : kKernels) {
    SCOPED_TRACE(config.name);
    const std::vector<uint32_t> out = Run(host, rs, config);
    for (size_t i = 0; i < rs.size(); ++i) {
      ASSERT_EQ(out[i], HostCrc32c(host.data() + rs[i].first, rs[i].second))
          << "offset " << rs[i].first << " length " << rs[i].second;
    }
  }
}

TEST_F(Crc32cCudaTest, OneFlippedBitChangesTheChecksum) {
  std::vector<uint8_t> host(262144, 0x5A);
  for (const Config& config : kKernels) {
    SCOPED_TRACE(config.name);
    std::vector<uint8_t> flipped = host;
    const uint32_t before = Run(host, {{0, host.size()}}, config)[0];
    EXPECT_EQ(before, HostCrc32c(host.data(), host.size()));
    flipped[131071] ^= 0x10;
    EXPECT_NE(Run(flipped, {{0, flipped.size()}}, config)[0], before);
  }
}

// CopyCrc32cCuda copies every byte (aligned and unaligned ends, dst offset
// differing from src's) and returns the same CRCs as Crc32cCuda; the bytes
// around each destination stay untouched.
TEST_F(Crc32cCudaTest, CopyCopiesExactlyAndChecksumsTheCopy) {
  std::mt19937 rng(11);
  std::vector<uint8_t> host(1 << 20);
  for (uint8_t& b : host) b = static_cast<uint8_t>(rng());
  const uint8_t* src = Upload(host);
  struct Job {
    size_t src_off, dst_off, len;
  };
  std::vector<Job> jobs;
  size_t at = 0;
  for (size_t len : {0, 1, 15, 16, 17, 4096, 4111, 65536, 65537, 131072}) {
    for (auto [so, dof] :
         std::vector<std::pair<size_t, size_t>>{{0, 0}, {3, 3}, {1, 8}}) {
      jobs.push_back({so, at + dof, len});
      at += len + 64;  // gaps between destinations
    }
  }
  ASSERT_LE(at, host.size());
  for (const Config& config : kKernels) {
    SCOPED_TRACE(config.name);
    uint8_t* dst = Upload(std::vector<uint8_t>(host.size(), 0xEE));
    std::vector<CopyRange> ranges;
    for (const Job& j : jobs) {
      CopyRange r;
      r.src = src + j.src_off;
      r.dst = dst + j.dst_off;
      r.bytes = j.len;
      ranges.push_back(r);
    }
    CopyCrc32cParams p;
    p.ranges = Upload(ranges);
    p.num_ranges = static_cast<int>(ranges.size());
    p.out = Upload(std::vector<uint32_t>(ranges.size(), 0xDEADBEEFu));
    p.kernel = config.kernel;
    p.max_range_bytes = config.max_range_bytes;
    ASSERT_TRUE(CopyCrc32cCuda(p).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint32_t> out(ranges.size());
    ASSERT_EQ(
        cudaMemcpy(out.data(), p.out, out.size() * 4, cudaMemcpyDeviceToHost),
        cudaSuccess);
    std::vector<uint8_t> copied(host.size());
    ASSERT_EQ(
        cudaMemcpy(copied.data(), dst, copied.size(), cudaMemcpyDeviceToHost),
        cudaSuccess);
    std::vector<uint8_t> want(host.size(), 0xEE);
    for (size_t i = 0; i < jobs.size(); ++i) {
      const Job& j = jobs[i];
      std::copy(host.begin() + j.src_off, host.begin() + j.src_off + j.len,
                want.begin() + j.dst_off);
      EXPECT_EQ(out[i], HostCrc32c(host.data() + j.src_off, j.len))
          << "job " << i << " length " << j.len;
    }
    EXPECT_TRUE(copied == want);
  }
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
  CopyCrc32cParams c;
  c.num_ranges = 1;
  EXPECT_THAT(CopyCrc32cCuda(c).message(),
              ::testing::HasSubstr("ranges is null with num_ranges 1"));
}

}  // namespace
}  // namespace triax::kernels::cuda
