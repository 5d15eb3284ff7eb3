// TQ on the device: the codebook and sign tables, their upload, and the
// Walsh-Hadamard transforms (per warp, over shared memory) and row decode
// that the codecs and the attention kernels share. The transforms use the
// reference's butterfly order and rounding (kernels/tq_codebook.cc), so
// encode and decode match the CPU bit for bit.
//
// The tables are __device__ variables in an anonymous namespace: without
// relocatable device code every .cu file that includes this header has its
// own copy, so each has its own UploadTqTables / EnsureTqTables (also
// anonymous) for that copy, the per-device bookkeeping keyed by the upload
// function (tq_tables.cc); a launcher calls its own file's EnsureTqTables
// before any kernel that reads the tables.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/device_primitives.cuh"
#include "kernels/cuda/launch_result.h"
#include "kernels/cuda/tq_tables.h"
#include "kernels/layout.h"

namespace triax::kernels::cuda {
namespace {

// Codebooks and signs for D = 16 << i (i in 0..4), bits 2..4 (TqTables);
// this translation unit's copy, uploaded on first use per device by
// EnsureTqTables below.
__device__ float g_tq_cb[5][3][16];
__device__ float g_tq_sign[5][256];
static_assert(sizeof(g_tq_cb) == sizeof(TqTables::cb) &&
                  sizeof(g_tq_sign) == sizeof(TqTables::sign),
              "device tables match TqTables");

// Copies the host tables to this translation unit's g_tq_cb / g_tq_sign
// on the current device.
cudaError_t UploadTqTables() {
  const TqTables& t = HostTqTables();
  cudaError_t e = cudaMemcpyToSymbol(g_tq_cb, t.cb, sizeof(t.cb));
  if (e == cudaSuccess) {
    e = cudaMemcpyToSymbol(g_tq_sign, t.sign, sizeof(t.sign));
  }
  return e;
}

// Uploads this translation unit's tables once per device (later calls
// return OK at once). Every launcher of a kernel that reads them calls it
// first.
LaunchResult EnsureTqTables() {
  return EnsureTqTablesUploaded(&UploadTqTables);
}

__host__ __device__ __forceinline__ int Log2Dim(int d) {
  int l = 0;
  while ((16 << l) < d) ++l;
  return l;
}
__device__ __forceinline__ const float* TqLevels(FormatCode f, int D) {
  return g_tq_cb[Log2Dim(D)][FormatBits(f) - 2];
}
__device__ __forceinline__ const float* TqSignsDev(int D) {
  return g_tq_sign[Log2Dim(D)];
}

// In-place FWHT of one vector of D (power of two, 16..256) floats spread
// over a warp: lane holds dims lane * E + i, E = max(1, D / 32), in x[0..E).
// Butterflies in the same stage order and with the same operations as
// kernels/tq_codebook.cc (a + b low, a - b high), so results match bit for
// bit.
__device__ __forceinline__ void WarpFwht(float (&x)[8], int D, int lane) {
  const int E = D >= 32 ? D / 32 : 1;
#pragma unroll
  for (int lg = 0; lg < 3; ++lg) {
    const int len = 1 << lg;
    if (len < E) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if ((i & len) == 0 && i + len < 8 && i + len < E) {
          const float a = x[i], b = x[i + len];
          x[i] = __fadd_rn(a, b);
          x[i + len] = __fsub_rn(a, b);
        }
      }
    }
  }
  for (int len = E; len < D; len <<= 1) {
    const int m = len / E;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float p = __shfl_xor_sync(0xffffffffu, x[i], m);
      x[i] = (lane & m) ? __fsub_rn(p, x[i]) : __fadd_rn(x[i], p);
    }
  }
}

// Code of dim d in a TQ row (little-endian bit stream).
__device__ __forceinline__ uint32_t TqCode(const uint8_t* row, int row_bytes,
                                           int d, int bits) {
  const int bit = d * bits;
  uint32_t w = row[bit / 8];
  if (bit / 8 + 1 < row_bytes)
    w |= static_cast<uint32_t>(row[bit / 8 + 1]) << 8;
  return (w >> (bit % 8)) & ((1u << bits) - 1u);
}

// Row (h, t) of a TQ tensor decoded to the original domain, dims
// lane * E + i in x (as DecodePage: norm * level, then R^T).
__device__ __forceinline__ void TqDecodeRowWarp(
    FormatCode f, const TensorLayout& L, const uint8_t* page,
    const PageShape& s, int h, int t, int lane, float (&x)[8]) {
  const int T = s.tokens, D = s.head_dim, bits = FormatBits(f);
  const int E = D >= 32 ? D / 32 : 1;
  const int row_bytes = D * bits / 8;
  const float* cb = TqLevels(f, D);
  const float* sg = TqSignsDev(D);
  const size_t row = static_cast<size_t>(h) * T + t;
  const float norm = HalfBits(LoadU16(page + L.scale + 2 * row));
  const uint8_t* codes = page + L.codes + row * row_bytes;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int d = lane * E + i;
    x[i] = (i < E && d < D)
               ? __fmul_rn(norm, cb[TqCode(codes, row_bytes, d, bits)])
               : 0.f;
  }
  WarpFwht(x, D, lane);
  const float nrm = __fdiv_rn(1.f, __fsqrt_rn(static_cast<float>(D)));
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int d = lane * E + i;
    if (i < E && d < D) x[i] = __fmul_rn(x[i], __fmul_rn(nrm, sg[d]));
  }
}

// In-place FWHT over the rows of a float [rows][kD] array in shared memory
// by `nthreads` threads starting at thread index `tid`, synchronized by
// `sync` after each stage.
template <int kD, typename Sync>
__device__ __forceinline__ void SmemFwht(float* x, int rows, int tid,
                                         int nthreads, Sync sync) {
  for (int len = 1; len < kD; len <<= 1) {
    for (int i = tid; i < rows * kD / 2; i += nthreads) {
      const int r = i / (kD / 2), j = i % (kD / 2);
      const int lo = (j / len) * 2 * len + j % len;
      float* row = x + r * kD;
      const float a = row[lo], b = row[lo + len];
      row[lo] = a + b;
      row[lo + len] = a - b;
    }
    sync();
  }
}

}  // namespace
}  // namespace triax::kernels::cuda
