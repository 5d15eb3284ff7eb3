#include "worker/cuda_device.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/kv_cuda.cuh"

namespace triax::worker {
namespace {

namespace kc = ::triax::kernels::cuda;
using kernels::Encoding;
using kernels::Format;
using kernels::PageShape;

// Sections inside the staging buffers start on this boundary, which keeps
// every kernel input 16-byte aligned as kv_cuda.cuh requires.
constexpr size_t kAlign = 256;
size_t AlignUp(size_t n) { return (n + kAlign - 1) & ~(kAlign - 1); }

std::string CudaError(cudaError_t e) {
  return absl::StrCat(cudaGetErrorName(e), ": ", cudaGetErrorString(e));
}

size_t TokenValues(const PageShape& shape) {
  return static_cast<size_t>(shape.heads) * shape.head_dim;
}

absl::Status CheckTokens(const PageShape& shape, int first, int num_tokens,
                         const char* op) {
  if (num_tokens < 1 || first < 0 || first + num_tokens > shape.tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": slots [", first, ", ", first + num_tokens,
                     ") are not a non-empty range inside the page's ",
                     shape.tokens, " tokens"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaDevice>> CudaDevice::Create(int ordinal) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(
        "no CUDA device (cudaGetDeviceCount: ", CudaError(e), ")"));
  }
  if (ordinal < 0 || ordinal >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_device=", ordinal, " is not in [0, ", count,
                     "): the process sees ", count, " CUDA device(s)"));
  }
  e = cudaSetDevice(ordinal);
  if (e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cudaSetDevice(", ordinal, "): ", CudaError(e)));
  }
  cudaStream_t stream = nullptr;
  e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (e != cudaSuccess) {
    return absl::InternalError(absl::StrCat(
        "cuda device ", ordinal, ": cudaStreamCreate: ", CudaError(e)));
  }
  return std::unique_ptr<CudaDevice>(new CudaDevice(ordinal, stream));
}

CudaDevice::CudaDevice(int ordinal, cudaStream_t stream)
    : ordinal_(ordinal), stream_(stream) {}

CudaDevice::~CudaDevice() {
  absl::MutexLock lock(&mu_);
  // On a poisoned context these calls fail; there is nothing left to save.
  cudaSetDevice(ordinal_);
  if (host_ != nullptr) cudaFreeHost(host_);
  if (scratch_ != nullptr) cudaFree(scratch_);
  cudaStreamDestroy(stream_);
}

absl::Status CudaDevice::SupportsEncoding(const Encoding& e,
                                          const PageShape& shape) const {
  return kc::CheckEncodingCuda(e, shape);
}

absl::Status CudaDevice::SupportsAttention(const PageShape& shape,
                                           int n_q_heads) const {
  // A batch of 0 runs every host-side check of the kernel and launches
  // nothing, so the limits stay defined in one place (kv_cuda.cu).
  kc::AttentionParams p;
  p.shape = shape;
  p.batch = 0;
  p.n_q_heads = n_q_heads;
  return kc::DecodeAttentionCuda(p);
}

absl::Status CudaDevice::Health() const {
  absl::MutexLock lock(&mu_);
  if (poisoned_.empty()) return absl::OkStatus();
  return absl::UnavailableError(poisoned_);
}

absl::Status CudaDevice::Begin() {
  if (!poisoned_.empty()) return absl::UnavailableError(poisoned_);
  return Check(cudaSetDevice(ordinal_), "cudaSetDevice");
}

absl::Status CudaDevice::Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  const std::string msg = absl::StrCat("cuda device ", ordinal_, ": ", what,
                                       " failed: ", CudaError(e));
  if (poisoned_.empty()) {
    poisoned_ = absl::StrCat(
        "cuda backend unhealthy (restart the worker) since: ", msg);
  }
  return absl::InternalError(msg);
}

absl::Status CudaDevice::Launched(absl::Status s) {
  if (s.code() != absl::StatusCode::kInternal) return s;
  if (poisoned_.empty()) {
    poisoned_ = absl::StrCat(
        "cuda backend unhealthy (restart the worker) since: cuda device ",
        ordinal_, ": ", s.message());
  }
  return s;
}

absl::Status CudaDevice::Sync(const char* what) {
  return Check(cudaStreamSynchronize(stream_), what);
}

