// Two kinds of kernels (crc32c.h, Crc32cKernel):
//
// Striped (the default): a warp per segment of at most kSegment bytes of a
// range (grid.y strides over a range's segments). Lane l takes the 16-byte
// chunks l, l + 32, l + 64, ... of its segment, so each load instruction of
// the warp reads one coalesced 512-byte row and a copy reads and writes
// every byte exactly once, checksumming it from registers. A lane's state
// is the raw CRC (initial value 0, no final xor) of its chunks with zeros
// in between: before each chunk after its first it is carried over the 496
// bytes of the other lanes' chunks (gap tables: the state is linear in its
// four bytes, so that is four lookups), then updated with the chunk's four
// words by slicing-by-4 tables. At the end each lane's state is carried to
// the end of the segment's whole chunks (x^(8 * 16 m) for the m chunks
// after its last), the 32 states xor together into the raw CRC of those
// chunks, and the range's last bytes % 16 bytes go to its last segment.
// The raw CRC is linear in the bytes, so the range's is the xor of its
// segments' raws each carried over the bytes after the segment
// (x^(8 n)), which every warp adds into out[i] with atomicXor (out is
// zeroed first); the first segment's warp also adds the conditioning,
// 0xFFFFFFFF * x^(8 bytes) ^ 0xFFFFFFFF (the initial value's contribution,
// then the final xor). Ranges that are not 16-byte aligned (at either end
// of a copy) load and store their chunks byte by byte, same arithmetic.
// One copy of the tables in shared memory: 8 interleaved copies (so that
// random bytes' lookups of a warp collide in fewer banks) measured slower
// on the H100 (page_copy_probe, 1 GiB in 64 KiB pages of random bytes:
// copy + CRC32C 0.754 of the device's copy with 8 copies, 0.873 with 4,
// 0.887 with 1; the tables cost occupancy, the collisions little).
//
// PerCta (the first version, kept for comparison in page_copy_probe): one
// CTA per range; each thread takes an equal, contiguous slice (16-byte
// loads when aligned), computes its CRC32C with slicing-by-4 tables built
// in shared memory, and the slices are joined in a tree of log2(threads)
// levels: CRC(A || B) = CRC(A) * x^(8|B|) xor CRC(B) in GF(2)[x] mod P (the
// combination zlib's crc32_combine uses). A copy copies coalesced first,
// then checksums the destination (re-read from L2 or memory).
#include <mutex>
#include <set>
#include <utility>

#include "kernels/cuda/crc32c.h"

namespace triax::kernels::cuda {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli

// Striped kernels.
constexpr int kWarp = 32;
constexpr int kChunk = 16;                     // bytes a lane takes at a time
constexpr int kGap = kWarp * kChunk - kChunk;  // between a lane's chunks
constexpr int kWarpsPerCta = 8;
constexpr int kStripedThreads = kWarp * kWarpsPerCta;
constexpr int kUnroll = 4;  // chunks a lane loads before checksumming them
// Bytes a warp takes of one range: large pages are split so that a batch of
// few of them still fills the GPU (a 64 MiB batch of 256 KiB pages is 256
// ranges: one warp each left most SMs idle, 0.112 of the device's copy).
constexpr uint64_t kSegment = 16 << 10;
constexpr uint64_t kMaxSegmentsPerLaunch = 65535;  // grid.y
static_assert(kSegment % kChunk == 0, "segments are whole chunks");

// PerCta kernels.
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

// Computed on the host once, uploaded once per device (EnsureTables).
struct Tables {
  // byte[k][n]: the CRC state update of byte n followed by k zero bytes
  // (slicing by 4), flat [k * 256 + n].
  uint32_t byte[4 * 256];
  // gap[k][n]: the state (n << 8k) carried over kGap zero bytes.
  uint32_t gap[4 * 256];
  // carry[m] = x^(8 * kChunk * m) mod P: a lane's state carried over the m
  // chunks after its last one.
  uint32_t carry[kWarp];
  // pow2[j] = x^(8 2^j) mod P.
  uint32_t pow2[64];
};
__device__ Tables g_tables;

// x^(8 n) mod P from pow2: one multiplication per set bit of n.
__host__ __device__ uint32_t X8nModP(const uint32_t* pow2, uint64_t n) {
  uint32_t p = 0x80000000u;  // x^0
  for (int j = 0; n != 0; ++j, n >>= 1) {
    if (n & 1u) p = MultModP(pow2[j], p);
  }
  return p;
}

Tables MakeTables() {
  Tables t;
  for (uint32_t n = 0; n < 256; ++n) {
    uint32_t c = n;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ kPoly : c >> 1;
    t.byte[n] = c;
  }
  for (int k = 1; k < 4; ++k) {
    for (uint32_t n = 0; n < 256; ++n) {
      const uint32_t prev = t.byte[(k - 1) * 256 + n];
      t.byte[k * 256 + n] = (prev >> 8) ^ t.byte[prev & 0xFFu];
    }
  }
  for (int k = 0; k < 4; ++k) {
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n << (8 * k);
      for (int z = 0; z < kGap; ++z) c = t.byte[c & 0xFFu] ^ (c >> 8);
      t.gap[k * 256 + n] = c;
    }
  }
  uint32_t sq = 1u << 23;  // x^8
  for (int j = 0; j < 64; ++j) {
    t.pow2[j] = sq;
    sq = MultModP(sq, sq);
  }
  for (int m = 0; m < kWarp; ++m) {
    t.carry[m] = X8nModP(t.pow2, uint64_t{kChunk} * m);
  }
  return t;
}

