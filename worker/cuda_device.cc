#include "worker/cuda_device.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
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
  std::vector<std::unique_ptr<Lane>> lanes;
  for (int i = 0; i < kLanes; ++i) {
    auto lane = std::make_unique<Lane>();
    e = cudaStreamCreateWithFlags(&lane->stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreate(&lane->kernel_start);
    if (e == cudaSuccess) e = cudaEventCreate(&lane->kernel_stop);
    if (e != cudaSuccess) {
      lanes.push_back(std::move(lane));
      for (auto& l : lanes) {
        if (l->stream != nullptr) cudaStreamDestroy(l->stream);
        if (l->kernel_start != nullptr) cudaEventDestroy(l->kernel_start);
        if (l->kernel_stop != nullptr) cudaEventDestroy(l->kernel_stop);
      }
      return absl::InternalError(
          absl::StrCat("cuda device ", ordinal,
                       ": cudaStreamCreate / cudaEventCreate: ", CudaError(e)));
    }
    lanes.push_back(std::move(lane));
  }
  return std::unique_ptr<CudaDevice>(new CudaDevice(ordinal, std::move(lanes)));
}

CudaDevice::CudaDevice(int ordinal, std::vector<std::unique_ptr<Lane>> lanes)
    : ordinal_(ordinal), lanes_(std::move(lanes)) {
  absl::MutexLock lock(&lanes_mu_);
  for (const auto& l : lanes_) free_lanes_.push_back(l.get());
}

CudaDevice::~CudaDevice() {
  // No call is in flight (the owner outlives its users). On a poisoned
  // context these calls fail; there is nothing left to save.
  cudaSetDevice(ordinal_);
  for (const auto& l : lanes_) {
    if (l->host != nullptr) cudaFreeHost(l->host);
    if (l->scratch != nullptr) cudaFree(l->scratch);
    if (l->workspace != nullptr) cudaFree(l->workspace);
    cudaEventDestroy(l->kernel_start);
    cudaEventDestroy(l->kernel_stop);
    cudaStreamDestroy(l->stream);
  }
  absl::MutexLock lock(&lanes_mu_);
  for (const auto& c : copy_lanes_) {
    for (size_t i = 0; i < CheckedCopies::kMaxInFlight; ++i) {
      if (c->slots[i].host != nullptr) cudaFreeHost(c->slots[i].host);
      if (c->slots[i].scratch != nullptr) cudaFree(c->slots[i].scratch);
      if (c->done[i] != nullptr) cudaEventDestroy(c->done[i]);
    }
    if (c->stream != nullptr) cudaStreamDestroy(c->stream);
  }
}

CudaDevice::Lease::~Lease() {
  if (lane_ == nullptr) return;
  absl::MutexLock lock(&device_->lanes_mu_);
  device_->free_lanes_.push_back(lane_);
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

int CudaDevice::PagesPerShare(const PageShape& shape) {
  return std::max(1, 512 / std::max(1, shape.tokens));
}

int CudaDevice::AttentionSplits(const PageShape& shape, size_t pages) {
  const size_t pps = static_cast<size_t>(PagesPerShare(shape));
  const size_t shares = std::max<size_t>(1, (pages + pps - 1) / pps);
  return static_cast<int>(std::min<size_t>((shares + 3) / 4, 64));
}

absl::Status CudaDevice::Health() const {
  absl::MutexLock lock(&health_mu_);
  if (poisoned_.empty()) return absl::OkStatus();
  return absl::UnavailableError(poisoned_);
}

absl::Status CudaDevice::BeginNoLane() {
  if (absl::Status s = Health(); !s.ok()) return s;
  return Check(cudaSetDevice(ordinal_), "cudaSetDevice");
}

absl::StatusOr<CudaDevice::Lease> CudaDevice::Begin() {
  TRIAX_RETURN_IF_ERROR(BeginNoLane());
  lanes_mu_.LockWhen(absl::Condition(
      +[](std::vector<Lane*>* free) { return !free->empty(); }, &free_lanes_));
  Lane* lane = free_lanes_.back();
  free_lanes_.pop_back();
  lanes_mu_.Unlock();
  return Lease(this, lane);
}

void CudaDevice::Poison(absl::string_view msg) {
  absl::MutexLock lock(&health_mu_);
  if (poisoned_.empty()) {
    poisoned_ = absl::StrCat(
        "cuda backend unhealthy (restart the worker) since: ", msg);
  }
}

absl::Status CudaDevice::Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  const std::string msg = absl::StrCat("cuda device ", ordinal_, ": ", what,
                                       " failed: ", CudaError(e));
  Poison(msg);
  return absl::InternalError(msg);
}

