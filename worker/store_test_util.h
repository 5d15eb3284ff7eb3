// Helpers shared by the SequenceStore tests (sequence_store_test.cc,
// store_attend_test.cc, store_demote_test.cc, store_fork_test.cc): plans,
// random K/V with their BF16-rounded copies, a float64 attention reference
// and StoreTest, a fixture over a RecordingDevice. Seeds are fixed by the
// callers.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/status_matchers.h"
#include "kernels/numeric.h"
#include "worker/recording_device.h"
#include "worker/sequence_store.h"

namespace triax::worker::store_testing {

using kernels::Format;
using triax::testing::IsOk;

inline constexpr Format kBf16 = Format::kBF16, kInt4 = Format::kINT4,
                        kInt2 = Format::kINT2;
inline constexpr char kTenant[] = "tenant-a";

inline ModelShape Shape(uint32_t layers, uint32_t kv_heads, uint32_t q_heads,
                        uint32_t head_dim) {
  ModelShape m;
  m.name = "test";
  m.n_layers = layers;
  m.n_kv_heads = kv_heads;
  m.n_q_heads = q_heads;
  m.head_dim = head_dim;
  return m;
}

// Blocks of the given sizes and formats; lineage ids start at `lineage0`.
inline std::vector<BlockSpec> Plan(
    const std::vector<std::pair<uint32_t, Format>>& sizes,
    uint64_t lineage0 = 100) {
  std::vector<BlockSpec> plan;
  uint64_t first = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    BlockSpec b;
    b.index = static_cast<uint32_t>(i);
    b.lineage_id = lineage0 + i;
    b.first_token = first;
    b.num_tokens = sizes[i].first;
    b.encoding = sizes[i].second;
    first += b.num_tokens;
    plan.push_back(b);
  }
  return plan;
}

// Full blocks of `t` tokens covering `tokens`, the last one partial.
inline std::vector<BlockSpec> UniformPlan(uint32_t tokens, uint32_t t,
                                          Format format) {
  std::vector<std::pair<uint32_t, Format>> sizes;
  for (uint32_t done = 0; done < tokens; done += t) {
    sizes.emplace_back(std::min(t, tokens - done), format);
  }
  return Plan(sizes);
}

// Random K/V of one layer, float32 token-major, plus its BF16-rounded copy.
struct LayerKv {
  std::vector<float> k, v;    // as generated
  std::vector<float> kr, vr;  // rounded to bf16
};

inline LayerKv RandomKv(size_t tokens, size_t values_per_token, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  LayerKv kv;
  const size_t n = tokens * values_per_token;
  kv.k.resize(n);
  kv.v.resize(n);
  for (size_t i = 0; i < n; ++i) {
    kv.k[i] = dist(rng);
    kv.v[i] = dist(rng);
  }
  for (float x : kv.k)
    kv.kr.push_back(kernels::Bf16ToFloat(kernels::FloatToBf16(x)));
  for (float x : kv.v)
    kv.vr.push_back(kernels::Bf16ToFloat(kernels::FloatToBf16(x)));
  return kv;
}

inline std::string Bytes(const float* p, size_t n) {
  return std::string(reinterpret_cast<const char*>(p), n * 4);
}

inline KvWrite Chunk(uint32_t layer, uint64_t first, uint32_t n,
                     const LayerKv& kv, size_t per_token, std::string* kbuf,
                     std::string* vbuf) {
  *kbuf = Bytes(kv.k.data() + first * per_token, n * per_token);
  *vbuf = Bytes(kv.v.data() + first * per_token, n * per_token);
  KvWrite w;
  w.layer = layer;
  w.first_token = first;
  w.num_tokens = n;
  w.dtype = static_cast<int>(KvDtype::kF32);
  w.k = *kbuf;
  w.v = *vbuf;
  return w;
}