// Uploads g_tables once per current device.
LaunchResult EnsureTables() {
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
  static const Tables* host = new Tables(MakeTables());
  // From pageable memory: the copy is complete when this returns, so every
  // later launch, on any stream, sees the tables.
  const cudaError_t e = cudaMemcpyToSymbol(g_tables, host, sizeof(Tables));
  if (e != cudaSuccess) {
    r.kind = LaunchResult::Kind::kLaunch;
    r.error = e;
    r.what = "uploading the CRC32C tables";
    return r;
  }
  done->insert(dev);
  return r;
}

// ---------------------------------------------------------------------------
// Striped

struct StripedShared {
  uint32_t byte[4 * 256];
  uint32_t gap[4 * 256];
};

// The state after the four bytes of `w` (little-endian).
__device__ __forceinline__ uint32_t UpdateWord(const StripedShared& s,
                                               uint32_t c, uint32_t w) {
  const uint32_t x = c ^ w;
  return s.byte[3 * 256 + (x & 0xFFu)] ^ s.byte[2 * 256 + ((x >> 8) & 0xFFu)] ^
         s.byte[256 + ((x >> 16) & 0xFFu)] ^ s.byte[x >> 24];
}

// The state carried over kGap zero bytes.
__device__ __forceinline__ uint32_t CarryGap(const StripedShared& s,
                                             uint32_t c) {
  return s.gap[c & 0xFFu] ^ s.gap[256 + ((c >> 8) & 0xFFu)] ^
         s.gap[2 * 256 + ((c >> 16) & 0xFFu)] ^ s.gap[3 * 256 + (c >> 24)];
}

__device__ __forceinline__ uint32_t UpdateChunk(const StripedShared& s,
                                                uint32_t c, const uint4& v,
                                                bool first) {
  if (!first) c = CarryGap(s, c);
  c = UpdateWord(s, c, v.x);
  c = UpdateWord(s, c, v.y);
  c = UpdateWord(s, c, v.z);
  return UpdateWord(s, c, v.w);
}

__device__ __forceinline__ uint4 LoadBytes(const uint8_t* p) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = uint32_t{p[4 * i]} | uint32_t{p[4 * i + 1]} << 8 |
           uint32_t{p[4 * i + 2]} << 16 | uint32_t{p[4 * i + 3]} << 24;
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ void StoreBytes(uint8_t* p, const uint4& v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      p[4 * i + b] = static_cast<uint8_t>(w[i] >> (8 * b));
    }
  }
}

// The raw CRC of the `bytes` bytes at src (every lane returns it), copied
// to dst on the way when kCopy. `bytes` is a multiple of kChunk.
template <bool kCopy, bool kVector>
__device__ uint32_t StripedRaw(const StripedShared& s, const uint8_t* src,
                               uint8_t* dst, uint64_t bytes, int lane) {
  const uint64_t chunks = bytes / kChunk;
  uint32_t c = 0;
  for (uint64_t j = lane; j < chunks; j += kUnroll * kWarp) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t at = j + static_cast<uint64_t>(u) * kWarp;
      if (at < chunks) {
        if (kVector) {
          v[u] = reinterpret_cast<const uint4*>(src)[at];
          if (kCopy) reinterpret_cast<uint4*>(dst)[at] = v[u];
        } else {
          v[u] = LoadBytes(src + at * kChunk);
          if (kCopy) StoreBytes(dst + at * kChunk, v[u]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t at = j + static_cast<uint64_t>(u) * kWarp;
      if (at < chunks) {
        c = UpdateChunk(s, c, v[u], at == static_cast<uint64_t>(lane));
      }
    }
  }
  uint32_t raw =
      static_cast<uint64_t>(lane) < chunks
          ? MultModP(g_tables.carry[(chunks - 1 - lane) & (kWarp - 1)], c)
          : 0u;
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    raw ^= __shfl_xor_sync(0xFFFFFFFFu, raw, o);
  }
  return raw;
}