absl::Status CudaDevice::Launched(absl::Status s) {
  if (s.code() != absl::StatusCode::kInternal) return s;
  Poison(absl::StrCat("cuda device ", ordinal_, ": ", s.message()));
  return s;
}

absl::Status CudaDevice::Sync(Lane& lane, const char* what) {
  return Check(cudaStreamSynchronize(lane.stream), what);
}

absl::Status CudaDevice::Reserve(Lane& lane, size_t host_bytes,
                                 size_t device_bytes) {
  if (host_bytes > lane.host_bytes) {
    if (lane.host != nullptr) cudaFreeHost(lane.host);
    lane.host = nullptr;
    lane.host_bytes = 0;
    const size_t want = std::max(host_bytes, size_t{1} << 20);
    void* p = nullptr;
    const cudaError_t e = cudaMallocHost(&p, want);
    if (e != cudaSuccess) {
      cudaGetLastError();  // allocation failures are not sticky
      return absl::ResourceExhaustedError(
          absl::StrCat("cuda device ", ordinal_, ": cannot pin ", want,
                       " bytes of host staging memory: ", CudaError(e)));
    }
    lane.host = static_cast<uint8_t*>(p);
    lane.host_bytes = want;
  }
  if (device_bytes > lane.scratch_bytes) {
    if (lane.scratch != nullptr) cudaFree(lane.scratch);
    lane.scratch = nullptr;
    lane.scratch_bytes = 0;
    const size_t want = std::max(device_bytes, size_t{1} << 20);
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, want);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(
          absl::StrCat("cuda device ", ordinal_, ": cannot allocate ", want,
                       " bytes of device scratch memory: ", CudaError(e)));
    }
    lane.scratch = static_cast<uint8_t*>(p);
    lane.scratch_bytes = want;
  }
  return absl::OkStatus();
}

absl::Status CudaDevice::ReserveWorkspace(Lane& lane, size_t bytes) {
  if (bytes <= lane.workspace_bytes) return absl::OkStatus();
  if (lane.workspace != nullptr) cudaFree(lane.workspace);
  lane.workspace = nullptr;
  lane.workspace_bytes = 0;
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("cuda device ", ordinal_, ": cannot allocate ", bytes,
                     " bytes of attention workspace: ", CudaError(e)));
  }
  lane.workspace = static_cast<uint8_t*>(p);
  lane.workspace_bytes = bytes;
  return absl::OkStatus();
}

absl::StatusOr<uint8_t*> CudaDevice::AllocateArena(size_t bytes) {
  if (bytes == 0) {
    return absl::InvalidArgumentError("arena bytes must be > 0");
  }
  TRIAX_RETURN_IF_ERROR(BeginNoLane());
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
  cudaSetDevice(ordinal_);
  cudaFree(base);
}

absl::Status CudaDevice::EncodePage(const Encoding& e, const PageShape& shape,
                                    const uint16_t* k_bf16,
                                    const uint16_t* v_bf16, int num_tokens,
                                    uint8_t* page) {
  TRIAX_RETURN_IF_ERROR(kc::CheckEncodingCuda(e, shape));
  TRIAX_RETURN_IF_ERROR(CheckTokens(shape, 0, num_tokens, "EncodePage"));
  // Staging: K [T][H][D] bf16 | V [T][H][D] bf16 | DevicePage. Only the
  // first num_tokens rows are filled; the kernel reads no others.
  const size_t tensor = AlignUp(shape.tokens * TokenValues(shape) * 2);
  const size_t total = 2 * tensor + AlignUp(sizeof(kc::DevicePage));
  const size_t used = static_cast<size_t>(num_tokens) * TokenValues(shape) * 2;
  TRIAX_ASSIGN_OR_RETURN(Lease lane, Begin());
  TRIAX_RETURN_IF_ERROR(Reserve(*lane, total, total));
  std::memcpy(lane->host, k_bf16, used);
  std::memcpy(lane->host + tensor, v_bf16, used);
  kc::DevicePage dp;
  dp.data = page;
  dp.num_tokens = num_tokens;
  dp.format = kc::PackEncoding(e);
  std::memcpy(lane->host + 2 * tensor, &dp, sizeof(dp));
  TRIAX_RETURN_IF_ERROR(
      Check(cudaMemcpyAsync(lane->scratch, lane->host, total,
                            cudaMemcpyHostToDevice, lane->stream),
            "EncodePage upload"));
  kc::EncodePagesParams p;
  p.shape = shape;
  p.pages = reinterpret_cast<const kc::DevicePage*>(lane->scratch + 2 * tensor);
  p.num_pages = 1;
  p.k_bf16 = reinterpret_cast<const uint16_t*>(lane->scratch);
  p.v_bf16 = reinterpret_cast<const uint16_t*>(lane->scratch + tensor);
  p.stream = lane->stream;
  TRIAX_RETURN_IF_ERROR(Launched(kc::EncodePagesCuda(p)));
  return Sync(*lane, "EncodePage");
}

