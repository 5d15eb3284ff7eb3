// DecodeAttentionCuda and its helpers (kv_cuda.cuh): validation, the one
// runtime head_dim -> kernel dispatch, the plan and workspace; then
// PartitionKernel, the head_dim's launches and ReduceKernel
// (attention_dispatch.h names the .cu file of each).
//
// head_dim dispatch: MmaHeadDims -> MmaAttention<D> (attention_hd<D>.cu,
// tensor cores), other multiples of 8 up to 256 -> the CUDA-core kernel
// (attention_fallback.cu); anything else is INVALID_ARGUMENT naming it.
#include "kernels/cuda/attention_dispatch.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/api_common.h"
#include "kernels/cuda/attention_plan.h"
#include "kernels/cuda/kv_cuda.cuh"
#include "kernels/cuda/launch_result.h"
#include "kernels/cuda/packed_encoding.h"

namespace triax::kernels::cuda {
namespace {

constexpr int kMaxGroupTimesDim = 4096;  // query heads per KV head x D

// ---- The one head_dim dispatch ------------------------------------------

// One head_dim's tensor-core kernels (MmaAttention<D>).
struct MmaKernels {
  int head_dim;
  LaunchResult (*ensure_tq_tables)();
  Residency (*query_residency)();
  LaunchResult (*launch)(const AttentionArgs&, const MmaPlan&,
                         const MmaWorkspace&, uint32_t*);
};

template <int... kDs>
constexpr std::array<MmaKernels, sizeof...(kDs)> MmaKernelTable(
    HeadDimList<kDs...>) {
  return {
      {{kDs, &MmaAttention<kDs>::EnsureTqTables,
        &MmaAttention<kDs>::QueryResidency, &MmaAttention<kDs>::Launch}...}};
}
constexpr auto kMmaKernels = MmaKernelTable(MmaHeadDims{});

// The kernels that serve a head_dim, the one runtime head_dim ->
// instantiation step of decode attention: MmaHeadDims -> their tensor-core
// kernels; the other multiples of 8 in [8, kMaxHeadDim] -> the CUDA-core
// kernel (nullptr); anything else (ValidateShape lets none through) ->
// INVALID_ARGUMENT naming the value.
absl::StatusOr<const MmaKernels*> KernelsFor(int head_dim) {
  for (const MmaKernels& k : kMmaKernels) {
    if (k.head_dim == head_dim) return &k;
  }
  if (head_dim >= 8 && head_dim <= kMaxHeadDim && head_dim % 8 == 0) {
    return nullptr;
  }
  std::string dims;
  for (const MmaKernels& k : kMmaKernels) {
    absl::StrAppend(&dims, dims.empty() ? "" : ", ", k.head_dim);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "shape.head_dim=", head_dim,
      " has no attention kernel instantiation (tensor cores: ", dims,
      "; CUDA cores: multiples of 8 in [8, ", kMaxHeadDim, "])"));
}

// Cached per (device, head_dim).
Residency ResidencyFor(const MmaKernels& k) {
  static std::mutex* mu = new std::mutex();
  static std::map<std::pair<int, int>, Residency>* cache =
      new std::map<std::pair<int, int>, Residency>();
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) cudaGetLastError();
  std::lock_guard<std::mutex> lock(*mu);
  const auto key = std::make_pair(dev, k.head_dim);
  auto it = cache->find(key);
  if (it != cache->end()) return it->second;
  const Residency r = k.query_residency();
  cache->emplace(key, r);
  return r;
}

MmaPlan PlanFor(const AttentionParams& p, const MmaKernels& k) {
  return PlanMma(p, p.num_splits > 0 ? Residency{} : ResidencyFor(k));
}

AttentionArgs ArgsOf(const AttentionParams& p) {
  AttentionArgs a;
  a.shape = p.shape;
  a.batch = p.batch;
  a.n_q_heads = p.n_q_heads;
  a.scale = p.scale;
  a.q = p.q;
  a.out = p.out;
  a.pages = p.pages;
  a.page_indptr = p.page_indptr;
  a.attend_tokens = p.attend_tokens;
  a.formats_present = p.formats_present;
  a.pages_per_share = p.pages_per_share;
  a.stream = p.stream;
  return a;
}

// Partition, the head_dim's launches, reduce.
absl::Status RunMma(const AttentionParams& p, const MmaPlan& plan,
                    const MmaKernels& k, void* ws) {
  const AttentionArgs a = ArgsOf(p);
  const MmaWorkspace w = CarveMmaWorkspace(p, plan, ws);
  TRIAX_RETURN_IF_ERROR(ToStatus(LaunchPartition(a, plan, w)));
  uint32_t launched = 0;
  TRIAX_RETURN_IF_ERROR(ToStatus(k.launch(a, plan, w, &launched)));
  return ToStatus(LaunchReduce(a, plan, w, launched));
}

}  // namespace

