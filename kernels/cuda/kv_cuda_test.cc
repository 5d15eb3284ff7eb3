// CUDA kernels against the CPU reference on random data. Skips cleanly
// when no CUDA device is present (argument validation still runs: it never
// touches the device).
//
// Oracles:
//   encode:    page bytes equal EncodePage's exactly (same IEEE operations).
//   decode:    equal to DecodePage within 1e-6 relative (exact in practice;
//              the slack only covers a host compiler that contracts FMA).
//   attention: vs DecodeAttentionRef on the same pages, max_abs <= 2e-5
//              (float32 summation order and __expf); vs float64 attention
//              on the decoded values, max_abs <= 2e-5. Measured on an
//              H100 over the 60-case grid (page tables mixing the 10
//              CudaEncodings(): every CUDA format, K != V, groups 64/128,
//              FP8 metadata): max_abs <= 1.2e-6 vs the reference and vs
//              float64.
#include "kernels/cuda/kv_cuda.cuh"

#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "kernels/layout.h"
#include "kernels/numeric.h"
#include "kernels/ref/kv_ref.h"
#include "kernels/testing/kv_test_util.h"

namespace triax::kernels::cuda {
namespace {

using ::testing::HasSubstr;
using triax::kernels::testing::SameBits;
using triax::testing::IsOk;
using triax::testing::StatusIs;

// Every CUDA format uniformly, K != V pairs, group and scale variants.
const std::vector<Encoding>& CudaEncodings() {
  static const std::vector<Encoding> e = {
      Format::kBF16,
      Format::kFP8,
      Format::kINT8,
      Format::kINT4,
      Format::kINT2,
      Encoding(Format::kINT4, Format::kINT2),
      Encoding(Format::kFP8, Format::kINT4),
      Encoding(Format::kINT8, Format::kBF16, 64, ScaleDtype::kFP8),
      Encoding(Format::kINT2, Format::kINT8, 128),
      Encoding(Format::kINT4, Format::kINT4, 32, ScaleDtype::kFP8),
      Format::kTQ4,
      Format::kTQ3,
      Format::kTQ2,
      Encoding(Format::kTQ4, Format::kINT4),
      Encoding(Format::kBF16, Format::kTQ3)};
  return e;
}

// The CudaEncodings valid for `s` (TQ needs a power-of-two head_dim >= 16).
std::vector<Encoding> ValidEncodings(const PageShape& s) {
  std::vector<Encoding> out;
  for (const Encoding& e : CudaEncodings()) {
    if (CheckEncodingCuda(e, s).ok()) out.push_back(e);
  }
  return out;
}

// The tensor-core kernel (head_dim a multiple of 16) rounds Q, P and K/V
// to BF16 (BF16/TQ tiles) or FP16 (INT/FP8 tiles) operands; the CUDA-core
// kernel is float32 throughout.
double AttentionTolerance(int head_dim) {
  return head_dim % 16 == 0 ? 3e-2 : 2e-5;
}

// Device buffer owned by the test.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    EXPECT_EQ(cudaMalloc(&ptr_, std::max<size_t>(bytes, 16)), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  template <typename T>
  void Upload(const std::vector<T>& v) {
    ASSERT_LE(v.size() * sizeof(T), bytes_);
    ASSERT_EQ(cudaMemcpy(ptr_, v.data(), v.size() * sizeof(T),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  template <typename T>
  std::vector<T> Download(size_t n) const {
    std::vector<T> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), ptr_, n * sizeof(T), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return v;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

class KvCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
      GTEST_SKIP() << "no CUDA device (" << cudaGetErrorString(e) << ", count "
                   << n << ")";
    }
  }
};

// Pages of random formats in one device pool, each at a 16-byte aligned
// offset (PageBytes is a multiple of 16).
struct Pool {
  std::vector<Encoding> formats;
  std::vector<int> tokens;
  std::vector<size_t> offsets;
  size_t bytes = 0;