absl::Status CudaDevice::DecodePage(const Encoding& e, const PageShape& shape,
                                    const uint8_t* page, int num_tokens,
                                    float* k_out, float* v_out) {
  TRIAX_RETURN_IF_ERROR(kc::CheckEncodingCuda(e, shape));
  if (num_tokens == 0 || (k_out == nullptr && v_out == nullptr)) {
    return absl::OkStatus();
  }
  TRIAX_RETURN_IF_ERROR(CheckTokens(shape, 0, num_tokens, "DecodePage"));
  // Device: K out [T][H][D] f32 | V out [T][H][D] f32 | DevicePage.
  const size_t tensor = AlignUp(shape.tokens * TokenValues(shape) * 4);
  const size_t table = AlignUp(sizeof(kc::DevicePage));
  const size_t used = static_cast<size_t>(num_tokens) * TokenValues(shape) * 4;
  TRIAX_ASSIGN_OR_RETURN(Lease lane, Begin());
  TRIAX_RETURN_IF_ERROR(Reserve(*lane, 2 * tensor + table, 2 * tensor + table));
  kc::DevicePage dp;
  dp.data = const_cast<uint8_t*>(page);
  dp.num_tokens = num_tokens;
  dp.format = kc::PackEncoding(e);
  std::memcpy(lane->host + 2 * tensor, &dp, sizeof(dp));
  TRIAX_RETURN_IF_ERROR(
      Check(cudaMemcpyAsync(lane->scratch + 2 * tensor, lane->host + 2 * tensor,
                            sizeof(dp), cudaMemcpyHostToDevice, lane->stream),
            "DecodePage upload"));
  kc::DecodePagesParams p;
  p.shape = shape;
  p.pages = reinterpret_cast<const kc::DevicePage*>(lane->scratch + 2 * tensor);
  p.num_pages = 1;
  p.k_out =
      k_out != nullptr ? reinterpret_cast<float*>(lane->scratch) : nullptr;
  p.v_out = v_out != nullptr ? reinterpret_cast<float*>(lane->scratch + tensor)
                             : nullptr;
  p.stream = lane->stream;
  TRIAX_RETURN_IF_ERROR(Launched(kc::DecodePagesCuda(p)));
  if (k_out != nullptr) {
    TRIAX_RETURN_IF_ERROR(
        Check(cudaMemcpyAsync(lane->host, lane->scratch, used,
                              cudaMemcpyDeviceToHost, lane->stream),
              "DecodePage download"));
  }
  if (v_out != nullptr) {
    TRIAX_RETURN_IF_ERROR(
        Check(cudaMemcpyAsync(lane->host + tensor, lane->scratch + tensor, used,
                              cudaMemcpyDeviceToHost, lane->stream),
              "DecodePage download"));
  }
  TRIAX_RETURN_IF_ERROR(Sync(*lane, "DecodePage"));
  if (k_out != nullptr) std::memcpy(k_out, lane->host, used);
  if (v_out != nullptr) std::memcpy(v_out, lane->host + tensor, used);
  return absl::OkStatus();
}

