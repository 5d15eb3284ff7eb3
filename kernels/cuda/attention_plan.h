// How decode attention is planned before any kernel runs, shared by the
// host (attention_plan.cc, attention_dispatch.cu) and the kernels: the
// encoding classes (ClassOf) and which launch configuration runs each,
// the split-K share counts per configuration (SplitsFor from each kernel's
// resident CTAs per SM), and the workspace layout.
//
// Workspace (AttentionWorkspaceBytes), 16-byte aligned sections:
//   cls_mask  u32[batch]                        bit c: class c has pages
//   part_plan int2[batch][kClasses][s_max + 1]  PartitionKernel's shares
//   ws_lse    f32[batch][n_q_heads][kClasses][s_max]  partial log2-sum-exp
//   ws_o      f32[batch][n_q_heads][kClasses][s_max][head_dim]
#pragma once

#include <vector_types.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/packed_encoding.h"
#include "kernels/host_device.h"

namespace triax::kernels::cuda {

struct AttentionParams;  // kv_cuda.cuh (absl-free here: see launch_result.h)

inline constexpr int kMmaWarps = 4;    // warps per CTA, one share each
inline constexpr int kMaxSplits = 64;  // AttentionParams::num_splits cap

// Encoding classes: pages are grouped by their K format (any byte value
// maps to one of kClasses), each class of a sequence is its own set of
// split-K partitions, and CTAs are ordered class-major so that the SMs run
// one class's code at a time (mixed pools otherwise thrash the instruction
// cache switching formats tile by tile). Classes 1-4 (K INT4, INT2, FP8,
// INT8) run the transposed kSmall kernel, which needs INT/FP8 values too
// and head_dim >= 64 (small_ok); other pages with such keys join class 0,
// whose kernel takes every format. Likewise classes 5 and 7 (K TQ4, TQ2)
// run its kTq variant with TQ4/TQ2 values (else they join class 6).
inline constexpr int kClasses = 8;
TRIAX_HOST_DEVICE_FORCEINLINE int ClassOf(int32_t packed_format,
                                          bool small_ok) {
  const UnpackedEncoding e = UnpackEncoding(packed_format);
  const uint32_t fk = static_cast<uint32_t>(e.k),
                 fv = static_cast<uint32_t>(e.v);
  constexpr uint32_t kInt4 = static_cast<uint32_t>(Format::kINT4),
                     kInt8 = static_cast<uint32_t>(Format::kINT8),
                     kTq4 = static_cast<uint32_t>(Format::kTQ4),
                     kTq2 = static_cast<uint32_t>(Format::kTQ2);
  static_assert(kInt4 == 2 && static_cast<uint32_t>(Format::kINT2) == 3 &&
                    static_cast<uint32_t>(Format::kFP8) == 4 && kInt8 == 5,
                "INT4, INT2, FP8, INT8 are the Format values 2..5");
  // INT4, INT2, FP8, INT8: the formats of the transposed kernel's tiles.
  const bool k_small = fk >= kInt4 && fk <= kInt8,
             v_small = fv >= kInt4 && fv <= kInt8;
  if (k_small && !(small_ok && v_small)) return 0;
  // TQ4/TQ2 keys take the transposed kTq kernel with TQ4/TQ2 values only;
  // with other values they join class 6 (TQ3 keys: the full kernel, whose
  // CTAs of that class build Q' = R Q).
  const bool k_tq = fk == kTq4 || fk == kTq2, v_tq = fv == kTq4 || fv == kTq2;
  if (small_ok && k_tq && !v_tq) return 6;
  // Class c holds K format c + 1 (any byte value maps to a class).
  return (fk - 1u) & (kClasses - 1);
}
// head_dims whose kSmall kernel is built (ValuesRegT: runs of >= 2 bytes).
TRIAX_HOST_DEVICE constexpr bool SmallOk(int d) { return d >= 64; }

// Classes per launch (MmaArgs::classes): with head_dim >= 64, the full
// kernel runs classes 0 and 6 (BF16 and TQ3 keys, and the pages that fit
// no transposed class: INT/FP8 keys join 0, TQ keys 6), the transposed
// kernel 1-2 (INT4/INT2 keys), 3-4
// (FP8/INT8 keys) and 5, 7 (TQ4/TQ2, its kTq variant); below 64 the full
// kernel runs 0 and 5-7 (classes 1-4 get no pages then).
inline constexpr int kLaunchClasses = 4;  // the most classes in one launch
constexpr uint32_t ClassList(int c0, int c1, int c2 = 0, int c3 = 0) {
  return static_cast<uint32_t>(c0 | c1 << 4 | c2 << 8 | c3 << 12);
}
// Registers of the kSmall kernel are capped for this many CTAs per SM:
// measured on the H100 (batch 64 x 32k), INT4/INT2 keys run fastest at 4
// (16 warps, 128 registers), FP8/INT8 keys at 3 (fewer spills and moves
// matter more than warps for their larger tiles).
constexpr int kSmallCtas(int d, bool low_bit) {
  return d > 128 ? 2 : (low_bit ? 4 : 3);
}

// Launch configurations: 0 the full kernel, 1 the transposed kernel for
// INT4/INT2 keys (classes 1-2), 2 for FP8/INT8 keys (classes 3-4), 3 its
// TQ variant (classes 5, 7; head_dim >= 64, else they are the full
// kernel's).
inline constexpr int kConfigs = 4;
TRIAX_HOST_DEVICE constexpr int ConfigOf(int cls, bool small_ok) {
  return cls == 1 || cls == 2                 ? 1
         : cls == 3 || cls == 4               ? 2
         : (cls == 5 || cls == 7) && small_ok ? 3
                                              : 0;
}

// CTAs of each launch configuration resident per SM (the BF16/TQ kernel,
// the transposed kernel for INT4/INT2 keys and for FP8/INT8 keys; 0 when
// head_dim has no transposed kernel), from the occupancy calculator.
struct Residency {
  int sms = 132, big = 1, low_bit = 0, eight_bit = 0, tq = 0;
};

struct MmaPlan {
  int group, row_blocks, small_row_blocks;
  int splits[kConfigs];  // per launch configuration (ConfigOf)
  int s_max;             // largest splits x kMmaWarps: the share stride
  size_t ws_bytes;
};

// The plan of one call. r (resident CTAs per SM of p's head_dim's kernels)
// is read only when p.num_splits <= 0.
MmaPlan PlanMma(const AttentionParams& p, const Residency& r);

// Splits of one launch configuration: the fewest whose grid (ctas x
// splits CTAs, per_sm x SMs resident at a time) fills at least 90% of the
// slots of its waves (so: at least 0.9 of one wave, and a last wave that
// is not mostly empty); when none does (tiny batches), the best filled.
// Measured on the H100 (bench/results/attention.md, num_splits sweep):
// e.g. batch 16 x 8 KV heads picks 2 for the BF16/TQ kernel (2 CTAs per
// SM: 256 of 264 slots), 3 for FP8/INT8 keys (3 per SM) and 4 for
// INT4/INT2 keys (4 per SM), each the fastest of 1-24 for its format, where
// a split count shared by the three configurations lost up to 0.1 of
// streaming read to half-empty last waves.
int SplitsFor(long long ctas, int per_sm, int sms);

// The workspace's sections (header comment) in ws, PlanMma's layout.
struct MmaWorkspace {
  uint32_t* cls_mask;
  int2* part_plan;
  float* ws_lse;
  float* ws_o;
};
MmaWorkspace CarveMmaWorkspace(const AttentionParams& p, const MmaPlan& plan,
                               void* ws);

}  // namespace triax::kernels::cuda
