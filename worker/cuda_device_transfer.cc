// CudaDevice's transfer operations: checksums and checked copies on the
// device, and CUDA IPC for the ipc data path (worker/cuda_device.h).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/kv_cuda.cuh"
#include "worker/cuda_device.h"

namespace triax::worker {
namespace {

namespace kc = ::triax::kernels::cuda;

constexpr size_t kAlign = 256;
size_t AlignUp(size_t n) { return (n + kAlign - 1) & ~(kAlign - 1); }

std::string CudaError(cudaError_t e) {
  return absl::StrCat(cudaGetErrorName(e), ": ", cudaGetErrorString(e));
}

}  // namespace

absl::Status CudaDevice::Checksum(absl::Span<const DeviceBytes> ranges,
                                  absl::Span<uint32_t> crcs) {
  if (crcs.size() != ranges.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Checksum: ", crcs.size(), " outputs for ", ranges.size(), " ranges"));
  }
  if (ranges.empty()) return absl::OkStatus();
  TRIAX_ASSIGN_OR_RETURN(Lease lane, Begin());
  for (size_t at = 0; at < ranges.size(); at += kMaxRangesPerLaunch) {
    const size_t n = std::min(kMaxRangesPerLaunch, ranges.size() - at);
    const size_t table = AlignUp(n * sizeof(kc::ByteRange));
    const size_t out = AlignUp(n * sizeof(uint32_t));
    TRIAX_RETURN_IF_ERROR(Reserve(*lane, table + out, table + out));
    auto* host = reinterpret_cast<kc::ByteRange*>(lane->host);
    uint64_t longest = 0;
    for (size_t i = 0; i < n; ++i) {
      host[i].data = ranges[at + i].data;
      host[i].bytes = ranges[at + i].bytes;
      longest = std::max<uint64_t>(longest, host[i].bytes);
    }
    TRIAX_RETURN_IF_ERROR(
        Check(cudaMemcpyAsync(lane->scratch, lane->host, table,
                              cudaMemcpyHostToDevice, lane->stream),
              "Checksum upload"));
    kc::Crc32cParams p;
    p.ranges = reinterpret_cast<const kc::ByteRange*>(lane->scratch);
    p.num_ranges = static_cast<int>(n);
    p.out = reinterpret_cast<uint32_t*>(lane->scratch + table);
    p.stream = lane->stream;
    p.max_range_bytes = longest;
    TRIAX_RETURN_IF_ERROR(Launched(kc::Crc32cCuda(p)));
    TRIAX_RETURN_IF_ERROR(
        Check(cudaMemcpyAsync(lane->host + table, p.out, n * sizeof(uint32_t),
                              cudaMemcpyDeviceToHost, lane->stream),
              "Checksum download"));
    TRIAX_RETURN_IF_ERROR(Sync(*lane, "Checksum"));
    std::memcpy(crcs.data() + at, lane->host + table, n * sizeof(uint32_t));
  }
  return absl::OkStatus();
}

absl::Status CudaDevice::CopyPagesChecked(absl::Span<const PageCopy> jobs,
                                          absl::Span<uint32_t> crcs) {
  if (crcs.size() != jobs.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("CopyPagesChecked: ", crcs.size(), " outputs for ",
                     jobs.size(), " jobs"));
  }
  if (jobs.empty()) return absl::OkStatus();
  TRIAX_ASSIGN_OR_RETURN(Lease lane, Begin());
  for (size_t at = 0; at < jobs.size(); at += kMaxRangesPerLaunch) {
    const size_t n = std::min(kMaxRangesPerLaunch, jobs.size() - at);
    const size_t table = AlignUp(n * sizeof(kc::CopyRange));
    const size_t out = AlignUp(n * sizeof(uint32_t));
    TRIAX_RETURN_IF_ERROR(Reserve(*lane, table + out, table + out));
    auto* host = reinterpret_cast<kc::CopyRange*>(lane->host);
    uint64_t longest = 0;
    for (size_t i = 0; i < n; ++i) {
      host[i] = kc::CopyRange{};
      host[i].src = jobs[at + i].src;
      host[i].dst = jobs[at + i].dst;
      host[i].bytes = jobs[at + i].bytes;
      longest = std::max<uint64_t>(longest, host[i].bytes);
    }
    TRIAX_RETURN_IF_ERROR(
        Check(cudaMemcpyAsync(lane->scratch, lane->host, table,
                              cudaMemcpyHostToDevice, lane->stream),
              "CopyPagesChecked upload"));
    kc::CopyCrc32cParams p;
    p.ranges = reinterpret_cast<const kc::CopyRange*>(lane->scratch);
    p.num_ranges = static_cast<int>(n);
    p.out = reinterpret_cast<uint32_t*>(lane->scratch + table);
    p.stream = lane->stream;
    p.max_range_bytes = longest;
    TRIAX_RETURN_IF_ERROR(Launched(kc::CopyCrc32cCuda(p)));
    TRIAX_RETURN_IF_ERROR(
        Check(cudaMemcpyAsync(lane->host + table, p.out, n * sizeof(uint32_t),
                              cudaMemcpyDeviceToHost, lane->stream),
              "CopyPagesChecked download"));
    TRIAX_RETURN_IF_ERROR(Sync(*lane, "CopyPagesChecked"));
    std::memcpy(crcs.data() + at, lane->host + table, n * sizeof(uint32_t));
  }
  return absl::OkStatus();
}