absl::Status CudaDevice::WriteBf16Tokens(const PageShape& shape,
                                         const uint16_t* k_bf16,
                                         const uint16_t* v_bf16, int first_slot,
                                         int num_tokens, uint8_t* page) {
  TRIAX_RETURN_IF_ERROR(kc::CheckEncodingCuda(Format::kBF16, shape));
  TRIAX_RETURN_IF_ERROR(
      CheckTokens(shape, first_slot, num_tokens, "WriteBf16Tokens"));
  const kernels::PageLayout layout =
      kc::CudaPageLayout(Encoding(Format::kBF16), shape);
  const int H = shape.heads, D = shape.head_dim, T = shape.tokens;
  const size_t row = static_cast<size_t>(num_tokens) * D * 2;  // one head
  const size_t tensor = AlignUp(row * H);
  TRIAX_ASSIGN_OR_RETURN(Lease lane, Begin());
  TRIAX_RETURN_IF_ERROR(Reserve(*lane, 2 * tensor, 0));
  // Token-major [n][H][D] -> head-major [H][n][D] in the staging buffer, so
  // each tensor is one strided copy into the page's [H][T][D] codes.
  const uint16_t* src[2] = {k_bf16, v_bf16};
  const size_t offset[2] = {layout.k.codes, layout.v.codes};
  for (int x = 0; x < 2; ++x) {
    uint16_t* staged = reinterpret_cast<uint16_t*>(lane->host + x * tensor);
    for (int h = 0; h < H; ++h) {
      for (int t = 0; t < num_tokens; ++t) {
        std::memcpy(staged + (static_cast<size_t>(h) * num_tokens + t) * D,
                    src[x] + (static_cast<size_t>(t) * H + h) * D,
                    static_cast<size_t>(D) * 2);
      }
    }
    uint8_t* dst = page + offset[x] + static_cast<size_t>(first_slot) * D * 2;
    TRIAX_RETURN_IF_ERROR(Check(
        cudaMemcpy2DAsync(dst, static_cast<size_t>(T) * D * 2, staged, row, row,
                          H, cudaMemcpyHostToDevice, lane->stream),
        "WriteBf16Tokens upload"));
  }
  return Sync(*lane, "WriteBf16Tokens");
}

absl::Status CudaDevice::WriteBf16TokensBatch(
    const PageShape& shape, absl::Span<const TokenWrite> writes) {
  TRIAX_RETURN_IF_ERROR(kc::CheckEncodingCuda(Format::kBF16, shape));
  TRIAX_RETURN_IF_ERROR(CheckTokenWrites(shape, writes));
  if (writes.empty()) return absl::OkStatus();
  const kernels::PageLayout layout =
      kc::CudaPageLayout(Encoding(Format::kBF16), shape);
  const int H = shape.heads, D = shape.head_dim, T = shape.tokens;
  const size_t per_write = 2 * static_cast<size_t>(H);  // rows: K, V x heads
  const size_t max_writes =
      std::max<size_t>(1, kMaxRangesPerLaunch / per_write);
  TRIAX_ASSIGN_OR_RETURN(Lease lane, Begin());
  // Per launch: staging [ranges][CRC32Cs (unused)][rows], uploaded in one
  // copy; each row (one head of K or V of one write, head-major as the
  // page holds it) is one CopyRange from the device scratch into its page.
  for (size_t at = 0; at < writes.size(); at += max_writes) {
    const size_t n = std::min(max_writes, writes.size() - at);
    const size_t ranges = n * per_write;
    const size_t table = AlignUp(ranges * sizeof(kc::CopyRange));
    const size_t out = AlignUp(ranges * sizeof(uint32_t));
    size_t data = 0;
    for (size_t w = at; w < at + n; ++w) {
      data += per_write * static_cast<size_t>(writes[w].num_tokens) * D * 2;
    }
    const size_t total = table + out + AlignUp(data);
    TRIAX_RETURN_IF_ERROR(Reserve(*lane, total, total));
    auto* host = reinterpret_cast<kc::CopyRange*>(lane->host);
    uint8_t* host_rows = lane->host + table + out;
    const uint8_t* dev_rows = lane->scratch + table + out;
    size_t r = 0, row_at = 0;
    uint64_t longest = 0;
    const size_t offset[2] = {layout.k.codes, layout.v.codes};
    for (size_t w = at; w < at + n; ++w) {
      const TokenWrite& tw = writes[w];
      const size_t row = static_cast<size_t>(tw.num_tokens) * D * 2;
      longest = std::max<uint64_t>(longest, row);
      const uint16_t* src[2] = {tw.k_bf16, tw.v_bf16};
      for (int x = 0; x < 2; ++x) {
        for (int h = 0; h < H; ++h) {
          // Token-major [n][H][D] -> this head's [n][D].
          for (int t = 0; t < tw.num_tokens; ++t) {
            std::memcpy(host_rows + row_at + static_cast<size_t>(t) * D * 2,
                        src[x] + (static_cast<size_t>(t) * H + h) * D,
                        static_cast<size_t>(D) * 2);
          }
          kc::CopyRange c{};
          c.src = dev_rows + row_at;
          c.dst = tw.page + offset[x] +
                  (static_cast<size_t>(h) * T + tw.first_slot) * D * 2;
          c.bytes = row;
          host[r++] = c;
          row_at += row;
        }
      }
    }
    TRIAX_RETURN_IF_ERROR(
        Check(cudaMemcpyAsync(lane->scratch, lane->host, total,
                              cudaMemcpyHostToDevice, lane->stream),
              "WriteBf16TokensBatch upload"));
    kc::CopyCrc32cParams p;
    p.ranges = reinterpret_cast<const kc::CopyRange*>(lane->scratch);
    p.num_ranges = static_cast<int>(ranges);
    p.out = reinterpret_cast<uint32_t*>(lane->scratch + table);
    p.stream = lane->stream;
    p.max_range_bytes = longest;
    TRIAX_RETURN_IF_ERROR(Launched(kc::CopyCrc32cCuda(p)));
    TRIAX_RETURN_IF_ERROR(Sync(*lane, "WriteBf16TokensBatch"));
  }
  return absl::OkStatus();
}