  void Add(const Encoding& f, int n, const PageShape& s) {
    formats.push_back(f);
    tokens.push_back(n);
    offsets.push_back(bytes);
    bytes += PageBytes(f, s);
  }
  std::vector<DevicePage> Table(uint8_t* base) const {
    std::vector<DevicePage> t;
    for (size_t i = 0; i < formats.size(); ++i) {
      t.push_back(
          DevicePage{base + offsets[i], tokens[i], PackEncoding(formats[i])});
    }
    return t;
  }
};

// Attention over device buffers: q and out f32 [batch][n_q][head_dim], the
// page table, indptr [batch + 1] and attend [batch]; scale 1 / sqrt(D).
AttentionParams DeviceAttention(const PageShape& s, int batch, int n_q,
                                const DeviceBuffer& q, const DeviceBuffer& out,
                                const DeviceBuffer& table,
                                const DeviceBuffer& indptr,
                                const DeviceBuffer& attend) {
  AttentionParams p;
  p.shape = s;
  p.batch = batch;
  p.n_q_heads = n_q;
  p.scale = 1.f / std::sqrt(static_cast<float>(s.head_dim));
  p.q = q.as<float>();
  p.out = out.as<float>();
  p.pages = table.as<DevicePage>();
  p.page_indptr = indptr.as<int32_t>();
  p.attend_tokens = attend.as<int32_t>();
  return p;
}

TEST_F(KvCudaTest, EncodeMatchesReferenceBytes) {
  const uint32_t seed = 101;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  struct Shape {
    int T, H, D;
  };
  for (const Shape& sh :
       {Shape{16, 2, 128}, Shape{1, 3, 64}, Shape{7, 1, 8}, Shape{16, 4, 24},
        Shape{13, 2, 256}, Shape{64, 1, 24}}) {
    const PageShape s{sh.T, sh.H, sh.D};
    SCOPED_TRACE(::testing::Message()
                 << "T=" << sh.T << " H=" << sh.H << " D=" << sh.D);
    const std::vector<Encoding> encs = ValidEncodings(s);
    const int num_pages = 2 * static_cast<int>(encs.size()) + 3;
    const size_t page_elems = static_cast<size_t>(sh.T) * sh.H * sh.D;
    const auto k = testing::RandomBf16(rng, num_pages * page_elems, 2.f);
    const auto v = testing::RandomBf16(rng, num_pages * page_elems, 2.f);
    Pool pool;
    const int ne = static_cast<int>(encs.size());
    std::uniform_int_distribution<int> pick(0, ne - 1), ntok(1, sh.T);
    for (int i = 0; i < num_pages; ++i) {
      // Every encoding at least twice; full and partial pages.
      pool.Add(encs[i < 2 * ne ? i % ne : pick(rng)],
               i % 3 == 0 ? sh.T : ntok(rng), s);
    }
    DeviceBuffer d_pool(pool.bytes), d_k(k.size() * 2), d_v(v.size() * 2);
    d_pool.Upload(
        std::vector<uint8_t>(pool.bytes, 0xcd));  // garbage to overwrite
    d_k.Upload(k);
    d_v.Upload(v);
    const auto table = pool.Table(d_pool.as<uint8_t>());
    DeviceBuffer d_table(table.size() * sizeof(DevicePage));
    d_table.Upload(table);

    EncodePagesParams p;
    p.shape = s;
    p.pages = d_table.as<DevicePage>();
    p.num_pages = num_pages;
    p.k_bf16 = d_k.as<uint16_t>();
    p.v_bf16 = d_v.as<uint16_t>();
    ASSERT_THAT(EncodePagesCuda(p), IsOk());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto got = d_pool.Download<uint8_t>(pool.bytes);
    for (int i = 0; i < num_pages; ++i) {
      const Encoding f = pool.formats[i];
      char name[64];
      std::vector<uint8_t> want(PageBytes(f, s));
      EncodePage(f, s, k.data() + i * page_elems, v.data() + i * page_elems,
                 pool.tokens[i], want.data());
      int mismatches = 0, first = -1;
      for (size_t j = 0; j < want.size(); ++j) {
        if (got[pool.offsets[i] + j] != want[j]) {
          if (first < 0) first = static_cast<int>(j);
          ++mismatches;
        }
      }
      EXPECT_EQ(mismatches, 0)
          << "page " << i << " " << EncodingName(f, name, sizeof(name))
          << " n=" << pool.tokens[i] << " first bad byte " << first << " of "
          << want.size();
    }
  }
}

TEST_F(KvCudaTest, DecodeMatchesReference) {
  const uint32_t seed = 202;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  for (const PageShape& s :
       {PageShape{16, 2, 128}, PageShape{7, 3, 8}, PageShape{1, 2, 64},
        PageShape{64, 1, 256}, PageShape{5, 2, 24}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << s.tokens << " H=" << s.heads
                                      << " D=" << s.head_dim);
    const std::vector<Encoding> encs = ValidEncodings(s);
    const int num_pages = static_cast<int>(encs.size()) + 2;
    const size_t page_elems =
        static_cast<size_t>(s.tokens) * s.heads * s.head_dim;
    Pool pool;
    std::vector<uint8_t> host_pool;
    std::vector<float> want_k(num_pages * page_elems, NAN),
        want_v(want_k.size(), NAN);
    std::uniform_int_distribution<int> ntok(1, s.tokens);
    for (int i = 0; i < num_pages; ++i) {
      const Encoding f = encs[i % encs.size()];
      const int n = i == 0 ? s.tokens : ntok(rng);
      pool.Add(f, n, s);
      const auto k = testing::RandomBf16(
          rng, static_cast<size_t>(n) * s.heads * s.head_dim);
      const auto v = testing::RandomBf16(
          rng, static_cast<size_t>(n) * s.heads * s.head_dim);
      std::vector<uint8_t> page(PageBytes(f, s));
      EncodePage(f, s, k.data(), v.data(), n, page.data());
      host_pool.insert(host_pool.end(), page.begin(), page.end());
      DecodePage(f, s, page.data(), n, want_k.data() + i * page_elems,
                 want_v.data() + i * page_elems);
    }
    DeviceBuffer d_pool(pool.bytes);
    d_pool.Upload(host_pool);
    const auto table = pool.Table(d_pool.as<uint8_t>());
    DeviceBuffer d_table(table.size() * sizeof(DevicePage));
    d_table.Upload(table);
    DeviceBuffer d_k(want_k.size() * 4), d_v(want_v.size() * 4);
    d_k.Upload(std::vector<float>(want_k.size(), NAN));  // rows past n stay NaN
    d_v.Upload(std::vector<float>(want_v.size(), NAN));
    DecodePagesParams p;
    p.shape = s;
    p.pages = d_table.as<DevicePage>();
    p.num_pages = num_pages;
    p.k_out = d_k.as<float>();
    p.v_out = d_v.as<float>();
    ASSERT_THAT(DecodePagesCuda(p), IsOk());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto got_k = d_k.Download<float>(want_k.size());
    const auto got_v = d_v.Download<float>(want_v.size());
    size_t checked = 0;
    for (size_t i = 0; i < want_k.size(); ++i) {
      if (std::isnan(want_k[i])) {  // not a valid row: must be untouched
        ASSERT_TRUE(std::isnan(got_k[i]) && std::isnan(got_v[i])) << "i=" << i;
        continue;
      }
      ASSERT_NEAR(got_k[i], want_k[i], 1e-6 * std::fabs(want_k[i]))
          << "K i=" << i;
      ASSERT_NEAR(got_v[i], want_v[i], 1e-6 * std::fabs(want_v[i]))
          << "V i=" << i;
      ++checked;
    }
    EXPECT_GT(checked, page_elems);
  }
}

struct AttnCase {
  int page_tokens, group, head_dim;
};

class KvCudaAttentionTest
    : public KvCudaTest,
      public ::testing::WithParamInterface<std::tuple<int, int, int>> {};

// A batch of sequences with odd lengths, every page of a random format, a
// causal cut in the middle of a page for some, against the CPU reference.
TEST_P(KvCudaAttentionTest, MatchesReference) {
  const auto [T, group, D] = GetParam();
  if (group * D > 4096) GTEST_SKIP() << "group x head_dim over 4096";
  const int H = 2, n_q = H * group;
  const uint32_t seed = 3000u + T * 100u + group * 10u + D;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  const PageShape s{T, H, D};
  const std::vector<int> lengths = {54, 97, 1, T, 33};
  const int batch = static_cast<int>(lengths.size());
  const size_t tok = static_cast<size_t>(H) * D;

  Pool pool;
  std::vector<uint8_t> host_pool;
  std::vector<int32_t> indptr = {0}, attend;
  std::vector<std::vector<PageRef>> refs(batch);
  std::vector<std::vector<float>> k_dec(batch), v_dec(batch);
  std::vector<std::vector<size_t>> ref_offsets(batch);
  const std::vector<Encoding> encs = ValidEncodings(s);
  std::uniform_int_distribution<int> pick(0, encs.size() - 1);
  for (int b = 0; b < batch; ++b) {
    const int L = lengths[b];
    const auto k = testing::RandomBf16(rng, L * tok);
    const auto v = testing::RandomBf16(rng, L * tok);
    k_dec[b].resize(k.size());
    v_dec[b].resize(v.size());
    for (int start = 0; start < L; start += T) {
      const int n = std::min(T, L - start);
      const Encoding f = encs[pick(rng)];
      std::vector<uint8_t> page(PageBytes(f, s));
      EncodePage(f, s, k.data() + start * tok, v.data() + start * tok, n,
                 page.data());
      DecodePage(f, s, page.data(), n, k_dec[b].data() + start * tok,
                 v_dec[b].data() + start * tok);
      ref_offsets[b].push_back(host_pool.size());
      refs[b].push_back(PageRef{f, nullptr, n});
      pool.Add(f, n, s);
      host_pool.insert(host_pool.end(), page.begin(), page.end());
    }
    indptr.push_back(static_cast<int32_t>(pool.formats.size()));
    // Odd sequences stop in the middle of a page (causal cut).
    attend.push_back(b % 2 == 1 ? std::max(1, L - T / 2 - 1) : L);
  }
  for (int b = 0; b < batch; ++b) {
    for (size_t i = 0; i < refs[b].size(); ++i)
      refs[b][i].data = host_pool.data() + ref_offsets[b][i];
  }
  const auto q =
      testing::RandomFloat(rng, static_cast<size_t>(batch) * n_q * D);
  const float scale = 1.f / std::sqrt(static_cast<float>(D));

  DeviceBuffer d_pool(pool.bytes), d_q(q.size() * 4), d_out(q.size() * 4);
  d_pool.Upload(host_pool);
  d_q.Upload(q);
  d_out.Upload(std::vector<float>(q.size(), NAN));
  const auto table = pool.Table(d_pool.as<uint8_t>());
  DeviceBuffer d_table(table.size() * sizeof(DevicePage)),
      d_indptr(indptr.size() * 4), d_attend(attend.size() * 4);
  d_table.Upload(table);
  d_indptr.Upload(indptr);
  d_attend.Upload(attend);

  const AttentionParams p =
      DeviceAttention(s, batch, n_q, d_q, d_out, d_table, d_indptr, d_attend);
  ASSERT_THAT(DecodeAttentionCuda(p), IsOk());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got = d_out.Download<float>(q.size());

  double worst_ref = 0, worst_f64 = 0;
  for (int b = 0; b < batch; ++b) {
    SCOPED_TRACE(::testing::Message() << "sequence " << b << " length "
                                      << lengths[b] << " attend " << attend[b]);
    std::vector<float> ref_out(static_cast<size_t>(n_q) * D, NAN);
    DecodeParams rp;
    rp.q = q.data() + static_cast<size_t>(b) * n_q * D;
    rp.out = ref_out.data();
    rp.n_q_heads = n_q;
    rp.shape = s;
    rp.scale = scale;
    rp.pages = refs[b].data();
    rp.num_pages = static_cast<int>(refs[b].size());
    rp.attend_tokens = attend[b];
    DecodeAttentionRef(rp);
    const float* g = got.data() + static_cast<size_t>(b) * n_q * D;
    const std::vector<double> ref64(ref_out.begin(), ref_out.end());
    const auto vs_ref = testing::Compare(g, ref64);
    const std::vector<float> qb(rp.q, rp.q + static_cast<size_t>(n_q) * D);
    const auto vs_f64 =
        testing::Compare(g, testing::AttentionF64(qb, k_dec[b], v_dec[b], n_q,
                                                  H, D, attend[b], scale));
    ASSERT_TRUE(vs_ref.all_finite);
    EXPECT_GT(vs_ref.norm, 1e-3);
    EXPECT_LE(vs_ref.max_abs, AttentionTolerance(D));
    EXPECT_LE(vs_f64.max_abs, AttentionTolerance(D));
    worst_ref = std::max(worst_ref, vs_ref.max_abs);
    worst_f64 = std::max(worst_f64, vs_f64.max_abs);
  }
  std::printf("max_abs vs reference %.3g, vs float64 %.3g\n", worst_ref,
              worst_f64);
}

INSTANTIATE_TEST_SUITE_P(
    Grid, KvCudaAttentionTest,
    ::testing::Combine(::testing::Values(1, 7, 16, 40, 48),
                       ::testing::Values(1, 2, 4, 8, 20),
                       ::testing::Values(8, 24, 16, 32, 64, 128, 256)),
    [](const auto& info) {
      return "T" + std::to_string(std::get<0>(info.param)) + "_G" +
             std::to_string(std::get<1>(info.param)) + "_D" +
             std::to_string(std::get<2>(info.param));
    });

// Pages are grouped by encoding class per sequence (each class its own
// split-K partitions): long mixed sequences whose class runs cross the
// 32-page descriptor windows, empty pages in the table, a causal cut, an
// unsupported page inside the attended range (that sequence's output is
// all NaN), one past the cut (never read: output valid) and a sequence
// with no pages (zeros), under several split counts.
TEST_F(KvCudaTest, AttentionGroupsClassesAndPoisons) {
  const int T = 16, H = 2, D = 64, group = 4, n_q = H * group;
  const PageShape s{T, H, D};
  std::mt19937 rng(4242);
  const std::vector<Encoding> encs = ValidEncodings(s);
  std::uniform_int_distribution<int> pick(0, encs.size() - 1);
  const size_t tok = static_cast<size_t>(H) * D;
  // Per sequence: pages, attended tokens, where a bad page goes (-1 none,
  // else before that page index), whether it lies inside the attended range.
  struct Seq {
    int pages, attend, bad_at;
  };
  const std::vector<Seq> seqs = {
      {70, 70 * T - 5, -1}, {45, 45 * T, 20}, {50, 30 * T + 3, 40}, {0, 0, -1}};
  const int batch = static_cast<int>(seqs.size());
  Pool pool;
  std::vector<uint8_t> host_pool;
  std::vector<int32_t> indptr = {0}, attend;
  std::vector<std::vector<PageRef>> refs(batch);
  std::vector<std::vector<size_t>> ref_offsets(batch);
  std::vector<DevicePage> extra;  // (table index, page) patched in below
  std::vector<size_t> extra_at;
  for (int b = 0; b < batch; ++b) {
    for (int i = 0; i < seqs[b].pages; ++i) {
      if (i == seqs[b].bad_at || (b == 0 && i % 17 == 5)) {
        // b == 0: an empty page; else an unsupported encoding (K format 9).
        extra_at.push_back(pool.formats.size());
        extra.push_back(DevicePage{nullptr, b == 0 ? 0 : T, b == 0 ? 1 : 9});
        pool.Add(Format::kBF16, T, s);
        host_pool.resize(pool.bytes, 0);
      }
      // Runs of one encoding of random length, so class runs cross windows.
      const Encoding f = encs[(i / 7 + b * 3 + pick(rng) % 2) % encs.size()];
      const auto k = testing::RandomBf16(rng, T * tok);
      const auto v = testing::RandomBf16(rng, T * tok);
      std::vector<uint8_t> page(PageBytes(f, s));
      EncodePage(f, s, k.data(), v.data(), T, page.data());
      ref_offsets[b].push_back(host_pool.size());
      refs[b].push_back(PageRef{f, nullptr, T});
      pool.Add(f, T, s);
      host_pool.insert(host_pool.end(), page.begin(), page.end());
    }
    indptr.push_back(static_cast<int32_t>(pool.formats.size()));
    attend.push_back(seqs[b].attend);
  }
  for (int b = 0; b < batch; ++b) {
    for (size_t i = 0; i < refs[b].size(); ++i)
      refs[b][i].data = host_pool.data() + ref_offsets[b][i];
  }
  DeviceBuffer d_pool(pool.bytes);
  d_pool.Upload(host_pool);
  auto table = pool.Table(d_pool.as<uint8_t>());
  for (size_t i = 0; i < extra.size(); ++i) {
    table[extra_at[i]].num_tokens = extra[i].num_tokens;
    table[extra_at[i]].format = extra[i].format;
  }
  const auto q =
      testing::RandomFloat(rng, static_cast<size_t>(batch) * n_q * D);
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  DeviceBuffer d_q(q.size() * 4), d_out(q.size() * 4),
      d_table(table.size() * sizeof(DevicePage)), d_indptr(indptr.size() * 4),
      d_attend(attend.size() * 4);
  d_q.Upload(q);
  d_table.Upload(table);
  d_indptr.Upload(indptr);
  d_attend.Upload(attend);
  for (int splits : {1, 3, 0}) {
    SCOPED_TRACE(::testing::Message() << "num_splits " << splits);
    d_out.Upload(std::vector<float>(q.size(), 12345.f));
    AttentionParams p =
        DeviceAttention(s, batch, n_q, d_q, d_out, d_table, d_indptr, d_attend);
    p.num_splits = splits;
    ASSERT_THAT(DecodeAttentionCuda(p), IsOk());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto got = d_out.Download<float>(q.size());
    for (int b = 0; b < batch; ++b) {
      SCOPED_TRACE(::testing::Message() << "sequence " << b);
      const float* g = got.data() + static_cast<size_t>(b) * n_q * D;
      if (b == 1) {  // the bad page is attended: all NaN
        for (int i = 0; i < n_q * D; ++i) ASSERT_TRUE(std::isnan(g[i])) << i;
        continue;
      }
      if (b == 3) {  // no pages: zeros
        for (int i = 0; i < n_q * D; ++i) ASSERT_EQ(g[i], 0.f) << i;
        continue;
      }
      std::vector<float> ref_out(static_cast<size_t>(n_q) * D, NAN);
      DecodeParams rp;
      rp.q = q.data() + static_cast<size_t>(b) * n_q * D;
      rp.out = ref_out.data();
      rp.n_q_heads = n_q;
      rp.shape = s;
      rp.scale = scale;
      rp.pages = refs[b].data();
      rp.num_pages = static_cast<int>(refs[b].size());
      rp.attend_tokens = attend[b];
      DecodeAttentionRef(rp);
      const std::vector<double> ref64(ref_out.begin(), ref_out.end());
      const auto vs_ref = testing::Compare(g, ref64);
      ASSERT_TRUE(vs_ref.all_finite);
      EXPECT_GT(vs_ref.norm, 1e-3);
      EXPECT_LE(vs_ref.max_abs, AttentionTolerance(D));
    }
  }
}

// formats_present: an exact hint launches fewer kernels and gives the same
// bits as none; a hint missing a present encoding makes that sequence (and
// only it) NaN instead of silently dropping its pages.
TEST_F(KvCudaTest, AttentionFormatHint) {
  const int T = 16, H = 2, D = 128, group = 4, n_q = H * group;
  const PageShape s{T, H, D};
  std::mt19937 rng(777);
  const size_t tok = static_cast<size_t>(H) * D;
  // Sequence b uses encs[b] only.
  const std::vector<Encoding> encs = {Format::kINT4, Format::kBF16,
                                      Format::kTQ4, Format::kFP8};
  const int batch = static_cast<int>(encs.size()), pages = 9;
  Pool pool;
  std::vector<uint8_t> host_pool;
  std::vector<int32_t> indptr = {0}, attend;
  for (int b = 0; b < batch; ++b) {
    for (int i = 0; i < pages; ++i) {
      const auto k = testing::RandomBf16(rng, T * tok);
      const auto v = testing::RandomBf16(rng, T * tok);
      std::vector<uint8_t> page(PageBytes(encs[b], s));
      EncodePage(encs[b], s, k.data(), v.data(), T, page.data());
      pool.Add(encs[b], T, s);
      host_pool.insert(host_pool.end(), page.begin(), page.end());
    }
    indptr.push_back(static_cast<int32_t>(pool.formats.size()));
    attend.push_back(pages * T - 3);
  }
  const auto q =
      testing::RandomFloat(rng, static_cast<size_t>(batch) * n_q * D);
  DeviceBuffer d_pool(pool.bytes), d_q(q.size() * 4), d_out(q.size() * 4),
      d_indptr(indptr.size() * 4), d_attend(attend.size() * 4);
  d_pool.Upload(host_pool);
  const auto table = pool.Table(d_pool.as<uint8_t>());
  DeviceBuffer d_table(table.size() * sizeof(DevicePage));
  d_table.Upload(table);
  d_q.Upload(q);
  d_indptr.Upload(indptr);
  d_attend.Upload(attend);
  auto run = [&](uint32_t hint) {
    d_out.Upload(std::vector<float>(q.size(), 12345.f));
    AttentionParams p =
        DeviceAttention(s, batch, n_q, d_q, d_out, d_table, d_indptr, d_attend);
    p.formats_present = hint;
    EXPECT_THAT(DecodeAttentionCuda(p), IsOk());
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return d_out.Download<float>(q.size());
  };
  uint32_t all = 0;
  for (const Encoding& e : encs) all |= AttentionFormatBit(PackEncoding(e), D);
  const auto none = run(0), exact = run(all);
  const size_t per_seq = static_cast<size_t>(n_q) * D;
  for (size_t i = 0; i < q.size(); ++i) {
    ASSERT_TRUE(std::isfinite(none[i])) << i;
    ASSERT_TRUE(SameBits(&none[i], &exact[i], 1)) << i;
  }
  // Leave out each sequence's encoding in turn.
  for (int missing = 0; missing < batch; ++missing) {
    SCOPED_TRACE(::testing::Message() << "hint without sequence " << missing);
    const uint32_t hint =
        all & ~AttentionFormatBit(PackEncoding(encs[missing]), D);
    const auto got = run(hint);
    for (int b = 0; b < batch; ++b) {
      for (size_t i = b * per_seq; i < (b + 1) * per_seq; ++i) {
        if (b == missing) {
          ASSERT_TRUE(std::isnan(got[i])) << "sequence " << b << " at " << i;
        } else {
          ASSERT_TRUE(SameBits(&none[i], &got[i], 1))
              << "sequence " << b << " at " << i;
        }
      }
    }
  }
}

// pages_per_share: each sequence is split by its own page count, so its
// output is bit-identical alone or batched, whatever num_splits covers it,
// and matches the CPU reference.
TEST_F(KvCudaTest, AttentionPagesPerShareIsBatchInvariant) {
  const int T = 16, H = 2, D = 128, group = 4, n_q = H * group, pps = 8;
  const PageShape s{T, H, D};
  std::mt19937 rng(2024);
  const size_t tok = static_cast<size_t>(H) * D;
  const std::vector<Encoding> encs = {Format::kINT4, Format::kBF16,
                                      Format::kTQ4};
  const std::vector<int> page_counts = {9, 40, 130};
  const int batch = static_cast<int>(page_counts.size());
  Pool pool;
  std::vector<uint8_t> host_pool;
  std::vector<int32_t> first_page, attend;
  std::vector<std::vector<PageRef>> refs(batch);
  std::vector<std::vector<size_t>> ref_offsets(batch);
  for (int b = 0; b < batch; ++b) {
    first_page.push_back(static_cast<int32_t>(pool.formats.size()));
    for (int i = 0; i < page_counts[b]; ++i) {
      const Encoding e = encs[(i / 5 + b) % encs.size()];
      const auto kk = testing::RandomBf16(rng, T * tok);
      const auto vv = testing::RandomBf16(rng, T * tok);
      std::vector<uint8_t> page(PageBytes(e, s));
      EncodePage(e, s, kk.data(), vv.data(), T, page.data());
      ref_offsets[b].push_back(host_pool.size());
      refs[b].push_back(PageRef{e, nullptr, T});
      pool.Add(e, T, s);
      host_pool.insert(host_pool.end(), page.begin(), page.end());
    }
    attend.push_back(page_counts[b] * T - 5);
  }
  for (int b = 0; b < batch; ++b) {
    for (size_t i = 0; i < refs[b].size(); ++i)
      refs[b][i].data = host_pool.data() + ref_offsets[b][i];
  }
  const auto q =
      testing::RandomFloat(rng, static_cast<size_t>(batch) * n_q * D);
  DeviceBuffer d_pool(pool.bytes);
  d_pool.Upload(host_pool);
  const auto table = pool.Table(d_pool.as<uint8_t>());
  const size_t per_seq = static_cast<size_t>(n_q) * D;
  // Runs sequences `seqs` as one batch; returns their outputs in order.
  auto run = [&](const std::vector<int>& seqs, int splits) {
    std::vector<DevicePage> t;
    std::vector<int32_t> indptr = {0}, att;
    std::vector<float> qb;
    for (int b : seqs) {
      t.insert(t.end(), table.begin() + first_page[b],
               table.begin() + first_page[b] + page_counts[b]);
      indptr.push_back(static_cast<int32_t>(t.size()));
      att.push_back(attend[b]);
      qb.insert(qb.end(), q.begin() + b * per_seq,
                q.begin() + (b + 1) * per_seq);
    }
    DeviceBuffer d_t(t.size() * sizeof(DevicePage)), d_i(indptr.size() * 4),
        d_a(att.size() * 4), d_q(qb.size() * 4), d_o(qb.size() * 4);
    d_t.Upload(t);
    d_i.Upload(indptr);
    d_a.Upload(att);
    d_q.Upload(qb);
    d_o.Upload(std::vector<float>(qb.size(), 12345.f));
    AttentionParams p = DeviceAttention(s, static_cast<int>(seqs.size()), n_q,
                                        d_q, d_o, d_t, d_i, d_a);
    p.num_splits = splits;
    p.pages_per_share = pps;
    EXPECT_THAT(DecodeAttentionCuda(p), IsOk());
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return d_o.Download<float>(qb.size());
  };
  // Splits that cover sequence b's shares: ceil(ceil(pages / pps) / 4).
  auto needed = [&](int b) {
    return ((page_counts[b] + pps - 1) / pps + 3) / 4;
  };
  std::vector<std::vector<float>> alone(batch);
  for (int b = 0; b < batch; ++b) alone[b] = run({b}, needed(b));
  for (int splits : {needed(2), needed(2) + 7}) {
    SCOPED_TRACE(::testing::Message() << "num_splits " << splits);
    const auto all = run({0, 1, 2}, splits);
    const auto rev = run({2, 0}, splits);
    for (int b = 0; b < batch; ++b) {
      ASSERT_TRUE(SameBits(all.data() + b * per_seq, alone[b].data(), per_seq))
          << "sequence " << b << " batched vs alone";
    }
    ASSERT_TRUE(SameBits(rev.data(), alone[2].data(), per_seq));
    ASSERT_TRUE(SameBits(rev.data() + per_seq, alone[0].data(), per_seq));
  }
  for (int b = 0; b < batch; ++b) {
    std::vector<float> ref_out(per_seq, NAN);
    DecodeParams rp;
    rp.q = q.data() + b * per_seq;
    rp.out = ref_out.data();
    rp.n_q_heads = n_q;
    rp.shape = s;
    rp.scale = 1.f / std::sqrt(static_cast<float>(D));
    rp.pages = refs[b].data();
    rp.num_pages = static_cast<int>(refs[b].size());
    rp.attend_tokens = attend[b];
    DecodeAttentionRef(rp);
    const auto vs_ref = testing::Compare(
        alone[b].data(), std::vector<double>(ref_out.begin(), ref_out.end()));
    ASSERT_TRUE(vs_ref.all_finite);
    EXPECT_LE(vs_ref.max_abs, AttentionTolerance(D)) << "sequence " << b;
  }
}

// In-place demotion of pages of every format to every other, against
// DecodePage -> round to BF16 -> EncodePage on the CPU (bytes equal).
TEST_F(KvCudaTest, DemoteMatchesReferenceBytes) {
  const uint32_t seed = 404;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  for (const PageShape& s :
       {PageShape{16, 2, 128}, PageShape{7, 3, 64}, PageShape{16, 1, 24}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << s.tokens << " H=" << s.heads
                                      << " D=" << s.head_dim);
    const std::vector<Encoding> encs = ValidEncodings(s);
    std::vector<std::pair<Encoding, Encoding>> pairs;
    for (const Encoding& a : encs)
      for (const Encoding& b : encs) pairs.emplace_back(a, b);
    const int num_pages = static_cast<int>(pairs.size());
    const size_t page_elems =
        static_cast<size_t>(s.tokens) * s.heads * s.head_dim;
    const size_t slot = PageBytes(Format::kBF16, s);  // largest page
    std::vector<uint8_t> host(slot * num_pages, 0);
    std::vector<DevicePage> src, dst;
    std::vector<std::vector<uint8_t>> want(num_pages);
    std::uniform_int_distribution<int> ntok(1, s.tokens);
    DeviceBuffer d_pool(host.size());
    for (int i = 0; i < num_pages; ++i) {
      const auto [from, to] = pairs[i];
      const int n = i % 2 == 0 ? s.tokens : ntok(rng);
      const auto k = testing::RandomBf16(
          rng, static_cast<size_t>(n) * s.heads * s.head_dim);
      const auto v = testing::RandomBf16(
          rng, static_cast<size_t>(n) * s.heads * s.head_dim);
      EncodePage(from, s, k.data(), v.data(), n, host.data() + i * slot);
      std::vector<float> fk(page_elems), fv(page_elems);
      DecodePage(from, s, host.data() + i * slot, n, fk.data(), fv.data());
      std::vector<uint16_t> bk(page_elems), bv(page_elems);
      for (size_t j = 0; j < page_elems; ++j) {
        bk[j] = FloatToBf16(fk[j]);
        bv[j] = FloatToBf16(fv[j]);
      }
      want[i].resize(PageBytes(to, s));
      EncodePage(to, s, bk.data(), bv.data(), n, want[i].data());
      uint8_t* at = d_pool.as<uint8_t>() + i * slot;
      src.push_back(DevicePage{at, n, PackEncoding(from)});
      dst.push_back(DevicePage{at, 0, PackEncoding(to)});
    }
    d_pool.Upload(host);
    DeviceBuffer d_src(src.size() * sizeof(DevicePage)),
        d_dst(dst.size() * sizeof(DevicePage));
    d_src.Upload(src);
    d_dst.Upload(dst);
    const size_t sb = DemoteScratchBytes(s, num_pages);
    DeviceBuffer scratch(sb);
    DemotePagesParams p;
    p.shape = s;
    p.src = d_src.as<DevicePage>();
    p.dst = d_dst.as<DevicePage>();
    p.num_pages = num_pages;
    p.scratch = scratch.as<void>();
    p.scratch_bytes = sb - 1;
    EXPECT_THAT(DemotePagesCuda(p), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr("scratch")));
    p.scratch_bytes = sb;
    ASSERT_THAT(DemotePagesCuda(p), IsOk());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto got = d_pool.Download<uint8_t>(host.size());
    int bad_pages = 0;
    for (int i = 0; i < num_pages; ++i) {
      char a[64], b[64];
      const int diff =
          static_cast<int>(std::count_if(want[i].begin(), want[i].end(),
                                         [&, j = size_t{0}](uint8_t w) mutable {
                                           return got[i * slot + j++] != w;
                                         }));
      if (diff != 0) ++bad_pages;
      EXPECT_EQ(diff, 0) << EncodingName(pairs[i].first, a, sizeof(a)) << " -> "
                         << EncodingName(pairs[i].second, b, sizeof(b));
    }
    std::printf("demote %d pairs, %d pages differ\n", num_pages, bad_pages);
  }
}

// Validation happens on the host before any CUDA call, so these run (and
// must pass) on machines without a GPU too.
TEST(KvCudaValidationTest, RejectsBadShapes) {
  AttentionParams p;
  p.shape = PageShape{16, 2, 12};
  p.n_q_heads = 4;
  p.batch = 1;
  EXPECT_THAT(
      DecodeAttentionCuda(p),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("head_dim")));
  p.shape = PageShape{16, 2, 512};
  EXPECT_THAT(DecodeAttentionCuda(p),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("512")));
  p.shape = PageShape{16, 2, 128};
  p.n_q_heads = 3;
  EXPECT_THAT(
      DecodeAttentionCuda(p),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("n_q_heads")));
  p.n_q_heads = 2 * 64;  // group 64 x D 128 > 4096
  EXPECT_THAT(DecodeAttentionCuda(p),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("8192")));
  p.n_q_heads = 4;
  EXPECT_THAT(
      DecodeAttentionCuda(p),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("non-null")));
  p.pages_per_share = -3;
  EXPECT_THAT(DecodeAttentionCuda(p),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("pages_per_share must be >= 0, got -3")));
  p.pages_per_share = 0;
  p.formats_present = 1u << 9;
  EXPECT_THAT(DecodeAttentionCuda(p),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("formats_present has bits outside")));
  p.formats_present = 0;

  EncodePagesParams e;
  e.shape = PageShape{0, 2, 128};
  e.num_pages = 1;
  EXPECT_THAT(EncodePagesCuda(e), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("shape.tokens")));
  e.shape = PageShape{16, 2, 128};
  EXPECT_THAT(EncodePagesCuda(e), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("non-null")));
  e.num_pages = 0;
  EXPECT_THAT(EncodePagesCuda(e), IsOk());  // nothing to do

  DecodePagesParams d;
  d.shape = PageShape{16, 0, 128};
  EXPECT_THAT(DecodePagesCuda(d), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("shape.heads")));
}