absl::Status CudaDevice::Reserve(size_t host_bytes, size_t device_bytes) {
  if (host_bytes > host_bytes_) {
    if (host_ != nullptr) cudaFreeHost(host_);
    host_ = nullptr;
    host_bytes_ = 0;
    const size_t want = std::max(host_bytes, size_t{1} << 20);
    void* p = nullptr;
    const cudaError_t e = cudaMallocHost(&p, want);
    if (e != cudaSuccess) {
      cudaGetLastError();  // allocation failures are not sticky
      return absl::ResourceExhaustedError(
          absl::StrCat("cuda device ", ordinal_, ": cannot pin ", want,
                       " bytes of host staging memory: ", CudaError(e)));
    }
    host_ = static_cast<uint8_t*>(p);
    host_bytes_ = want;
  }
  if (device_bytes > scratch_bytes_) {
    if (scratch_ != nullptr) cudaFree(scratch_);
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    const size_t want = std::max(device_bytes, size_t{1} << 20);
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, want);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(
          absl::StrCat("cuda device ", ordinal_, ": cannot allocate ", want,
                       " bytes of device scratch memory: ", CudaError(e)));
    }
    scratch_ = static_cast<uint8_t*>(p);
    scratch_bytes_ = want;
  }
  return absl::OkStatus();
}

absl::StatusOr<uint8_t*> CudaDevice::AllocateArena(size_t bytes) {
  if (bytes == 0) {
    return absl::InvalidArgumentError("arena bytes must be > 0");
  }
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Begin(); !s.ok()) return s;
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    return absl::ResourceExhaustedError(
        absl::StrCat("cuda device ", ordinal_, ": cannot allocate an arena of ",
                     bytes, " bytes (", free_bytes, " of ", total_bytes,
                     " bytes free): ", CudaError(e)));
  }
  // cudaMalloc returns 256-byte aligned memory, as the arena contract asks.
  return static_cast<uint8_t*>(p);
}

void CudaDevice::FreeArena(uint8_t* base, size_t /*bytes*/) {
  absl::MutexLock lock(&mu_);
  cudaSetDevice(ordinal_);
  cudaFree(base);
}

absl::Status CudaDevice::EncodePage(const Encoding& e, const PageShape& shape,
                                    const uint16_t* k_bf16,
                                    const uint16_t* v_bf16, int num_tokens,
                                    uint8_t* page) {
  if (absl::Status s = kc::CheckEncodingCuda(e, shape); !s.ok()) return s;
  if (absl::Status s = CheckTokens(shape, 0, num_tokens, "EncodePage");
      !s.ok()) {
    return s;
  }
  // Staging: K [T][H][D] bf16 | V [T][H][D] bf16 | DevicePage. Only the
  // first num_tokens rows are filled; the kernel reads no others.
  const size_t tensor = AlignUp(shape.tokens * TokenValues(shape) * 2);
  const size_t total = 2 * tensor + AlignUp(sizeof(kc::DevicePage));
  const size_t used = static_cast<size_t>(num_tokens) * TokenValues(shape) * 2;
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Begin(); !s.ok()) return s;
  if (absl::Status s = Reserve(total, total); !s.ok()) return s;
  std::memcpy(host_, k_bf16, used);
  std::memcpy(host_ + tensor, v_bf16, used);
  kc::DevicePage dp;
  dp.data = page;
  dp.num_tokens = num_tokens;
  dp.format = kc::PackEncoding(e);
  std::memcpy(host_ + 2 * tensor, &dp, sizeof(dp));
  if (absl::Status s = Check(cudaMemcpyAsync(scratch_, host_, total,
                                             cudaMemcpyHostToDevice, stream_),
                             "EncodePage upload");
      !s.ok()) {
    return s;
  }
  kc::EncodePagesParams p;
  p.shape = shape;
  p.pages = reinterpret_cast<const kc::DevicePage*>(scratch_ + 2 * tensor);
  p.num_pages = 1;
  p.k_bf16 = reinterpret_cast<const uint16_t*>(scratch_);
  p.v_bf16 = reinterpret_cast<const uint16_t*>(scratch_ + tensor);
  p.stream = stream_;
  if (absl::Status s = Launched(kc::EncodePagesCuda(p)); !s.ok()) return s;
  return Sync("EncodePage");
}

