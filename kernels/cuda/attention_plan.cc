#include "kernels/cuda/attention_plan.h"

#include <algorithm>

#include "kernels/cuda/kv_cuda.cuh"

namespace triax::kernels::cuda {
namespace {

size_t Align16(size_t n) { return (n + 15) & ~size_t{15}; }

// Fraction of the CTA slots of its waves that n CTAs fill.
double WaveEfficiency(long long n, long long slots) {
  const long long waves = (n + slots - 1) / slots;
  return static_cast<double>(n) / static_cast<double>(waves * slots);
}

}  // namespace

int SplitsFor(long long ctas, int per_sm, int sms) {
  const long long slots = 1LL * std::max(per_sm, 1) * std::max(sms, 1);
  int best_s = 1;
  double best = 0.0;
  for (int s = 1; s <= kMaxSplits; ++s) {
    const double e = WaveEfficiency(ctas * s, slots);
    if (e >= 0.9) return s;
    if (e > best + 1e-9) {
      best = e;
      best_s = s;
    }
  }
  return best_s;
}

MmaPlan PlanMma(const AttentionParams& p, const Residency& r) {
  MmaPlan m;
  m.group = p.n_q_heads / p.shape.heads;
  m.row_blocks = (m.group + 15) / 16;
  m.small_row_blocks = (m.group + 7) / 8;
  if (p.num_splits > 0) {
    for (int c = 0; c < kConfigs; ++c)
      m.splits[c] = std::min(p.num_splits, kMaxSplits);
  } else {
    const long long base = static_cast<long long>(p.batch) * p.shape.heads;
    m.splits[0] = SplitsFor(base * m.row_blocks, r.big, r.sms);
    m.splits[1] = SplitsFor(base * m.small_row_blocks, r.low_bit, r.sms);
    m.splits[2] = SplitsFor(base * m.small_row_blocks, r.eight_bit, r.sms);
    m.splits[3] = SplitsFor(base * m.small_row_blocks, r.tq, r.sms);
    if (r.low_bit == 0) m.splits[1] = m.splits[2] = m.splits[3] = 1;  // unused
  }
  m.s_max = 0;
  for (int c = 0; c < kConfigs; ++c)
    m.s_max = std::max(m.s_max, m.splits[c] * kMmaWarps);
  const size_t slots =
      static_cast<size_t>(p.batch) * p.n_q_heads * kClasses * m.s_max;
  // Class masks, partition plans, then partial LSEs, then partial outputs
  // (16-aligned each).
  m.ws_bytes = Align16(static_cast<size_t>(p.batch) * 4) +
               Align16(static_cast<size_t>(p.batch) * kClasses * (m.s_max + 1) *
                       sizeof(int2)) +
               Align16(slots * sizeof(float)) +
               slots * p.shape.head_dim * sizeof(float);
  return m;
}

MmaWorkspace CarveMmaWorkspace(const AttentionParams& p, const MmaPlan& plan,
                               void* ws) {
  const int S = plan.s_max;
  const size_t slots =
      static_cast<size_t>(p.batch) * p.n_q_heads * kClasses * S;
  uint8_t* w8 = static_cast<uint8_t*>(ws);
  MmaWorkspace w;
  w.cls_mask = reinterpret_cast<uint32_t*>(w8);
  w8 += Align16(static_cast<size_t>(p.batch) * 4);
  w.part_plan = reinterpret_cast<int2*>(w8);
  w8 +=
      Align16(static_cast<size_t>(p.batch) * kClasses * (S + 1) * sizeof(int2));
  w.ws_lse = reinterpret_cast<float*>(w8);
  w.ws_o = reinterpret_cast<float*>(w8 + Align16(slots * sizeof(float)));
  return w;
}

}  // namespace triax::kernels::cuda