// Float64 decode attention over token-major K/V ([t][H][D]).
inline std::vector<float> RefAttention(const ModelShape& m,
                                       const std::vector<float>& q,
                                       const std::vector<float>& k,
                                       const std::vector<float>& v,
                                       uint64_t attend, double scale) {
  const int g = m.n_q_heads / m.n_kv_heads;
  const size_t hd = static_cast<size_t>(m.n_kv_heads) * m.head_dim;
  std::vector<float> out(static_cast<size_t>(m.n_q_heads) * m.head_dim);
  for (uint32_t h = 0; h < m.n_q_heads; ++h) {
    const uint32_t kvh = h / g;
    std::vector<double> s(attend);
    double mx = -1e300;
    for (uint64_t t = 0; t < attend; ++t) {
      double dot = 0;
      for (uint32_t d = 0; d < m.head_dim; ++d) {
        dot += double(q[size_t{h} * m.head_dim + d]) *
               k[t * hd + size_t{kvh} * m.head_dim + d];
      }
      s[t] = dot * scale;
      mx = std::max(mx, s[t]);
    }
    double sum = 0;
    for (double& x : s) sum += (x = std::exp(x - mx));
    for (uint32_t d = 0; d < m.head_dim; ++d) {
      double acc = 0;
      for (uint64_t t = 0; t < attend; ++t) {
        acc += s[t] * v[t * hd + size_t{kvh} * m.head_dim + d];
      }
      out[h * m.head_dim + d] = static_cast<float>(acc / sum);
    }
  }
  return out;
}

inline double RelError(const std::vector<float>& got,
                       const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    den += double(want[i]) * want[i];
  }
  return std::sqrt(num / den);
}

inline void ExpectFiniteNonZero(const std::vector<float>& x) {
  double norm = 0;
  for (float f : x) {
    ASSERT_TRUE(std::isfinite(f));
    norm += double(f) * f;
  }
  EXPECT_GT(norm, 0.0);
}

class StoreTest : public ::testing::Test {
 protected:
  void Make(uint32_t window_tokens, size_t capacity = 64 << 20,
            size_t frame_bytes = PageAllocator::kDefaultFrameBytes) {
    store_.reset();
    auto a = PageAllocator::Create(&device_, capacity, frame_bytes);
    ASSERT_THAT(a.status(), IsOk());
    alloc_ = *std::move(a);
    store_ = std::make_unique<SequenceStore>(&device_, alloc_.get(),
                                             StoreOptions{window_tokens});
  }
  void TearDown() override {
    store_.reset();
    alloc_.reset();
  }

  // Writes every layer of `kv` ([layer] -> tokens) in chunks of `chunk`.
  void WriteAll(const std::string& seq, const ModelShape& m,
                const std::vector<LayerKv>& kv, uint64_t tokens, uint32_t chunk,
                uint64_t from = 0) {
    const size_t per = size_t{m.n_kv_heads} * m.head_dim;
    for (uint32_t l = 0; l < m.n_layers; ++l) {
      for (uint64_t t = from; t < tokens; t += chunk) {
        const uint32_t n =
            static_cast<uint32_t>(std::min<uint64_t>(chunk, tokens - t));
        std::string kb, vb;
        auto w =
            store_->Write(kTenant, seq, Chunk(l, t, n, kv[l], per, &kb, &vb));
        ASSERT_THAT(w.status(), IsOk()) << "layer " << l << " token " << t;
      }
    }
  }

  std::vector<LayerKv> RandomLayers(const ModelShape& m, size_t tokens,
                                    uint32_t seed) {
    std::vector<LayerKv> kv;
    for (uint32_t l = 0; l < m.n_layers; ++l) {
      kv.push_back(
          RandomKv(tokens, size_t{m.n_kv_heads} * m.head_dim, seed + l));
    }
    return kv;
  }

  std::vector<float> RandomQueries(const ModelShape& m, uint32_t n,
                                   uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.f, 1.f);
    std::vector<float> q(size_t{n} * m.n_q_heads * m.head_dim);
    for (float& x : q) x = dist(rng);
    return q;
  }

  absl::StatusOr<std::vector<float>> Attend(
      const std::string& seq, uint32_t layer, const std::vector<float>& q,
      uint32_t nq, const std::vector<uint64_t>& positions) {
    AttendSpec spec;
    spec.layer = layer;
    spec.num_queries = nq;
    spec.positions = positions;
    std::string qb = Bytes(q.data(), q.size());
    spec.queries = qb;
    return store_->Attend(kTenant, seq, spec);
  }

  RecordingDevice device_;  // CPU compute, records batches
  std::unique_ptr<PageAllocator> alloc_;
  std::unique_ptr<SequenceStore> store_;
};

}  // namespace triax::worker::store_testing