absl::Status CudaDevice::DecodePage(const Encoding& e, const PageShape& shape,
                                    const uint8_t* page, int num_tokens,
                                    float* k_out, float* v_out) {
  if (absl::Status s = kc::CheckEncodingCuda(e, shape); !s.ok()) return s;
  if (num_tokens == 0 || (k_out == nullptr && v_out == nullptr)) {
    return absl::OkStatus();
  }
  if (absl::Status s = CheckTokens(shape, 0, num_tokens, "DecodePage");
      !s.ok()) {
    return s;
  }
  // Device: K out [T][H][D] f32 | V out [T][H][D] f32 | DevicePage.
  const size_t tensor = AlignUp(shape.tokens * TokenValues(shape) * 4);
  const size_t table = AlignUp(sizeof(kc::DevicePage));
  const size_t used = static_cast<size_t>(num_tokens) * TokenValues(shape) * 4;
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Begin(); !s.ok()) return s;
  if (absl::Status s = Reserve(2 * tensor + table, 2 * tensor + table);
      !s.ok()) {
    return s;
  }
  kc::DevicePage dp;
  dp.data = const_cast<uint8_t*>(page);
  dp.num_tokens = num_tokens;
  dp.format = kc::PackEncoding(e);
  std::memcpy(host_ + 2 * tensor, &dp, sizeof(dp));
  if (absl::Status s =
          Check(cudaMemcpyAsync(scratch_ + 2 * tensor, host_ + 2 * tensor,
                                sizeof(dp), cudaMemcpyHostToDevice, stream_),
                "DecodePage upload");
      !s.ok()) {
    return s;
  }
  kc::DecodePagesParams p;
  p.shape = shape;
  p.pages = reinterpret_cast<const kc::DevicePage*>(scratch_ + 2 * tensor);
  p.num_pages = 1;
  p.k_out = k_out != nullptr ? reinterpret_cast<float*>(scratch_) : nullptr;
  p.v_out =
      v_out != nullptr ? reinterpret_cast<float*>(scratch_ + tensor) : nullptr;
  p.stream = stream_;
  if (absl::Status s = Launched(kc::DecodePagesCuda(p)); !s.ok()) return s;
  if (k_out != nullptr) {
    if (absl::Status s = Check(cudaMemcpyAsync(host_, scratch_, used,
                                               cudaMemcpyDeviceToHost, stream_),
                               "DecodePage download");
        !s.ok()) {
      return s;
    }
  }
  if (v_out != nullptr) {
    if (absl::Status s =
            Check(cudaMemcpyAsync(host_ + tensor, scratch_ + tensor, used,
                                  cudaMemcpyDeviceToHost, stream_),
                  "DecodePage download");
        !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = Sync("DecodePage"); !s.ok()) return s;
  if (k_out != nullptr) std::memcpy(k_out, host_, used);
  if (v_out != nullptr) std::memcpy(v_out, host_ + tensor, used);
  return absl::OkStatus();
}

absl::Status CudaDevice::WriteBf16Tokens(const PageShape& shape,
                                         const uint16_t* k_bf16,
                                         const uint16_t* v_bf16, int first_slot,
                                         int num_tokens, uint8_t* page) {
  if (absl::Status s = kc::CheckEncodingCuda(Format::kBF16, shape); !s.ok()) {
    return s;
  }
  if (absl::Status s =
          CheckTokens(shape, first_slot, num_tokens, "WriteBf16Tokens");
      !s.ok()) {
    return s;
  }
  const kernels::PageLayout layout =
      kc::CudaPageLayout(Encoding(Format::kBF16), shape);
  const int H = shape.heads, D = shape.head_dim, T = shape.tokens;
  const size_t row = static_cast<size_t>(num_tokens) * D * 2;  // one head
  const size_t tensor = AlignUp(row * H);
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Begin(); !s.ok()) return s;
  if (absl::Status s = Reserve(2 * tensor, 0); !s.ok()) return s;
  // Token-major [n][H][D] -> head-major [H][n][D] in the staging buffer, so
  // each tensor is one strided copy into the page's [H][T][D] codes.
  const uint16_t* src[2] = {k_bf16, v_bf16};
  const size_t offset[2] = {layout.k.codes, layout.v.codes};
  for (int x = 0; x < 2; ++x) {
    uint16_t* staged = reinterpret_cast<uint16_t*>(host_ + x * tensor);
    for (int h = 0; h < H; ++h) {
      for (int t = 0; t < num_tokens; ++t) {
        std::memcpy(staged + (static_cast<size_t>(h) * num_tokens + t) * D,
                    src[x] + (static_cast<size_t>(t) * H + h) * D, D * 2);
      }
    }
    uint8_t* dst = page + offset[x] + static_cast<size_t>(first_slot) * D * 2;
    if (absl::Status s = Check(
            cudaMemcpy2DAsync(dst, static_cast<size_t>(T) * D * 2, staged, row,
                              row, H, cudaMemcpyHostToDevice, stream_),
            "WriteBf16Tokens upload");
        !s.ok()) {
      return s;
    }
  }
  return Sync("WriteBf16Tokens");
}

