// attention_bench: times DecodeAttentionCuda over paged KV of every format
// (and a mixed pool with a random encoding per page) on the local GPU, and
// quantize-on-write (EncodePagesCuda) and demotion (DemotePagesCuda).
//
// Method: pages are encoded from random BF16 data (a template of distinct
// pages, replicated over the pool), each sequence's block table is a random
// permutation of pool pages, CUDA events time each call after warm-up and the
// median over --iters calls is reported. Calls rotate through several
// disjoint page sets so that the bytes touched between two reuses exceed
// 4x the L2 size. Every figure is also given as a fraction of a plain
// streaming read (and device-to-device copy) measured in the same run.
//
// Flags: --iters N (default 30)  --quick (batch 16, 32k only)
//        --batch N, --context N (only that batch / context in the sweep)
//        --format NAME (only that row of the decode table, e.g. int4)
//        --no_format_hint (launch every kernel configuration)
//        --splits_sweep (time num_splits 0 (auto), 1..24 on four shapes)
// Output: markdown tables on stdout.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/kv_cuda.cuh"
#include "kernels/layout.h"
#include "kernels/numeric.h"

namespace {

using triax::kernels::Encoding;
using triax::kernels::Format;
using triax::kernels::PageBytes;
using triax::kernels::PageShape;
namespace kc = triax::kernels::cuda;

#define CK(x)                                                        \
  do {                                                               \
    cudaError_t e_ = (x);                                            \
    if (e_ != cudaSuccess) {                                         \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, \
                   cudaGetErrorString(e_));                          \
      std::exit(1);                                                  \
    }                                                                \
  } while (0)
#define CKS(x)                                               \
  do {                                                       \
    absl::Status s_ = (x);                                   \
    if (!s_.ok()) {                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, \
                   std::string(s_.message()).c_str());       \
      std::exit(1);                                          \
    }                                                        \
  } while (0)

__global__ void StreamRead(const uint4* __restrict__ p, size_t n,
                           unsigned* sink) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint4 v = __ldg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) *sink = acc;  // keeps the loads
}

int g_iters = 30;