// Host-only: which kernel a page's encoding goes to. The transposed
// kernel takes INT/FP8 keys with INT/FP8 values (classes 1-4 by K format)
// and TQ4/TQ2 keys with TQ4/TQ2 values (5, 7) from head_dim 64; every
// other page goes to the full kernel (class 0, or 6 for TQ keys).
TEST(KvCudaSchedulingTest, ClassOfRoutesEncodings) {
  using internal::AttentionClassOf;
  auto cls = [](Encoding e, int d) {
    return AttentionClassOf(PackEncoding(e), d);
  };
  EXPECT_EQ(cls(Format::kBF16, 128), 0);
  EXPECT_EQ(cls(Format::kINT4, 128), 1);
  EXPECT_EQ(cls(Format::kINT2, 128), 2);
  EXPECT_EQ(cls(Format::kFP8, 128), 3);
  EXPECT_EQ(cls(Format::kINT8, 128), 4);
  EXPECT_EQ(cls(Format::kTQ4, 128), 5);
  EXPECT_EQ(cls(Format::kTQ3, 128), 6);
  EXPECT_EQ(cls(Format::kTQ2, 128), 7);
  // Mixed INT/FP8 pairs stay transposed; group and scale dtype do not
  // matter.
  EXPECT_EQ(
      cls(Encoding(Format::kINT4, Format::kINT2, 64, ScaleDtype::kFP8), 128),
      1);
  EXPECT_EQ(cls(Encoding(Format::kFP8, Format::kINT4), 64), 3);
  EXPECT_EQ(cls(Encoding(Format::kTQ4, Format::kTQ2), 256), 5);
  // Values the transposed kernel cannot build fall back.
  EXPECT_EQ(cls(Encoding(Format::kINT4, Format::kBF16), 128), 0);
  EXPECT_EQ(cls(Encoding(Format::kINT8, Format::kTQ4), 128), 0);
  EXPECT_EQ(cls(Encoding(Format::kTQ4, Format::kINT4), 128), 6);
  EXPECT_EQ(cls(Encoding(Format::kTQ2, Format::kTQ3), 128), 6);
  EXPECT_EQ(cls(Encoding(Format::kBF16, Format::kINT4), 128), 0);
  // Below head_dim 64 there is no transposed kernel: K format decides.
  EXPECT_EQ(cls(Format::kINT4, 32), 0);
  EXPECT_EQ(cls(Format::kFP8, 16), 0);
  EXPECT_EQ(cls(Format::kTQ4, 32), 5);
  EXPECT_EQ(cls(Encoding(Format::kTQ4, Format::kINT4), 32), 5);
}

