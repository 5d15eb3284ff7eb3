// Crc32cKernel: each of the CTA's threads takes an equal, contiguous slice
// of the range (16-byte loads when the slice is aligned), computes the
// slice's CRC32C with a byte table in shared memory, and thread 0 joins the
// slices in order: for CRCs of A and B, CRC(A || B) = CRC(A) * x^(8|B|)
// xor CRC(B) in GF(2)[x] mod P (the combination zlib's crc32_combine uses),
// which holds for the conditioned CRC (initial and final xor 0xFFFFFFFF).
#include "kernels/cuda/crc32c.h"

namespace triax::kernels::cuda {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli
constexpr int kThreads = 256;

// a * b mod P, both in the reflected representation (bit 31 is x^0).
__device__ uint32_t MultModP(uint32_t a, uint32_t b) {
  uint32_t p = 0;
  for (int i = 0; i < 32; ++i) {
    if (a & (0x80000000u >> i)) p ^= b;
    b = (b & 1u) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

// x^(8 n) mod P.
__device__ uint32_t X8nModP(uint64_t n) {
  uint32_t p = 0x80000000u;  // x^0
  uint32_t sq = 1u << 23;    // x^8
  while (n != 0) {
    if (n & 1u) p = MultModP(sq, p);
    n >>= 1;
    if (n != 0) sq = MultModP(sq, sq);
  }
  return p;
}

__device__ uint32_t Update(const uint32_t* table, uint32_t c, uint32_t byte) {
  return table[(c ^ byte) & 0xFFu] ^ (c >> 8);
}

// One range: its CRC32C into *out; with kCopy the bytes are also stored at
// dst (same offsets) as they are read.
template <bool kCopy>
__device__ void RangeCrc(const uint8_t* data, uint8_t* dst, uint64_t bytes,
                         uint32_t* out) {
  __shared__ uint32_t table[256];
  __shared__ uint32_t slice_crc[kThreads];
  const int t = threadIdx.x;
  for (int i = t; i < 256; i += kThreads) {
    uint32_t c = static_cast<uint32_t>(i);
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ kPoly : c >> 1;
    table[i] = c;
  }
  __syncthreads();
  // Slices of `len` bytes, a multiple of 16 so that aligned ranges load
  // 16 bytes at a time; the last slices may be shorter or empty.
  const uint64_t len = ((bytes + kThreads - 1) / kThreads + 15) / 16 * 16;
  const uint64_t begin = min(bytes, len * t);
  const uint64_t end = min(bytes, begin + len);
  uint32_t c = 0xFFFFFFFFu;
  const uint8_t* p = data + begin;
  uint8_t* q = kCopy ? dst + begin : nullptr;
  uint64_t i = begin;
  const uintptr_t misaligned =
      (reinterpret_cast<uintptr_t>(p) | reinterpret_cast<uintptr_t>(q)) & 15u;
  if (misaligned == 0) {
    for (; i + 16 <= end; i += 16, p += 16) {
      const uint4 w = *reinterpret_cast<const uint4*>(p);
      if (kCopy) {
        *reinterpret_cast<uint4*>(q) = w;
        q += 16;
      }
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
      for (int k = 0; k < 4; ++k) {
        c = Update(table, c, words[k] & 0xFFu);  // little-endian bytes
        c = Update(table, c, (words[k] >> 8) & 0xFFu);
        c = Update(table, c, (words[k] >> 16) & 0xFFu);
        c = Update(table, c, words[k] >> 24);
      }
    }
  }
  for (; i < end; ++i, ++p) {
    if (kCopy) *q++ = *p;
    c = Update(table, c, *p);
  }
  slice_crc[t] = begin < end ? ~c : 0u;  // CRC of an empty slice: 0
  __syncthreads();
  if (t == 0) {
    const uint32_t full = X8nModP(len);
    uint32_t acc = 0;
    for (int s = 0; s < kThreads; ++s) {
      const uint64_t b = min(bytes, len * s);
      const uint64_t e = min(bytes, b + len);
      if (b == e) break;  // the rest are empty
      const uint32_t op = (e - b == len) ? full : X8nModP(e - b);
      acc = MultModP(op, acc) ^ slice_crc[s];
    }
    *out = acc;
  }
}

__global__ void Crc32cKernel(const ByteRange* ranges, uint32_t* out) {
  const ByteRange r = ranges[blockIdx.x];
  RangeCrc<false>(r.data, nullptr, r.bytes, out + blockIdx.x);
}

__global__ void CopyCrc32cKernel(const CopyRange* ranges, uint32_t* out) {
  const CopyRange r = ranges[blockIdx.x];
  RangeCrc<true>(r.src, r.dst, r.bytes, out + blockIdx.x);
}

}  // namespace

LaunchResult LaunchCrc32c(const ByteRange* ranges, int num_ranges,
                          uint32_t* out, cudaStream_t stream) {
  if (num_ranges <= 0) return LaunchResult{};
  Crc32cKernel<<<num_ranges, kThreads, 0, stream>>>(ranges, out);
  return LastLaunch("Crc32cKernel");
}

LaunchResult LaunchCopyCrc32c(const CopyRange* ranges, int num_ranges,
                              uint32_t* out, cudaStream_t stream) {
  if (num_ranges <= 0) return LaunchResult{};
  CopyCrc32cKernel<<<num_ranges, kThreads, 0, stream>>>(ranges, out);
  return LastLaunch("CopyCrc32cKernel");
}

}  // namespace triax::kernels::cuda
