// Device primitives shared by the kernels: bit casts and unaligned-width
// loads, warp reductions, exp2 on the SFU, cp.async / cp.async.bulk (TMA) /
// mbarrier wrappers, ldmatrix / mma.sync / movmatrix wrappers, fp16/bf16
// packing and LOP3. Inline PTX for sm_90 (mbarrier, cp.async.bulk,
// movmatrix need sm_90; the rest sm_80).
//
// Conventions: shared-memory addresses are 32-bit (SmemAddr); mma wrappers
// accumulate in place (d += a b) on m16n8k16 fragments in the PTX ISA's
// register order; every function is __forceinline__ (the kernels' code is
// generated as one body).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>

namespace triax::kernels::cuda {
namespace {

// ---- Bit casts and loads ------------------------------------------------

__device__ __forceinline__ float Bf16Bits(uint32_t h) {
  return __uint_as_float(h << 16);
}
__device__ __forceinline__ float HalfBits(uint16_t h) {
  return __half2float(__ushort_as_half(h));
}
__device__ __forceinline__ uint16_t LoadU16(const uint8_t* p) {
  return *reinterpret_cast<const uint16_t*>(p);
}
__device__ __forceinline__ __half2 U32AsHalf2(uint32_t x) {
  __half2 h;
  memcpy(&h, &x, 4);
  return h;
}
__device__ __forceinline__ uint32_t Half2AsU32(__half2 h) {
  uint32_t x;
  memcpy(&x, &h, 4);
  return x;
}
// Two E4M3 codes (bits 0-15 of x, low byte first) -> exact fp16 pair.
__device__ __forceinline__ __half2 Fp8x2ToHalf2(uint32_t x) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(x & 0xffffu), __NV_E4M3);
  return __half2(h);
}
// kR bytes at p (aligned to min(kR, 16)) into words, low byte first.
template <int kR>
__device__ __forceinline__ void LoadRun(const uint8_t* p,
                                        uint32_t (&w)[kR >= 4 ? kR / 4 : 1]) {
  if constexpr (kR >= 16) {
#pragma unroll
    for (int i = 0; i < kR / 16; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
      w[4 * i] = v.x;
      w[4 * i + 1] = v.y;
      w[4 * i + 2] = v.z;
      w[4 * i + 3] = v.w;
    }
  } else if constexpr (kR == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x;
    w[1] = v.y;
  } else if constexpr (kR == 4) {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  } else if constexpr (kR == 2) {
    w[0] = LoadU16(p);
  } else {
    w[0] = p[0];
  }
}

// ---- Warp reductions and exp2 -------------------------------------------

__device__ __forceinline__ float WarpMax(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// 2^x by the SFU alone (ex2.approx.ftz: relative error ~2^-22, results
// below 2^-126 flushed to 0, 2^-inf = 0). exp2f adds a range check and two
// multiplies per call to keep denormal results, which softmax weights that
// small do not need.
__device__ __forceinline__ float Exp2Fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- cp.async, cp.async.bulk and mbarrier ---------------------------------

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared, bypassing L1; src_bytes 0 writes zeros.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src,
                                          int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
               "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void CpCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CpWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// mbarrier helpers (shared-memory addresses).
__device__ __forceinline__ void BarInit(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar)
               : "memory");
}
__device__ __forceinline__ void BarArriveTx(uint32_t bar, uint32_t bytes) {
  asm volatile(
      "{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], "
      "%1;\n}\n" ::"r"(bar),
      "r"(bytes)
      : "memory");
}
// Waits for the completion of the phase of parity `parity`.
__device__ __forceinline__ void BarWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nKV_BAR_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra KV_BAR_WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// bytes (a multiple of 16, both addresses 16-byte aligned) global ->
// shared through the TMA unit, completing `bytes` transactions on bar.
__device__ __forceinline__ void BulkCopy(uint32_t dst, const void* src,
                                         uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
      "[%0], [%1], %2, [%3];\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
// Waits until at most n (< kMaxInFlight) groups are pending.
__device__ __forceinline__ void CpWaitAtMost(int n) {
  switch (n) {
#define KV_WAIT_CASE(i) \
  case i:               \
    CpWait<i>();        \
    break;
    KV_WAIT_CASE(1)
    KV_WAIT_CASE(2)
    KV_WAIT_CASE(3)
    KV_WAIT_CASE(4)
    KV_WAIT_CASE(5)
    KV_WAIT_CASE(6)
    KV_WAIT_CASE(7)
    KV_WAIT_CASE(8)
    KV_WAIT_CASE(9)
    KV_WAIT_CASE(10)
    KV_WAIT_CASE(11)
    KV_WAIT_CASE(12)
    KV_WAIT_CASE(13)
    KV_WAIT_CASE(14)
    KV_WAIT_CASE(15)
#undef KV_WAIT_CASE
    default:
      CpWait<0>();
  }
}

// ---- Tensor-core operands: ldmatrix, mma, movmatrix, packing, LOP3 -------

__device__ __forceinline__ void Ldm4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void Ldm4T(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(addr));
}
__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4],
                                    uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint4 Pack8(const float* x) {
  return make_uint4(PackBf16(x[0], x[1]), PackBf16(x[2], x[3]),
                    PackBf16(x[4], x[5]), PackBf16(x[6], x[7]));
}

__device__ __forceinline__ void MmaF16(float (&d)[4], const uint32_t (&a)[4],
                                       uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t PackHalf(float lo, float hi) {
  return Half2AsU32(__floats2half2_rn(lo, hi));
}

// Transposes an 8x8 b16 matrix held one row pair per lane (row lane / 4,
// columns 2 (lane % 4), + 1) into the same layout.
__device__ __forceinline__ uint32_t Movm(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n"
               : "=r"(y)
               : "r"(x));
  return y;
}

// (a & mask) | bits in one LOP3 (constants in registers, hoisted).
__device__ __forceinline__ uint32_t AndOr(uint32_t a, uint32_t mask,
                                          uint32_t bits) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n"
      : "=r"(d)
      : "r"(a), "r"(mask), "r"(bits));
  return d;
}

}  // namespace
}  // namespace triax::kernels::cuda