// Host-only: formats_present bits are the classes' bits.
TEST(KvCudaSchedulingTest, FormatBitIsTheClassBit) {
  for (int d : {16, 64, 128, 256}) {
    for (Format f : kAllFormats) {
      const int32_t packed = PackEncoding(Encoding(f));
      EXPECT_EQ(AttentionFormatBit(packed, d),
                1u << internal::AttentionClassOf(packed, d));
    }
  }
  EXPECT_NE(AttentionFormatBit(PackEncoding(Format::kINT4), 128),
            AttentionFormatBit(PackEncoding(Format::kINT2), 128));
  EXPECT_EQ(AttentionFormatBit(PackEncoding(Format::kINT4), 32),
            AttentionFormatBit(PackEncoding(Format::kBF16), 32));
}

// Host-only: every head_dim the shape checks accept has a kernel, the
// tensor-core ones exactly for 16..256 powers of two, and any other value
// is INVALID_ARGUMENT naming it (never a silent fallback to another size).
TEST(KvCudaSchedulingTest, EveryHeadDimHasOneKernel) {
  using internal::AttentionKernelFor;
  for (int d = 8; d <= 256; d += 8) {
    bool tensor_cores = false;
    ASSERT_TRUE(AttentionKernelFor(d, &tensor_cores).ok()) << d;
    EXPECT_EQ(tensor_cores,
              d == 16 || d == 32 || d == 64 || d == 128 || d == 256)
        << d;
  }
  for (int d : {0, 4, 12, 100, 264, 512}) {
    bool tensor_cores = false;
    EXPECT_THAT(AttentionKernelFor(d, &tensor_cores),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat(
                             "shape.head_dim=", d,
                             " has no attention kernel instantiation"))));
  }
}