size_t AttentionWorkspaceBytes(const AttentionParams& p) {
  if (!ValidateShape(p.shape).ok() || p.batch <= 0 || p.n_q_heads < 1 ||
      p.n_q_heads % p.shape.heads != 0) {
    return 0;
  }
  const absl::StatusOr<const MmaKernels*> k = KernelsFor(p.shape.head_dim);
  return k.ok() && *k != nullptr ? PlanFor(p, **k).ws_bytes : 0;
}

uint32_t AttentionFormatBit(int32_t packed_format, int head_dim) {
  return 1u << ClassOf(packed_format, SmallOk(head_dim));
}

namespace internal {
absl::Status AttentionKernelFor(int head_dim, bool* tensor_cores) {
  TRIAX_ASSIGN_OR_RETURN(const MmaKernels* k, KernelsFor(head_dim));
  *tensor_cores = k != nullptr;
  return absl::OkStatus();
}
int AttentionClassOf(int32_t packed_format, int head_dim) {
  return ClassOf(packed_format, SmallOk(head_dim));
}
int AttentionSplitsFor(long long ctas, int ctas_per_sm, int sms) {
  return SplitsFor(ctas, ctas_per_sm, sms);
}
}  // namespace internal

absl::Status DecodeAttentionCuda(const AttentionParams& p) {
  if (absl::Status s = ValidateShape(p.shape); !s.ok()) return s;
  if (p.batch < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch must be >= 0, got ", p.batch));
  }
  if (p.pages_per_share < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("pages_per_share must be >= 0, got ", p.pages_per_share));
  }
  if ((p.formats_present >> kClasses) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "formats_present has bits outside AttentionFormatBit's 8: 0x",
        absl::Hex(p.formats_present)));
  }
  if (p.n_q_heads < 1 || p.n_q_heads % p.shape.heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("n_q_heads must be a positive multiple of KV heads ",
                     p.shape.heads, ", got ", p.n_q_heads));
  }
  const int group = p.n_q_heads / p.shape.heads;
  if (group * p.shape.head_dim > kMaxGroupTimesDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "(n_q_heads / heads) * head_dim must be <= ", kMaxGroupTimesDim,
        ", got ", group * p.shape.head_dim));
  }
  if (p.batch == 0) return absl::OkStatus();
  if (p.q == nullptr || p.out == nullptr || p.pages == nullptr ||
      p.page_indptr == nullptr || p.attend_tokens == nullptr) {
    return absl::InvalidArgumentError(
        "q, out, pages, page_indptr and attend_tokens must be non-null");
  }
  if (static_cast<long long>(p.batch) * p.shape.heads > 0x7fffffffLL) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch * heads too large: ", p.batch));
  }
  const int d = p.shape.head_dim;
  TRIAX_ASSIGN_OR_RETURN(const MmaKernels* kernels, KernelsFor(d));
  if (kernels == nullptr) {
    return ToStatus(LaunchCudaCoreAttention(ArgsOf(p), group));
  }
  TRIAX_RETURN_IF_ERROR(ToStatus(kernels->ensure_tq_tables()));
  const MmaPlan plan = PlanFor(p, *kernels);
  if (static_cast<long long>(kLaunchClasses) * p.batch * p.shape.heads *
          plan.small_row_blocks * (plan.s_max / kMmaWarps) >
      0x7fffffffLL) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch * heads too large: ", p.batch));
  }
  if (p.workspace != nullptr) {
    if (p.workspace_bytes < plan.ws_bytes || !Aligned16(p.workspace)) {
      return absl::InvalidArgumentError(
          absl::StrCat("workspace must be 16-byte aligned and hold ",
                       plan.ws_bytes, " bytes, got ", p.workspace_bytes));
    }
    return RunMma(p, plan, *kernels, p.workspace);
  }
  void* ws = nullptr;
  cudaError_t e = cudaMallocAsync(&ws, plan.ws_bytes, p.stream);
  if (e != cudaSuccess) {
    return absl::ResourceExhaustedError(
        absl::StrCat("attention workspace of ", plan.ws_bytes,
                     " bytes: ", cudaGetErrorString(e)));
  }
  const absl::Status s = RunMma(p, plan, *kernels, ws);
  e = cudaFreeAsync(ws, p.stream);
  TRIAX_RETURN_IF_ERROR(s);
  if (e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("freeing attention workspace: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

}  // namespace triax::kernels::cuda