// Median milliseconds of fn() over g_iters calls after 3 warm-ups.
template <typename Fn>
double TimeMs(Fn fn) {
  for (int i = 0; i < 3; ++i) fn(i);
  CK(cudaDeviceSynchronize());
  std::vector<float> ms;
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < g_iters; ++i) {
    CK(cudaEventRecord(a));
    fn(i);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float t = 0;
    CK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct Fmt {
  const char* name;
  bool mixed;
  Format f;
};
const Fmt kFmts[] = {
    {"bf16", false, Format::kBF16}, {"fp8", false, Format::kFP8},
    {"int8", false, Format::kINT8}, {"int4", false, Format::kINT4},
    {"int2", false, Format::kINT2}, {"tq4", false, Format::kTQ4},
    {"mixed", true, Format::kBF16}};
const Format kMixChoices[] = {Format::kBF16, Format::kFP8,  Format::kINT8,
                              Format::kINT4, Format::kINT2, Format::kTQ4};

// A pool of encoded pages: a template of `tpl` distinct pages encoded from
// random BF16, replicated over `count` slots of `stride` bytes.
struct Pool {
  uint8_t* base = nullptr;
  size_t capacity = 0;
};

struct Filled {
  size_t stride = 0;
  std::vector<int32_t> formats;  // per slot (packed)
  std::vector<size_t> bytes;     // per slot
};

Filled FillPool(const Pool& pool, const PageShape& s, const Fmt& fmt,
                size_t count, uint16_t* d_k, uint16_t* d_v, int tpl,
                kc::DevicePage* d_table, std::mt19937& rng) {
  Filled out;
  out.stride =
      PageBytes(fmt.mixed ? Encoding(Format::kBF16) : Encoding(fmt.f), s);
  if (count * out.stride > pool.capacity) {
    std::fprintf(stderr, "pool too small\n");
    std::exit(1);
  }
  std::uniform_int_distribution<int> pick(0, 5);
  std::vector<kc::DevicePage> t(tpl);
  std::vector<int32_t> tf(tpl);
  for (int i = 0; i < tpl; ++i) {
    const Format f = fmt.mixed ? kMixChoices[pick(rng)] : fmt.f;
    tf[i] = kc::PackEncoding(f);
    t[i] = kc::DevicePage{pool.base + i * out.stride, s.tokens, tf[i]};
  }
  CK(cudaMemcpy(d_table, t.data(), tpl * sizeof(kc::DevicePage),
                cudaMemcpyHostToDevice));
  kc::EncodePagesParams ep;
  ep.shape = s;
  ep.pages = d_table;
  ep.num_pages = tpl;
  ep.k_bf16 = d_k;
  ep.v_bf16 = d_v;
  CKS(kc::EncodePagesCuda(ep));
  const size_t block = static_cast<size_t>(tpl) * out.stride;
  for (size_t at = tpl; at < count; at += tpl) {
    const size_t n = std::min<size_t>(tpl, count - at);
    CK(cudaMemcpyAsync(pool.base + at * out.stride, pool.base, n * out.stride,
                       cudaMemcpyDeviceToDevice));
  }
  (void)block;
  CK(cudaDeviceSynchronize());
  out.formats.resize(count);
  out.bytes.resize(count);
  for (size_t i = 0; i < count; ++i) {
    out.formats[i] = tf[i % tpl];
    const Format f = static_cast<Format>(tf[i % tpl] & 0xff);
    out.bytes[i] = PageBytes(Encoding(f), s);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, sweep = false;
  int only_batch = 0, only_ctx = 0;
  bool format_hint = true;  // AttentionParams::formats_present
  const char* only_fmt = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) {
      g_iters = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--batch") && i + 1 < argc) {
      only_batch = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--context") && i + 1 < argc) {
      only_ctx = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--format") && i + 1 < argc) {
      only_fmt = argv[++i];
    } else if (!std::strcmp(argv[i], "--quick")) {
      quick = true;
    } else if (!std::strcmp(argv[i], "--no_format_hint")) {
      format_hint = false;
    } else if (!std::strcmp(argv[i], "--splits_sweep")) {
      sweep = true;
    } else {
      std::fprintf(stderr, "unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %d MB\n\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize >> 20);

  const int D = 128, T = 16, NQ = 32;
  // Pool big enough for batch 64 x 128k BF16 with 8 KV heads (one layer).
  const size_t max_pages = 64 * (131072 / T);
  const size_t bf16_page8 =
      PageBytes(Encoding(Format::kBF16), PageShape{T, 8, D});
  Pool pool;
  pool.capacity = max_pages * bf16_page8;
  CK(cudaMalloc(&pool.base, pool.capacity));
  std::printf(
      "pool: %.1f GiB (batch 64 x 128k BF16 x 8 KV heads fits: one "
      "layer, K and V)\n\n",
      pool.capacity / double(1 << 30));

  // Streaming read and D2D copy of 1 GiB.
  const size_t sbytes = size_t{1} << 30;
  unsigned* sink;
  CK(cudaMalloc(&sink, 4));
  uint8_t* other;
  CK(cudaMalloc(&other, sbytes));
  CK(cudaMemset(pool.base, 1, sbytes));
  const double read_ms = TimeMs([&](int) {
    StreamRead<<<prop.multiProcessorCount * 8, 512>>>(
        reinterpret_cast<const uint4*>(pool.base), sbytes / 16, sink);
  });
  const double copy_ms = TimeMs([&](int) {
    CK(cudaMemcpyAsync(other, pool.base, sbytes, cudaMemcpyDeviceToDevice));
  });
  CK(cudaFree(other));
  const double read_bw = sbytes / read_ms / 1e6;  // GB/s
  std::printf(
      "streaming read: %.0f GB/s; device-to-device copy (read + "
      "write): %.0f GB/s\n\n",
      read_bw, 2.0 * sbytes / copy_ms / 1e6);

  std::mt19937 rng(12345);
  const int tpl = 4096;
  uint16_t *d_k, *d_v;
  const size_t tpl_elems = static_cast<size_t>(tpl) * T * 8 * D;
  CK(cudaMalloc(&d_k, tpl_elems * 2));
  CK(cudaMalloc(&d_v, tpl_elems * 2));
  {
    std::vector<uint16_t> h(tpl_elems);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& x : h) x = triax::kernels::FloatToBf16(nd(rng));
    CK(cudaMemcpy(d_k, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    for (auto& x : h) x = triax::kernels::FloatToBf16(nd(rng));
    CK(cudaMemcpy(d_v, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  }
  kc::DevicePage* d_tpl;
  CK(cudaMalloc(&d_tpl, tpl * sizeof(kc::DevicePage)));

  // Quantize-on-write and demotion: tpl pages of 16 tokens x 8 heads x 128.
  std::printf(
      "## Quantize-on-write (EncodePagesCuda), %d pages of 16 tokens "
      "x 8 KV heads x D 128, one launch\n\n",
      tpl);
  std::printf(
      "| format | ms | BF16 in GB/s | pages out GB/s | (in+out) / "
      "stream read |\n|---|---|---|---|---|\n");
  const PageShape s8{T, 8, D};
  for (const Fmt& fmt : kFmts) {
    if (fmt.mixed) continue;
    const size_t pb = PageBytes(Encoding(fmt.f), s8);
    std::vector<kc::DevicePage> t(tpl);
    for (int i = 0; i < tpl; ++i)
      t[i] = kc::DevicePage{pool.base + i * pb, T, kc::PackEncoding(fmt.f)};
    CK(cudaMemcpy(d_tpl, t.data(), tpl * sizeof(kc::DevicePage),
                  cudaMemcpyHostToDevice));
    kc::EncodePagesParams ep;
    ep.shape = s8;
    ep.pages = d_tpl;
    ep.num_pages = tpl;
    ep.k_bf16 = d_k;
    ep.v_bf16 = d_v;
    const double ms = TimeMs([&](int) { CKS(kc::EncodePagesCuda(ep)); });
    const double in = 2.0 * tpl_elems * 2, outb = double(pb) * tpl;
    std::printf("| %s | %.3f | %.0f | %.0f | %.2f |\n", fmt.name, ms,
                in / ms / 1e6, outb / ms / 1e6,
                (in + outb) / ms / 1e6 / read_bw);
  }
  {  // demote bf16 -> int4 and int4 -> int2, in place
    void* scratch;
    const size_t sb = kc::DemoteScratchBytes(s8, tpl);
    CK(cudaMalloc(&scratch, sb));
    std::printf(
        "\n## Demotion in place (DemotePagesCuda), %d pages, one "
        "launch\n\n| from -> to | ms | pages/s |\n|---|---|---|\n",
        tpl);
    for (auto [from, to] : {std::pair{Format::kBF16, Format::kINT4},
                            std::pair{Format::kINT4, Format::kINT2},
                            std::pair{Format::kBF16, Format::kTQ4}}) {
      const size_t pb = PageBytes(Encoding(Format::kBF16), s8);
      std::vector<kc::DevicePage> src(tpl), dst(tpl);
      for (int i = 0; i < tpl; ++i) {
        src[i] = kc::DevicePage{pool.base + i * pb, T, kc::PackEncoding(from)};
        dst[i] = kc::DevicePage{pool.base + i * pb, T, kc::PackEncoding(to)};
      }
      kc::DevicePage* d_src;
      kc::DevicePage* d_dst;
      CK(cudaMalloc(&d_src, tpl * sizeof(kc::DevicePage)));
      CK(cudaMalloc(&d_dst, tpl * sizeof(kc::DevicePage)));
      CK(cudaMemcpy(d_src, src.data(), tpl * sizeof(kc::DevicePage),
                    cudaMemcpyHostToDevice));
      CK(cudaMemcpy(d_dst, dst.data(), tpl * sizeof(kc::DevicePage),
                    cudaMemcpyHostToDevice));
      kc::DemotePagesParams dp;
      dp.shape = s8;
      dp.src = d_src;
      dp.dst = d_dst;
      dp.num_pages = tpl;
      dp.scratch = scratch;
      dp.scratch_bytes = sb;
      // Re-encode the source format before every call (not timed apart:
      // the table reports demote alone by timing encode+demote minus encode).
      kc::EncodePagesParams ep;
      ep.shape = s8;
      ep.pages = d_src;
      ep.num_pages = tpl;
      ep.k_bf16 = d_k;
      ep.v_bf16 = d_v;
      const double enc = TimeMs([&](int) { CKS(kc::EncodePagesCuda(ep)); });
      const double both = TimeMs([&](int) {
        CKS(kc::EncodePagesCuda(ep));
        CKS(kc::DemotePagesCuda(dp));
      });
      const double ms = both - enc;
      std::printf("| %s -> %s | %.3f | %.2fM |\n",
                  triax::kernels::FormatName(from),
                  triax::kernels::FormatName(to), ms, tpl / ms / 1e3);
      CK(cudaFree(d_src));
      CK(cudaFree(d_dst));
    }
    CK(cudaFree(scratch));
  }

  // Attention.
  std::printf(
      "\n## Decode attention (DecodeAttentionCuda), 32 query heads, D "
      "128, pages of 16 tokens x H KV heads, random block tables\n\n");
  std::printf(
      "| batch | context | GQA | H | format | GB read/call | ms | GB/s "
      "| / stream read | speed-up vs bf16 |\n|---|---|---|---|---|---|---"
      "|---|---|---|\n");
  const std::vector<int> batches = only_batch > 0 ? std::vector<int>{only_batch}
                                   : quick        ? std::vector<int>{16}
                                                  : std::vector<int>{16, 64};
  const std::vector<int> ctxs = only_ctx > 0 ? std::vector<int>{only_ctx}
                                : quick      ? std::vector<int>{32768}
                                        : std::vector<int>{8192, 32768, 131072};
  float *d_q, *d_out;
  CK(cudaMalloc(&d_q, 64 * NQ * D * 4));
  CK(cudaMalloc(&d_out, 64 * NQ * D * 4));
  {
    std::vector<float> q(64 * NQ * D);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& x : q) x = nd(rng);
    CK(cudaMemcpy(d_q, q.data(), q.size() * 4, cudaMemcpyHostToDevice));
  }
  int32_t *d_indptr, *d_attend;
  CK(cudaMalloc(&d_indptr, 65 * 4));
  CK(cudaMalloc(&d_attend, 64 * 4));
  kc::DevicePage* d_pages;
  const int max_rot = 64;
  CK(cudaMalloc(&d_pages, max_pages * sizeof(kc::DevicePage)));
  void* ws;
  size_t ws_bytes = size_t{256} << 20;  // grown when a call needs more
  CK(cudaMalloc(&ws, ws_bytes));

  auto run_config = [&](int B, int ctx, int group, const Fmt& fmt, int splits,
                        double* bf16_ms) {
    const int H = NQ / group;
    const PageShape s{T, H, D};
    const int P = ctx / T;
    const size_t stride_bf16 = PageBytes(Encoding(Format::kBF16), s);
    size_t slots = pool.capacity / stride_bf16;  // mixed uses BF16 stride
    const Filled fill = FillPool(
        pool, s, fmt,
        std::min(slots,
                 pool.capacity / PageBytes(fmt.mixed ? Encoding(Format::kBF16)
                                                     : Encoding(fmt.f),
                                           s)),
        d_k, d_v, tpl, d_tpl, rng);
    slots = fill.formats.size();
    const size_t per_call_pages = static_cast<size_t>(B) * P;
    // Rotation: enough disjoint page sets that 4x L2 is touched between reuses.
    double bytes_call = 0;
    for (size_t i = 0; i < per_call_pages; ++i)
      bytes_call += fill.bytes[i % slots];
    int rot = static_cast<int>(std::ceil(4.0 * prop.l2CacheSize / bytes_call));
    rot = std::max(
        1, std::min({rot, max_rot, static_cast<int>(slots / per_call_pages)}));
    if (per_call_pages * rot > max_pages)
      rot = static_cast<int>(max_pages / per_call_pages);
    // Random permutation of the first rot * per_call_pages slots.
    std::vector<uint32_t> perm(per_call_pages * rot);
    for (size_t i = 0; i < perm.size(); ++i) perm[i] = static_cast<uint32_t>(i);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<kc::DevicePage> table(perm.size());
    bytes_call = 0;
    for (size_t i = 0; i < perm.size(); ++i) {
      table[i] = kc::DevicePage{pool.base + perm[i] * fill.stride, T,
                                fill.formats[perm[i]]};
      if (i < per_call_pages) bytes_call += fill.bytes[perm[i]];
    }
    CK(cudaMemcpy(d_pages, table.data(), table.size() * sizeof(kc::DevicePage),
                  cudaMemcpyHostToDevice));
    std::vector<int32_t> indptr(B + 1), attend(B, ctx);
    for (int b = 0; b <= B; ++b) indptr[b] = b * P;
    CK(cudaMemcpy(d_indptr, indptr.data(), indptr.size() * 4,
                  cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_attend, attend.data(), attend.size() * 4,
                  cudaMemcpyHostToDevice));
    kc::AttentionParams p;
    p.shape = s;
    p.batch = B;
    p.n_q_heads = NQ;
    p.scale = 1.f / std::sqrt(float(D));
    p.q = d_q;
    p.out = d_out;
    p.page_indptr = d_indptr;
    p.attend_tokens = d_attend;
    p.num_splits = splits;
    // The pool's formats, as a caller that knows its pages would pass them.
    p.formats_present = 0;
    if (format_hint) {
      for (Format f : fmt.mixed ? std::vector<Format>(std::begin(kMixChoices),
                                                      std::end(kMixChoices))
                                : std::vector<Format>{fmt.f}) {
        p.formats_present |=
            kc::AttentionFormatBit(kc::PackEncoding(Encoding(f)), D);
      }
    }
    if (const size_t need = kc::AttentionWorkspaceBytes(p); need > ws_bytes) {
      CK(cudaFree(ws));
      ws_bytes = need;
      CK(cudaMalloc(&ws, ws_bytes));
    }
    p.workspace = ws;
    p.workspace_bytes = ws_bytes;
    const double ms = TimeMs([&](int i) {
      p.pages = d_pages + static_cast<size_t>(i % rot) * per_call_pages;
      CKS(kc::DecodeAttentionCuda(p));
    });
    bytes_call +=
        per_call_pages * sizeof(kc::DevicePage) + 2.0 * B * NQ * D * 4;
    const double bw = bytes_call / ms / 1e6;
    if (!fmt.mixed && fmt.f == Format::kBF16 && bf16_ms) *bf16_ms = ms;
    return std::pair<double, double>(ms, bw);
  };

  for (int B : batches) {
    for (int ctx : ctxs) {
      for (int group : {4, 8}) {
        double bf16_ms = 0;
        for (const Fmt& fmt : kFmts) {
          if (only_fmt != nullptr && std::strcmp(only_fmt, fmt.name) != 0)
            continue;
          const int H = NQ / group;
          auto [ms, bw] = run_config(B, ctx, group, fmt, 0, &bf16_ms);
          const double mb = bw * ms / 1e3;  // GB
          std::printf(
              "| %d | %dk | %d | %d | %s | %.1f | %.3f | %.0f | %.2f | %.2fx "
              "|\n",
              B, ctx / 1024, group, H, fmt.name, mb, ms, bw, bw / read_bw,
              bf16_ms / ms);
          std::fflush(stdout);
        }
      }
    }
  }
  if (sweep) {
    // num_splits 0 is the library's own choice (ChooseSplits).
    std::printf(
        "\n## num_splits sweep (32k; splits 0 = the library's choice)\n\n"
        "| batch | GQA | H | format | splits | ms | / stream read |\n"
        "|---|---|---|---|---|---|---|\n");
    for (int B : {16, 64}) {
      for (int group : {4, 8}) {
        for (const Fmt& fmt : {kFmts[0], kFmts[1], kFmts[3]}) {
          for (int sp : {0, 1, 2, 3, 4, 6, 8, 12, 16, 24}) {
            auto [ms, bw] = run_config(B, 32768, group, fmt, sp, nullptr);
            std::printf("| %d | %d | %d | %s | %d | %.3f | %.2f |\n", B, group,
                        NQ / group, fmt.name, sp, ms, bw / read_bw);
            std::fflush(stdout);
          }
        }
      }
    }
  }
  return 0;
}