// Host-only: the split count per launch fills its waves (H100: 132 SMs).
TEST(KvCudaSchedulingTest, SplitsFillWaves) {
  using internal::AttentionSplitsFor;
  // batch 16 x 8 KV heads = 128 CTAs per split: 2 / 3 / 4 splits for 2 / 3
  // / 4 resident CTAs per SM (256 of 264, 384 of 396, 512 of 528 slots).
  EXPECT_EQ(AttentionSplitsFor(128, 2, 132), 2);
  EXPECT_EQ(AttentionSplitsFor(128, 3, 132), 3);
  EXPECT_EQ(AttentionSplitsFor(128, 4, 132), 4);
  // batch 64 x 8 heads: one split fills two waves of 264 to 97%; at 3 per
  // SM, 1 split (512 of 792) and 2 (1024 of 1188) are under 90%, 3 is 97%.
  EXPECT_EQ(AttentionSplitsFor(512, 2, 132), 1);
  EXPECT_EQ(AttentionSplitsFor(512, 3, 132), 3);
  // batch 16 x 4 heads.
  EXPECT_EQ(AttentionSplitsFor(64, 2, 132), 4);
  EXPECT_EQ(AttentionSplitsFor(64, 3, 132), 6);
  EXPECT_EQ(AttentionSplitsFor(64, 4, 132), 8);
  // Batch 1: no split count fills a wave, so the most CTAs.
  EXPECT_EQ(AttentionSplitsFor(2, 4, 132), 64);
  // Large grids need no split.
  EXPECT_EQ(AttentionSplitsFor(100000, 2, 132), 1);
  // Every choice is in range and fills >= 90% when any count can.
  for (long long ctas : {1LL, 3LL, 17LL, 96LL, 250LL, 1000LL, 4097LL}) {
    for (int per_sm : {1, 2, 3, 4}) {
      const int s = AttentionSplitsFor(ctas, per_sm, 132);
      ASSERT_GE(s, 1);
      ASSERT_LE(s, 64);
      const long long slots = 132LL * per_sm, n = ctas * s;
      const long long waves = (n + slots - 1) / slots;  // rounded up
      const double fill = double(n) / double(waves * slots);
      if (ctas * 64 >= slots) {
        EXPECT_GE(fill, 0.9) << ctas << " CTAs, " << per_sm << " per SM";
      }
    }
  }
}

