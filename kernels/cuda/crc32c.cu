// Crc32cKernel: each of the CTA's threads takes an equal, contiguous slice
// of the range (16-byte loads when the slice is aligned), computes the
// slice's CRC32C with a byte table in shared memory, and the slices are
// joined in a tree of log2(threads) levels: for CRCs of A and B,
// CRC(A || B) = CRC(A) * x^(8|B|) xor CRC(B) in GF(2)[x] mod P (the
// combination zlib's crc32_combine uses), which holds for the conditioned
// CRC (initial and final xor 0xFFFFFFFF). The shift operators x^(8|B|) are
// computed once per CTA, in parallel, before the tree.
#include <mutex>
#include <set>

#include "kernels/cuda/crc32c.h"

namespace triax::kernels::cuda {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli
constexpr int kThreads = 256;
constexpr int kLevels = 8;  // log2(kThreads): the combining tree's depth
static_assert((1 << kLevels) == kThreads, "one slice per thread");
static_assert(kThreads >= 32 + kLevels, "tails are computed by warp 1");

// a * b mod P, both in the reflected representation (bit 31 is x^0).
__host__ __device__ uint32_t MultModP(uint32_t a, uint32_t b) {
  uint32_t p = 0;
  for (int i = 0; i < 32; ++i) {
    if (a & (0x80000000u >> i)) p ^= b;
    b = (b & 1u) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

// g_x8_pow2[j] = x^(8 2^j) mod P, uploaded once per device (EnsurePowers).
__device__ uint32_t g_x8_pow2[64];

// x^(8 n) mod P: one multiplication per set bit of n.
__device__ uint32_t X8nModP(uint64_t n) {
  uint32_t p = 0x80000000u;  // x^0
  for (int j = 0; n != 0; ++j, n >>= 1) {
    if (n & 1u) p = MultModP(g_x8_pow2[j], p);
  }
  return p;
}

// Uploads g_x8_pow2 (computed on the host) once per current device.
LaunchResult EnsurePowers() {
  static std::mutex* mu = new std::mutex();
  static std::set<int>* done = new std::set<int>();
  LaunchResult r;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    r.kind = LaunchResult::Kind::kNoDevice;
    return r;
  }
  std::lock_guard<std::mutex> lock(*mu);
  if (done->count(dev) > 0) return r;
  uint32_t pow2[64];
  uint32_t sq = 1u << 23;  // x^8
  for (int j = 0; j < 64; ++j) {
    pow2[j] = sq;
    sq = MultModP(sq, sq);
  }
  // From pageable memory: the copy is complete when this returns, so every
  // later launch, on any stream, sees the table.
  const cudaError_t e = cudaMemcpyToSymbol(g_x8_pow2, pow2, sizeof(pow2));
  if (e != cudaSuccess) {
    r.kind = LaunchResult::Kind::kLaunch;
    r.error = e;
    r.what = "uploading the CRC32C shift table";
    return r;
  }
  done->insert(dev);
  return r;
}

__device__ uint32_t Update(const uint32_t* table, uint32_t c, uint32_t byte) {
  return table[(c ^ byte) & 0xFFu] ^ (c >> 8);
}

// One range: its CRC32C into *out (all of the CTA's threads take part).
__device__ void RangeCrc(const uint8_t* data, uint64_t bytes, uint32_t* out) {
  // Slicing-by-4 tables: table[0] is the byte table, table[k][n] the CRC
  // of byte n followed by k zero bytes, so a 4-byte word takes four
  // independent lookups instead of four dependent ones.
  __shared__ uint32_t table[4][256];
  __shared__ uint32_t slice_crc[kThreads];
  const int t = threadIdx.x;
  for (int i = t; i < 256; i += kThreads) {
    uint32_t c = static_cast<uint32_t>(i);
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ kPoly : c >> 1;
    table[0][i] = c;
  }
  __syncthreads();
  for (int i = t; i < 256; i += kThreads) {
    for (int k = 1; k < 4; ++k) {
      const uint32_t prev = k == 1 ? table[0][i] : table[k - 1][i];
      table[k][i] = (prev >> 8) ^ table[0][prev & 0xFFu];
    }
  }
  __syncthreads();
  // Slices of `len` bytes, a multiple of 16 so that aligned ranges load
  // 16 bytes at a time; the last slices may be shorter or empty.
  const uint64_t len = ((bytes + kThreads - 1) / kThreads + 15) / 16 * 16;
  const uint64_t begin = min(bytes, len * t);
  const uint64_t end = min(bytes, begin + len);
  uint32_t c = 0xFFFFFFFFu;
  const uint8_t* p = data + begin;
  uint64_t i = begin;
  if ((reinterpret_cast<uintptr_t>(p) & 15u) == 0) {
    for (; i + 16 <= end; i += 16, p += 16) {
      const uint4 w = *reinterpret_cast<const uint4*>(p);
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
      for (int k = 0; k < 4; ++k) {
        const uint32_t x = c ^ words[k];  // little-endian bytes
        c = table[3][x & 0xFFu] ^ table[2][(x >> 8) & 0xFFu] ^
            table[1][(x >> 16) & 0xFFu] ^ table[0][x >> 24];
      }
    }
  }
  for (; i < end; ++i, ++p) {
    c = Update(table[0], c, *p);
  }
  slice_crc[t] = begin < end ? ~c : 0u;  // CRC of an empty slice: 0
  // Shift operators, in parallel: ops[k] = x^(8 len 2^k) for a right-hand
  // subtree of 2^k full slices at level k; tail[k] for the one right-hand
  // subtree of level k that holds the range's last byte, when it is short.
  __shared__ uint32_t ops[kLevels];
  __shared__ uint32_t tail[kLevels];
  // (Operators in warp 0, tails in warp 1: the two do not diverge.)
  if (t < kLevels) {
    ops[t] = X8nModP(len << t);
  } else if (t >= 32 && t < 32 + kLevels && bytes > 0) {
    const int k = t - 32;
    const uint64_t last = (bytes - 1) / len;  // slice of the last byte
    const uint64_t right = ((last >> (k + 1)) << (k + 1)) + (uint64_t{1} << k);
    const uint64_t r = last >= right ? bytes - len * right : 0;
    tail[k] = (r > 0 && r < (len << k)) ? X8nModP(r) : 0u;
  }
  __syncthreads();
  // A tree over the slices: at level k, slice t (t a multiple of 2^(k+1))
  // absorbs the 2^k slices after it.
  for (int k = 0; k < kLevels; ++k) {
    const int span = 1 << k;
    if ((t & (2 * span - 1)) == 0) {
      const uint64_t rb = min(bytes, len * (t + span));
      const uint64_t re = min(bytes, len * (t + 2 * span));
      if (re > rb) {
        const uint32_t op = (re - rb == (len << k)) ? ops[k] : tail[k];
        slice_crc[t] = MultModP(op, slice_crc[t]) ^ slice_crc[t + span];
      }
    }
    __syncthreads();
  }
  if (t == 0) *out = slice_crc[0];
}

__global__ void Crc32cKernel(const ByteRange* ranges, uint32_t* out) {
  const ByteRange r = ranges[blockIdx.x];
  RangeCrc(r.data, r.bytes, out + blockIdx.x);
}

// The copy first, coalesced (thread t moves 16-byte words t, t + 256, ...;
// bytes where either end is unaligned), then the CRC32C of the bytes as
// they landed in dst: the checksum verifies what was installed, and the
// strided reads of the CRC mostly hit L2 right after the copy.
__global__ void CopyCrc32cKernel(const CopyRange* ranges, uint32_t* out) {
  const CopyRange r = ranges[blockIdx.x];
  const int t = threadIdx.x;
  const uintptr_t misaligned = (reinterpret_cast<uintptr_t>(r.src) |
                                reinterpret_cast<uintptr_t>(r.dst)) &
                               15u;
  uint64_t done = 0;
  if (misaligned == 0) {
    const uint64_t words = r.bytes / 16;
    const uint4* from = reinterpret_cast<const uint4*>(r.src);
    uint4* to = reinterpret_cast<uint4*>(r.dst);
    for (uint64_t i = t; i < words; i += kThreads) to[i] = from[i];
    done = words * 16;
  }
  for (uint64_t i = done + t; i < r.bytes; i += kThreads) r.dst[i] = r.src[i];
  __syncthreads();  // the CTA's writes are visible to all of its threads
  RangeCrc(r.dst, r.bytes, out + blockIdx.x);
}

}  // namespace

LaunchResult LaunchCrc32c(const ByteRange* ranges, int num_ranges,
                          uint32_t* out, cudaStream_t stream) {
  if (num_ranges <= 0) return LaunchResult{};
  if (LaunchResult r = EnsurePowers(); !r.ok()) return r;
  Crc32cKernel<<<num_ranges, kThreads, 0, stream>>>(ranges, out);
  return LastLaunch("Crc32cKernel");
}

LaunchResult LaunchCopyCrc32c(const CopyRange* ranges, int num_ranges,
                              uint32_t* out, cudaStream_t stream) {
  if (num_ranges <= 0) return LaunchResult{};
  if (LaunchResult r = EnsurePowers(); !r.ok()) return r;
  CopyCrc32cKernel<<<num_ranges, kThreads, 0, stream>>>(ranges, out);
  return LastLaunch("CopyCrc32cKernel");
}

}  // namespace triax::kernels::cuda