absl::Status CudaDevice::CopyPage(uint8_t* dst, const uint8_t* src,
                                  size_t bytes) {
  TRIAX_ASSIGN_OR_RETURN(Lease lane, Begin());
  TRIAX_RETURN_IF_ERROR(Check(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, lane->stream),
      "CopyPage"));
  return Sync(*lane, "CopyPage");
}

absl::Status CudaDevice::CopyToHost(void* host_dst, const uint8_t* dev_src,
                                    size_t bytes) {
  TRIAX_ASSIGN_OR_RETURN(Lease lane, Begin());
  TRIAX_RETURN_IF_ERROR(
      Check(cudaMemcpyAsync(host_dst, dev_src, bytes, cudaMemcpyDeviceToHost,
                            lane->stream),
            "CopyToHost"));
  return Sync(*lane, "CopyToHost");
}

absl::Status CudaDevice::CopyFromHost(uint8_t* dev_dst, const void* host_src,
                                      size_t bytes) {
  TRIAX_ASSIGN_OR_RETURN(Lease lane, Begin());
  TRIAX_RETURN_IF_ERROR(
      Check(cudaMemcpyAsync(dev_dst, host_src, bytes, cudaMemcpyHostToDevice,
                            lane->stream),
            "CopyFromHost"));
  return Sync(*lane, "CopyFromHost");
}

absl::StatusOr<uint8_t*> CudaDevice::AllocateHostTier(size_t bytes) {
  if (bytes == 0) {
    return absl::InvalidArgumentError("host tier bytes must be > 0");
  }
  TRIAX_RETURN_IF_ERROR(BeginNoLane());
  void* p = nullptr;
  const cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
  if (e != cudaSuccess) {
    // An allocation failure is not sticky: clear it and stay healthy.
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("cuda device ", ordinal_, ": cannot pin a host tier of ",
                     bytes, " bytes: ", CudaError(e)));
  }
  // cudaHostAlloc returns page-aligned memory (>= the 256 bytes promised).
  return static_cast<uint8_t*>(p);
}

void CudaDevice::FreeHostTier(uint8_t* base, size_t /*bytes*/) {
  cudaSetDevice(ordinal_);
  cudaFreeHost(base);
}

absl::Status CudaDevice::DecodeAttention(const kernels::DecodeParams& p) {
  return DecodeAttentionBatch(absl::MakeConstSpan(&p, 1));
}