// Segment `seg` of a range by one warp: adds its share of the range's
// CRC32C into *out (see the top of the file).
template <bool kCopy, bool kVector>
__device__ void StripedSegment(const StripedShared& s, const uint8_t* src,
                               uint8_t* dst, uint64_t bytes, uint64_t seg,
                               int lane, uint32_t* out) {
  const uint64_t begin = seg * kSegment;
  const uint64_t whole = bytes / kChunk * kChunk;
  const uint64_t end = begin + kSegment < whole ? begin + kSegment : whole;
  uint32_t raw = begin < end
                     ? StripedRaw<kCopy, kVector>(s, src + begin,
                                                  kCopy ? dst + begin : nullptr,
                                                  end - begin, lane)
                     : 0u;
  if (lane != 0) return;
  uint64_t carried_end = end;
  if (begin + kSegment >= bytes) {  // the last segment takes the last bytes
    for (uint64_t i = whole; i < bytes; ++i) {
      const uint8_t b = src[i];
      if (kCopy) dst[i] = b;
      raw = s.byte[(raw ^ b) & 0xFFu] ^ (raw >> 8);
    }
    carried_end = bytes;
  }
  uint32_t share =
      bytes - carried_end == 0
          ? raw
          : MultModP(X8nModP(g_tables.pow2, bytes - carried_end), raw);
  if (seg == 0) {
    share ^= MultModP(X8nModP(g_tables.pow2, bytes), 0xFFFFFFFFu) ^ 0xFFFFFFFFu;
  }
  atomicXor(out, share);
}

__device__ void LoadStripedShared(StripedShared* s) {
  for (int i = threadIdx.x; i < 4 * 256; i += blockDim.x) {
    s->byte[i] = g_tables.byte[i];
    s->gap[i] = g_tables.gap[i];
  }
  __syncthreads();
}

// Warp w of CTA (x, y) takes range x * kWarpsPerCta + w, its segments y,
// y + gridDim.y, ...
__global__ void StripedCrc32cKernel(const ByteRange* ranges, int num_ranges,
                                    uint32_t* out) {
  __shared__ StripedShared s;
  LoadStripedShared(&s);
  const int lane = threadIdx.x % kWarp;
  const int i = blockIdx.x * kWarpsPerCta + threadIdx.x / kWarp;
  if (i >= num_ranges) return;
  const ByteRange r = ranges[i];
  const bool vec = (reinterpret_cast<uintptr_t>(r.data) & 15u) == 0;
  const uint64_t segs = r.bytes == 0 ? 0 : (r.bytes - 1) / kSegment + 1;
  for (uint64_t seg = blockIdx.y; seg < segs; seg += gridDim.y) {
    if (vec) {
      StripedSegment<false, true>(s, r.data, nullptr, r.bytes, seg, lane,
                                  out + i);
    } else {
      StripedSegment<false, false>(s, r.data, nullptr, r.bytes, seg, lane,
                                   out + i);
    }
  }
}

__global__ void StripedCopyCrc32cKernel(const CopyRange* ranges, int num_ranges,
                                        uint32_t* out) {
  __shared__ StripedShared s;
  LoadStripedShared(&s);
  const int lane = threadIdx.x % kWarp;
  const int i = blockIdx.x * kWarpsPerCta + threadIdx.x / kWarp;
  if (i >= num_ranges) return;
  const CopyRange r = ranges[i];
  const bool vec = ((reinterpret_cast<uintptr_t>(r.src) |
                     reinterpret_cast<uintptr_t>(r.dst)) &
                    15u) == 0;
  const uint64_t segs = r.bytes == 0 ? 0 : (r.bytes - 1) / kSegment + 1;
  for (uint64_t seg = blockIdx.y; seg < segs; seg += gridDim.y) {
    if (vec) {
      StripedSegment<true, true>(s, r.src, r.dst, r.bytes, seg, lane, out + i);
    } else {
      StripedSegment<true, false>(s, r.src, r.dst, r.bytes, seg, lane, out + i);
    }
  }
}