// Host-only: which encodings the kernels take, and that the layout they
// compute on the device is ComputeLayout's.
TEST(KvCudaValidationTest, EncodingSupportAndLayout) {
  const PageShape s{16, 2, 128};
  EXPECT_THAT(CheckEncodingCuda(Format::kTQ4, s), IsOk());
  EXPECT_THAT(CheckEncodingCuda(Encoding(Format::kINT4, Format::kTQ2), s),
              IsOk());
  EXPECT_THAT(
      CheckEncodingCuda(Format::kTQ3, PageShape{16, 2, 24}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("power-of-two")));
  EXPECT_THAT(CheckEncodingCuda(Encoding(Format::kINT4, Format::kINT4, 48), s),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("group must be 32, 64 or 128")));
  EXPECT_THAT(
      CheckEncodingCuda(Format::kINT4, PageShape{16, 2, 12}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("head_dim")));
  EXPECT_EQ(PackEncoding(Format::kINT4), 2 | (2 << 8) | (32 << 16) | (1 << 24));
  for (Format fk : kAllFormats) {
    for (Format fv : kAllFormats) {
      for (int g : {0, 64, 128}) {
        for (ScaleDtype sd : {ScaleDtype::kFP16, ScaleDtype::kFP8}) {
          for (const PageShape& sh :
               {PageShape{16, 2, 128}, PageShape{7, 3, 8}, PageShape{64, 1, 24},
                PageShape{1, 4, 256}}) {
            const Encoding e(fk, fv, g, sd);
            if (!CheckEncodingCuda(e, sh).ok()) continue;
            const PageLayout a = CudaPageLayout(e, sh),
                             b = ComputeLayout(e, sh);
            ASSERT_EQ(0, std::memcmp(&a, &b, sizeof(a)));
          }
        }
      }
    }
  }
  for (const Encoding& e : CudaEncodings()) {
    EXPECT_THAT(CheckEncodingCuda(e, s), IsOk());
  }
}

}  // namespace
}  // namespace triax::kernels::cuda