absl::Status CudaDevice::DecodeAttentionBatch(
    absl::Span<const kernels::DecodeParams> batch) {
  // 1. Check every entry and build its page table (the pages its attended
  //    tokens reach, as the CPU reference walks them) before anything runs.
  std::vector<std::vector<kc::DevicePage>> tables(batch.size());
  std::vector<size_t> runs;  // entries that launch (the others get zeros)
  for (size_t b = 0; b < batch.size(); ++b) {
    const kernels::DecodeParams& p = batch[b];
    auto fail = [b](const absl::Status& s) {
      return absl::Status(s.code(),
                          absl::StrCat("batch[", b, "]: ", s.message()));
    };
    if (absl::Status s = SupportsAttention(p.shape, p.n_q_heads); !s.ok()) {
      return fail(s);
    }
    std::vector<kc::DevicePage>& table = tables[b];
    table.reserve(static_cast<size_t>(std::max(p.num_pages, 0)));
    long seen = 0;
    // A sequence's pages share a few encodings (the triaxial mix has 13):
    // each is checked and packed once per entry, then found in this small
    // list; encodings past the list's 16 are checked page by page. (At
    // batch 64 x 32k, 131,072 pages a layer, checking once took the H100's
    // device time of a 2-layer step from 22.7 to 17.9 ms:
    // bench/results/decode_step.md.)
    constexpr int kKnown = 16;
    std::array<std::pair<kernels::Encoding, int32_t>, kKnown> known;
    int n_known = 0;
    for (int i = 0; i < p.num_pages && seen < p.attend_tokens; ++i) {
      const kernels::PageRef& r = p.pages[i];
      int32_t packed = 0;
      int k = 0;
      while (k < n_known && !(known[k].first == r.encoding)) ++k;
      if (k < n_known) {
        packed = known[k].second;
      } else {
        if (absl::Status s = kc::CheckEncodingCuda(r.encoding, p.shape);
            !s.ok()) {
          return fail(absl::Status(
              s.code(), absl::StrCat("pages[", i, "]: ", s.message())));
        }
        packed = kc::PackEncoding(r.encoding);
        if (n_known < kKnown) known[n_known++] = {r.encoding, packed};
      }
      if (r.num_tokens < 1 || r.num_tokens > p.shape.tokens) {
        return fail(absl::InvalidArgumentError(
            absl::StrCat("pages[", i, "].num_tokens=", r.num_tokens,
                         " is outside 1..", p.shape.tokens)));
      }
      kc::DevicePage dp;
      dp.data = const_cast<uint8_t*>(r.data);
      dp.num_tokens = r.num_tokens;
      dp.format = packed;
      table.push_back(dp);
      seen += r.num_tokens;
    }
    if (p.attend_tokens > seen && !table.empty()) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("attend_tokens=", p.attend_tokens, " is past the ", seen,
                       " tokens of the ", p.num_pages, " pages")));
    }
    if (p.attend_tokens > 0 && !table.empty()) runs.push_back(b);
  }
  for (size_t b = 0; b < batch.size(); ++b) {
    if (batch[b].attend_tokens <= 0 || tables[b].empty()) {
      std::fill_n(
          batch[b].out,
          static_cast<size_t>(batch[b].n_q_heads) * batch[b].shape.head_dim,
          0.f);
    }
  }
  if (runs.empty()) return absl::OkStatus();
  // 2. One launch per (shape, n_q_heads, scale), in first-seen order.
  using Key = std::tuple<int, int, int, int, uint32_t>;
  std::map<Key, std::vector<size_t>> groups;
  std::vector<Key> order;
  for (size_t b : runs) {
    const kernels::DecodeParams& p = batch[b];
    uint32_t scale_bits;
    std::memcpy(&scale_bits, &p.scale, 4);
    const Key key{p.shape.tokens, p.shape.heads, p.shape.head_dim, p.n_q_heads,
                  scale_bits};
    auto [it, fresh] = groups.try_emplace(key);
    if (fresh) order.push_back(key);
    it->second.push_back(b);
  }
  TRIAX_ASSIGN_OR_RETURN(Lease lane, Begin());
  for (const Key& key : order) {
    const std::vector<size_t>& idx = groups[key];
    const kernels::DecodeParams& first = batch[idx[0]];
    // Chunks bounded by the workspace cap, sized for the group's longest
    // table (shares depend on each sequence only, so chunking does not
    // change any output).
    size_t longest = 0;
    for (size_t b : idx) longest = std::max(longest, tables[b].size());
    kc::AttentionParams probe;
    probe.shape = first.shape;
    probe.n_q_heads = first.n_q_heads;
    probe.num_splits = AttentionSplits(first.shape, longest);
    probe.batch = 1;
    const size_t per_entry =
        std::max<size_t>(1, kc::AttentionWorkspaceBytes(probe));
    const size_t chunk = std::max<size_t>(1, kMaxWorkspaceBytes / per_entry);
    for (size_t at = 0; at < idx.size(); at += chunk) {
      const std::vector<size_t> part(
          idx.begin() + at, idx.begin() + std::min(idx.size(), at + chunk));
      TRIAX_RETURN_IF_ERROR(AttendGroup(*lane, batch, part, tables));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaDevice::AttendGroup(
    Lane& lane, absl::Span<const kernels::DecodeParams> batch,
    const std::vector<size_t>& idx,
    const std::vector<std::vector<kc::DevicePage>>& tables) {
  const kernels::DecodeParams& first = batch[idx[0]];
  const PageShape& shape = first.shape;
  const int n = static_cast<int>(idx.size());
  const size_t qvalues = static_cast<size_t>(first.n_q_heads) * shape.head_dim;
  size_t pages = 0;
  for (size_t b : idx) pages += tables[b].size();
  // Staging (uploaded in one copy): q f32 [n][qvalues] | table [pages] |
  // indptr [n + 1] | attend [n]; out f32 [n][qvalues] follows in device
  // scratch and comes back through the host staging buffer.
  const size_t q_bytes = AlignUp(n * qvalues * 4);
  const size_t table_bytes = AlignUp(pages * sizeof(kc::DevicePage));
  const size_t meta_bytes = AlignUp((2 * static_cast<size_t>(n) + 1) * 4);
  const size_t up = q_bytes + table_bytes + meta_bytes;
  TRIAX_RETURN_IF_ERROR(Reserve(lane, up + q_bytes, up + q_bytes));
  kc::AttentionParams a;
  a.shape = shape;
  a.batch = n;
  a.n_q_heads = first.n_q_heads;
  a.scale = first.scale;
  size_t longest = 0;
  for (size_t b : idx) longest = std::max(longest, tables[b].size());
  a.num_splits = AttentionSplits(shape, longest);
  a.pages_per_share = PagesPerShare(shape);
  const size_t ws = kc::AttentionWorkspaceBytes(a);
  if (ws > 0) TRIAX_RETURN_IF_ERROR(ReserveWorkspace(lane, ws));
  uint8_t* h = lane.host;
  auto* table = reinterpret_cast<kc::DevicePage*>(h + q_bytes);
  auto* indptr = reinterpret_cast<int32_t*>(h + q_bytes + table_bytes);
  int32_t* attend = indptr + n + 1;
  indptr[0] = 0;
  // The encodings present let the kernel skip launch configurations that
  // no page needs (one launch per configuration otherwise).
  uint32_t formats = 0;
  int32_t last_format = 0;
  for (int i = 0; i < n; ++i) {
    const size_t b = idx[i];
    std::memcpy(h + i * qvalues * 4, batch[b].q, qvalues * 4);
    std::memcpy(table + indptr[i], tables[b].data(),
                tables[b].size() * sizeof(kc::DevicePage));
    indptr[i + 1] = indptr[i] + static_cast<int32_t>(tables[b].size());
    attend[i] = static_cast<int32_t>(batch[b].attend_tokens);
    for (const kc::DevicePage& dp : tables[b]) {
      if (dp.format == last_format && formats != 0) continue;
      last_format = dp.format;
      formats |= kc::AttentionFormatBit(dp.format, shape.head_dim);
    }
  }
  a.formats_present = formats;
  TRIAX_RETURN_IF_ERROR(Check(
      cudaMemcpyAsync(lane.scratch, h, up, cudaMemcpyHostToDevice, lane.stream),
      "DecodeAttention upload"));
  const auto* dmeta =
      reinterpret_cast<const int32_t*>(lane.scratch + q_bytes + table_bytes);
  a.q = reinterpret_cast<const float*>(lane.scratch);
  a.out = reinterpret_cast<float*>(lane.scratch + up);
  a.pages = reinterpret_cast<const kc::DevicePage*>(lane.scratch + q_bytes);
  a.page_indptr = dmeta;
  a.attend_tokens = dmeta + n + 1;
  a.stream = lane.stream;
  a.workspace = ws > 0 ? lane.workspace : nullptr;
  a.workspace_bytes = ws > 0 ? lane.workspace_bytes : 0;
  TRIAX_RETURN_IF_ERROR(Check(cudaEventRecord(lane.kernel_start, lane.stream),
                              "DecodeAttention event"));
  TRIAX_RETURN_IF_ERROR(Launched(kc::DecodeAttentionCuda(a)));
  TRIAX_RETURN_IF_ERROR(Check(cudaEventRecord(lane.kernel_stop, lane.stream),
                              "DecodeAttention event"));
  TRIAX_RETURN_IF_ERROR(
      Check(cudaMemcpyAsync(h + up, lane.scratch + up, n * qvalues * 4,
                            cudaMemcpyDeviceToHost, lane.stream),
            "DecodeAttention download"));
  TRIAX_RETURN_IF_ERROR(Sync(lane, "DecodeAttention"));
  float kernel_ms = 0.f;
  if (cudaEventElapsedTime(&kernel_ms, lane.kernel_start, lane.kernel_stop) ==
      cudaSuccess) {
    AddAttentionKernelNs(static_cast<uint64_t>(double{kernel_ms} * 1e6));
  }
  for (int i = 0; i < n; ++i) {
    std::memcpy(batch[idx[i]].out, h + up + i * qvalues * 4, qvalues * 4);
  }
  return absl::OkStatus();
}

absl::Status CudaDevice::DemotePages(const PageShape& shape,
                                     absl::Span<const DemoteJob> jobs) {
  if (jobs.empty()) return absl::OkStatus();
  std::vector<kc::DevicePage> src(jobs.size()), dst(jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    const DemoteJob& j = jobs[i];
    for (const Encoding* e : {&j.from, &j.to}) {
      if (absl::Status s = kc::CheckEncodingCuda(*e, shape); !s.ok()) {
        return absl::Status(s.code(),
                            absl::StrCat("jobs[", i, "]: ", s.message()));
      }
    }
    if (j.num_tokens < 1 || j.num_tokens > shape.tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("jobs[", i, "].num_tokens=", j.num_tokens,
                       " is outside 1..", shape.tokens));
    }
    src[i].data = const_cast<uint8_t*>(j.src);
    src[i].num_tokens = j.num_tokens;
    src[i].format = kc::PackEncoding(j.from);
    dst[i].data = j.dst;
    dst[i].num_tokens = j.num_tokens;
    dst[i].format = kc::PackEncoding(j.to);
  }
  const size_t per_page = std::max<size_t>(1, kc::DemoteScratchBytes(shape, 1));
  const size_t chunk = std::max<size_t>(1, kMaxDemoteScratchBytes / per_page);
  TRIAX_ASSIGN_OR_RETURN(Lease lane, Begin());
  for (size_t at = 0; at < jobs.size(); at += chunk) {
    const int n = static_cast<int>(std::min(chunk, jobs.size() - at));
    // Device scratch: src table | dst table | decode scratch.
    const size_t table = AlignUp(n * sizeof(kc::DevicePage));
    const size_t scratch = kc::DemoteScratchBytes(shape, n);
    TRIAX_RETURN_IF_ERROR(Reserve(*lane, 2 * table, 2 * table + scratch));
    std::memcpy(lane->host, src.data() + at, n * sizeof(kc::DevicePage));
    std::memcpy(lane->host + table, dst.data() + at,
                n * sizeof(kc::DevicePage));
    TRIAX_RETURN_IF_ERROR(
        Check(cudaMemcpyAsync(lane->scratch, lane->host, 2 * table,
                              cudaMemcpyHostToDevice, lane->stream),
              "DemotePages upload"));
    kc::DemotePagesParams p;
    p.shape = shape;
    p.src = reinterpret_cast<const kc::DevicePage*>(lane->scratch);
    p.dst = reinterpret_cast<const kc::DevicePage*>(lane->scratch + table);
    p.num_pages = n;
    p.scratch = lane->scratch + 2 * table;
    p.scratch_bytes = scratch;
    p.stream = lane->stream;
    TRIAX_RETURN_IF_ERROR(Launched(kc::DemotePagesCuda(p)));
    // The host tables are rewritten by the next chunk: wait for the upload.
    TRIAX_RETURN_IF_ERROR(Sync(*lane, "DemotePages"));
  }
  return absl::OkStatus();
}

}  // namespace triax::worker