// out zeroed (the warps xor into it), then a grid of ceil(n / 8) x the
// segments of the largest range (at most kMaxSegmentsPerLaunch; warps loop
// over the rest).
dim3 StripedGrid(int num_ranges, uint64_t max_range_bytes) {
  uint64_t segs =
      max_range_bytes == 0 ? 1 : (max_range_bytes - 1) / kSegment + 1;
  if (segs > kMaxSegmentsPerLaunch) segs = kMaxSegmentsPerLaunch;
  return dim3((num_ranges + kWarpsPerCta - 1) / kWarpsPerCta,
              static_cast<unsigned>(segs));
}

// ---------------------------------------------------------------------------
// PerCta

__device__ uint32_t Update(const uint32_t* table, uint32_t c, uint32_t byte) {
  return table[(c ^ byte) & 0xFFu] ^ (c >> 8);
}

// One range: its CRC32C into *out (all of the CTA's threads take part).
__device__ void RangeCrc(const uint8_t* data, uint64_t bytes, uint32_t* out) {
  __shared__ uint32_t table[4][256];
  __shared__ uint32_t slice_crc[kThreads];
  const int t = threadIdx.x;
  for (int i = t; i < 4 * 256; i += kThreads) {
    table[i / 256][i % 256] = g_tables.byte[i];
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
    ops[t] = X8nModP(g_tables.pow2, len << t);
  } else if (t >= 32 && t < 32 + kLevels && bytes > 0) {
    const int k = t - 32;
    const uint64_t last = (bytes - 1) / len;  // slice of the last byte
    const uint64_t right = ((last >> (k + 1)) << (k + 1)) + (uint64_t{1} << k);
    const uint64_t r = last >= right ? bytes - len * right : 0;
    tail[k] = (r > 0 && r < (len << k)) ? X8nModP(g_tables.pow2, r) : 0u;
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

__global__ void PerCtaCrc32cKernel(const ByteRange* ranges, uint32_t* out) {
  const ByteRange r = ranges[blockIdx.x];
  RangeCrc(r.data, r.bytes, out + blockIdx.x);
}

// The copy first, coalesced (thread t moves 16-byte words t, t + 256, ...;
// bytes where either end is unaligned), then the CRC32C of the bytes as
// they landed in dst.
__global__ void PerCtaCopyCrc32cKernel(const CopyRange* ranges, uint32_t* out) {
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
                          uint32_t* out, cudaStream_t stream,
                          Crc32cKernel kernel, uint64_t max_range_bytes) {
  if (num_ranges <= 0) return LaunchResult{};
  if (LaunchResult r = EnsureTables(); !r.ok()) return r;
  if (kernel == Crc32cKernel::kPerCta) {
    PerCtaCrc32cKernel<<<num_ranges, kThreads, 0, stream>>>(ranges, out);
    return LastLaunch("PerCtaCrc32cKernel");
  }
  if (cudaError_t e =
          cudaMemsetAsync(out, 0, sizeof(uint32_t) * num_ranges, stream);
      e != cudaSuccess) {
    LaunchResult r;
    r.kind = LaunchResult::Kind::kLaunch;
    r.error = e;
    r.what = "zeroing the CRC32C outputs";
    return r;
  }
  StripedCrc32cKernel<<<StripedGrid(num_ranges, max_range_bytes),
                        kStripedThreads, 0, stream>>>(ranges, num_ranges, out);
  return LastLaunch("StripedCrc32cKernel");
}

LaunchResult LaunchCopyCrc32c(const CopyRange* ranges, int num_ranges,
                              uint32_t* out, cudaStream_t stream,
                              Crc32cKernel kernel, uint64_t max_range_bytes) {
  if (num_ranges <= 0) return LaunchResult{};
  if (LaunchResult r = EnsureTables(); !r.ok()) return r;
  if (kernel == Crc32cKernel::kPerCta) {
    PerCtaCopyCrc32cKernel<<<num_ranges, kThreads, 0, stream>>>(ranges, out);
    return LastLaunch("PerCtaCopyCrc32cKernel");
  }
  if (cudaError_t e =
          cudaMemsetAsync(out, 0, sizeof(uint32_t) * num_ranges, stream);
      e != cudaSuccess) {
    LaunchResult r;
    r.kind = LaunchResult::Kind::kLaunch;
    r.error = e;
    r.what = "zeroing the CRC32C outputs";
    return r;
  }
  StripedCopyCrc32cKernel<<<StripedGrid(num_ranges, max_range_bytes),
                            kStripedThreads, 0, stream>>>(ranges, num_ranges,
                                                          out);
  return LastLaunch("StripedCopyCrc32cKernel");
}

}  // namespace triax::kernels::cuda