absl::StatusOr<CudaDevice::CopyLane*> CudaDevice::TakeCopyLane() {
  {
    absl::MutexLock lock(&lanes_mu_);
    if (!free_copy_lanes_.empty()) {
      CopyLane* lane = free_copy_lanes_.back();
      free_copy_lanes_.pop_back();
      return lane;
    }
  }
  auto lane = std::make_unique<CopyLane>();
  absl::Status s =
      Check(cudaStreamCreateWithFlags(&lane->stream, cudaStreamNonBlocking),
            "CheckedCopies cudaStreamCreate");
  for (size_t i = 0; s.ok() && i < CheckedCopies::kMaxInFlight; ++i) {
    s = Check(cudaEventCreateWithFlags(&lane->done[i], cudaEventDisableTiming),
              "CheckedCopies cudaEventCreate");
  }
  if (!s.ok()) {
    for (cudaEvent_t e : lane->done) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (lane->stream != nullptr) cudaStreamDestroy(lane->stream);
    return s;
  }
  absl::MutexLock lock(&lanes_mu_);
  copy_lanes_.push_back(std::move(lane));
  return copy_lanes_.back().get();
}

void CudaDevice::GiveCopyLane(CopyLane* lane) {
  absl::MutexLock lock(&lanes_mu_);
  free_copy_lanes_.push_back(lane);
}

// Batches on the lane's stream complete in order; slot i % kMaxInFlight
// holds batch i's table and CRCs until its Finish.
class CudaDevice::PipelinedCopies final : public CheckedCopies {
 public:
  PipelinedCopies(CudaDevice* device, CopyLane* lane)
      : device_(device), lane_(lane) {}
  ~PipelinedCopies() override {
    // Nothing may write the destinations after this returns. On a poisoned
    // context the lane is not reused.
    const bool ok = in_flight_ == 0 ||
                    (cudaSetDevice(device_->ordinal_) == cudaSuccess &&
                     cudaStreamSynchronize(lane_->stream) == cudaSuccess);
    if (ok) device_->GiveCopyLane(lane_);
  }

  absl::Status Start(absl::Span<const PageCopy> jobs) override {
    if (in_flight_ == kMaxInFlight) {
      return absl::FailedPreconditionError(
          absl::StrCat("CheckedCopies: ", kMaxInFlight,
                       " batches are in flight; finish one first"));
    }
    TRIAX_RETURN_IF_ERROR(device_->BeginNoLane());
    const size_t slot = (first_ + in_flight_) % kMaxInFlight;
    Lane& buf = lane_->slots[slot];
    const size_t n = jobs.size();
    const size_t table = AlignUp(n * sizeof(kc::CopyRange));
    const size_t out = AlignUp(n * sizeof(uint32_t));
    TRIAX_RETURN_IF_ERROR(device_->Reserve(buf, table + out, table + out));
    auto* host = reinterpret_cast<kc::CopyRange*>(buf.host);
    for (size_t i = 0; i < n; ++i) {
      host[i] = kc::CopyRange{};
      host[i].src = jobs[i].src;
      host[i].dst = jobs[i].dst;
      host[i].bytes = jobs[i].bytes;
    }
    cudaStream_t stream = lane_->stream;
    if (n > 0) {
      TRIAX_RETURN_IF_ERROR(
          device_->Check(cudaMemcpyAsync(buf.scratch, buf.host, table,
                                         cudaMemcpyHostToDevice, stream),
                         "CheckedCopies upload"));
      auto* ranges = reinterpret_cast<const kc::CopyRange*>(buf.scratch);
      auto* crcs = reinterpret_cast<uint32_t*>(buf.scratch + table);
      for (size_t at = 0; at < n; at += kMaxRangesPerLaunch) {
        const size_t m = std::min(kMaxRangesPerLaunch, n - at);
        uint64_t longest = 0;
        for (size_t i = at; i < at + m; ++i) {
          longest = std::max<uint64_t>(longest, host[i].bytes);
        }
        kc::CopyCrc32cParams p;
        p.ranges = ranges + at;
        p.num_ranges = static_cast<int>(m);
        p.out = crcs + at;
        p.stream = stream;
        p.max_range_bytes = longest;
        TRIAX_RETURN_IF_ERROR(device_->Launched(kc::CopyCrc32cCuda(p)));
      }
      TRIAX_RETURN_IF_ERROR(device_->Check(
          cudaMemcpyAsync(buf.host + table, crcs, n * sizeof(uint32_t),
                          cudaMemcpyDeviceToHost, stream),
          "CheckedCopies download"));
    }
    TRIAX_RETURN_IF_ERROR(device_->Check(
        cudaEventRecord(lane_->done[slot], stream), "CheckedCopies record"));
    counts_[slot] = n;
    tables_[slot] = table;
    in_flight_ += 1;
    return absl::OkStatus();
  }