absl::Status CudaDevice::CopyPage(uint8_t* dst, const uint8_t* src,
                                  size_t bytes) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Begin(); !s.ok()) return s;
  if (absl::Status s = Check(
          cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_),
          "CopyPage");
      !s.ok()) {
    return s;
  }
  return Sync("CopyPage");
}

absl::Status CudaDevice::DecodeAttention(const kernels::DecodeParams& p) {
  const PageShape& shape = p.shape;
  if (absl::Status s = SupportsAttention(shape, p.n_q_heads); !s.ok()) {
    return s;
  }
  const size_t qvalues = static_cast<size_t>(p.n_q_heads) * shape.head_dim;
  // The pages the attended tokens reach, as the CPU reference walks them.
  std::vector<kc::DevicePage> table;
  long seen = 0;
  for (int i = 0; i < p.num_pages && seen < p.attend_tokens; ++i) {
    const kernels::PageRef& r = p.pages[i];
    if (absl::Status s = kc::CheckEncodingCuda(r.encoding, shape); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("pages[", i, "]: ", s.message()));
    }
    if (r.num_tokens < 1 || r.num_tokens > shape.tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("pages[", i, "].num_tokens=", r.num_tokens,
                       " is outside 1..", shape.tokens));
    }
    kc::DevicePage dp;
    dp.data = const_cast<uint8_t*>(r.data);
    dp.num_tokens = r.num_tokens;
    dp.format = kc::PackEncoding(r.encoding);
    table.push_back(dp);
    seen += r.num_tokens;
  }
  if (p.attend_tokens <= 0 || table.empty()) {
    std::fill_n(p.out, qvalues, 0.f);
    return absl::OkStatus();
  }
  if (p.attend_tokens > seen) {
    return absl::InvalidArgumentError(
        absl::StrCat("attend_tokens=", p.attend_tokens, " is past the ", seen,
                     " tokens of the ", p.num_pages, " pages"));
  }
  // Staging (uploaded in one copy): q f32 | table | indptr[2] | attend[1];
  // out f32 follows in device scratch and comes back through host staging.
  const size_t q_bytes = AlignUp(qvalues * 4);
  const size_t table_bytes = AlignUp(table.size() * sizeof(kc::DevicePage));
  const size_t meta_bytes = AlignUp(3 * sizeof(int32_t));
  const size_t up = q_bytes + table_bytes + meta_bytes;
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Begin(); !s.ok()) return s;
  if (absl::Status s = Reserve(up + q_bytes, up + q_bytes); !s.ok()) return s;
  std::memcpy(host_, p.q, qvalues * 4);
  std::memcpy(host_ + q_bytes, table.data(),
              table.size() * sizeof(kc::DevicePage));
  const int32_t meta[3] = {0, static_cast<int32_t>(table.size()),
                           static_cast<int32_t>(p.attend_tokens)};
  std::memcpy(host_ + q_bytes + table_bytes, meta, sizeof(meta));
  if (absl::Status s = Check(
          cudaMemcpyAsync(scratch_, host_, up, cudaMemcpyHostToDevice, stream_),
          "DecodeAttention upload");
      !s.ok()) {
    return s;
  }
  const int32_t* dmeta =
      reinterpret_cast<const int32_t*>(scratch_ + q_bytes + table_bytes);
  kc::AttentionParams a;
  a.shape = shape;
  a.batch = 1;
  a.n_q_heads = p.n_q_heads;
  a.scale = p.scale;
  a.q = reinterpret_cast<const float*>(scratch_);
  a.out = reinterpret_cast<float*>(scratch_ + up);
  a.pages = reinterpret_cast<const kc::DevicePage*>(scratch_ + q_bytes);
  a.page_indptr = dmeta;
  a.attend_tokens = dmeta + 2;
  a.stream = stream_;
  if (absl::Status s = Launched(kc::DecodeAttentionCuda(a)); !s.ok()) return s;
  if (absl::Status s =
          Check(cudaMemcpyAsync(host_ + up, scratch_ + up, qvalues * 4,
                                cudaMemcpyDeviceToHost, stream_),
                "DecodeAttention download");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Sync("DecodeAttention"); !s.ok()) return s;
  std::memcpy(p.out, host_ + up, qvalues * 4);
  return absl::OkStatus();
}

}  // namespace triax::worker