  absl::Status Finish(absl::Span<uint32_t> crcs) override {
    if (in_flight_ == 0) {
      return absl::FailedPreconditionError(
          "CheckedCopies: no batch is in flight");
    }
    const size_t slot = first_;
    if (crcs.size() != counts_[slot]) {
      return absl::InvalidArgumentError(
          absl::StrCat("CheckedCopies: ", crcs.size(), " outputs for ",
                       counts_[slot], " jobs"));
    }
    TRIAX_RETURN_IF_ERROR(device_->BeginNoLane());
    TRIAX_RETURN_IF_ERROR(device_->Check(
        cudaEventSynchronize(lane_->done[slot]), "CheckedCopies"));
    if (!crcs.empty()) {
      std::memcpy(crcs.data(), lane_->slots[slot].host + tables_[slot],
                  crcs.size() * sizeof(uint32_t));
    }
    first_ = (first_ + 1) % kMaxInFlight;
    in_flight_ -= 1;
    return absl::OkStatus();
  }

  size_t in_flight() const override { return in_flight_; }

 private:
  CudaDevice* const device_;
  CopyLane* const lane_;
  size_t counts_[kMaxInFlight] = {};
  size_t tables_[kMaxInFlight] = {};
  size_t first_ = 0;
  size_t in_flight_ = 0;
};

absl::StatusOr<std::unique_ptr<CheckedCopies>> CudaDevice::NewCheckedCopies() {
  TRIAX_RETURN_IF_ERROR(BeginNoLane());
  TRIAX_ASSIGN_OR_RETURN(CopyLane * lane, TakeCopyLane());
  return std::unique_ptr<CheckedCopies>(
      std::make_unique<PipelinedCopies>(this, lane));
}

std::string CudaDevice::ShareDomain() const {
  return absl::StrCat("cuda:", HostBootId());
}

absl::StatusOr<std::string> CudaDevice::ShareArena(const uint8_t* base,
                                                   size_t /*bytes*/) {
  TRIAX_RETURN_IF_ERROR(BeginNoLane());
  cudaIpcMemHandle_t handle;
  const cudaError_t e =
      cudaIpcGetMemHandle(&handle, const_cast<uint8_t*>(base));
  if (e != cudaSuccess) {
    cudaGetLastError();  // not sticky: a pointer that is not an allocation
    return absl::InvalidArgumentError(
        absl::StrCat("cuda device ", ordinal_,
                     ": cudaIpcGetMemHandle of the arena: ", CudaError(e)));
  }
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

absl::StatusOr<const uint8_t*> CudaDevice::OpenPeerArena(
    absl::string_view handle, size_t bytes) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda device ", ordinal_, ": a CUDA IPC handle has ",
        sizeof(cudaIpcMemHandle_t), " bytes, not ", handle.size()));
  }
  if (bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda device ", ordinal_, ": peer arena bytes is 0"));
  }
  TRIAX_RETURN_IF_ERROR(BeginNoLane());
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* p = nullptr;
  const cudaError_t e =
      cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    cudaGetLastError();  // a handle that cannot be opened here is not sticky
    return absl::UnavailableError(
        absl::StrCat("cuda device ", ordinal_,
                     ": cannot map the peer's arena (cudaIpcOpenMemHandle): ",
                     CudaError(e)));
  }
  return static_cast<const uint8_t*>(p);
}

absl::Status CudaDevice::EnableLinks(const LinkOptions& options) {
  TRIAX_ASSIGN_OR_RETURN(links_,
                         NcclLinks::Load(options.nccl_library, ordinal_));
  return absl::OkStatus();
}

std::string CudaDevice::LinkBackend() const {
  return links_ == nullptr ? "" : "nccl";
}

absl::StatusOr<std::string> CudaDevice::NewLinkId() {
  if (links_ == nullptr) return Device::NewLinkId();
  TRIAX_RETURN_IF_ERROR(BeginNoLane());
  return links_->NewLinkId();
}

absl::StatusOr<std::unique_ptr<DeviceLink>> CudaDevice::ConnectLink(
    absl::string_view id, int rank, absl::Time deadline,
    const std::function<bool()>& cancelled) {
  if (links_ == nullptr) {
    return Device::ConnectLink(id, rank, deadline, cancelled);
  }
  TRIAX_RETURN_IF_ERROR(BeginNoLane());
  return links_->Connect(id, rank, deadline, cancelled);
}

void CudaDevice::ClosePeerArena(const uint8_t* base, size_t /*bytes*/) {
  if (base == nullptr) return;
  cudaSetDevice(ordinal_);
  cudaIpcCloseMemHandle(const_cast<uint8_t*>(base));
}

}  // namespace triax::worker
