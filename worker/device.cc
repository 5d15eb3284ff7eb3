#include "worker/device.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/ids.h"
#include "common/status_macros.h"
#include "kernels/numeric.h"
#include "worker/checksum.h"
#include "worker/link_tcp.h"

namespace triax::worker {

absl::Status Device::DecodeAttentionBatch(
    absl::Span<const kernels::DecodeParams> batch) {
  const absl::Time start = absl::Now();
  for (size_t i = 0; i < batch.size(); ++i) {
    if (absl::Status s = DecodeAttention(batch[i]); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("batch[", i, "]: ", s.message()));
    }
  }
  // Entries run one by one on the host: the kernel is the whole call.
  AddAttentionKernelNs(
      static_cast<uint64_t>(absl::ToInt64Nanoseconds(absl::Now() - start)));
  return absl::OkStatus();
}

absl::Status CheckTokenWrites(const kernels::PageShape& shape,
                              absl::Span<const TokenWrite> writes) {
  for (size_t i = 0; i < writes.size(); ++i) {
    const TokenWrite& w = writes[i];
    if (w.page == nullptr || w.k_bf16 == nullptr || w.v_bf16 == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("writes[", i, "]: page, k_bf16 and v_bf16 must be set"));
    }
    if (w.num_tokens < 1 || w.first_slot < 0 ||
        w.first_slot + w.num_tokens > shape.tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("writes[", i, "]: slots [", w.first_slot, ", ",
                       w.first_slot + w.num_tokens,
                       ") are not a non-empty range inside the page's ",
                       shape.tokens, " tokens"));
    }
  }
  return absl::OkStatus();
}

absl::Status Device::WriteBf16TokensBatch(const kernels::PageShape& shape,
                                          absl::Span<const TokenWrite> writes) {
  TRIAX_RETURN_IF_ERROR(CheckTokenWrites(shape, writes));
  for (size_t i = 0; i < writes.size(); ++i) {
    const TokenWrite& w = writes[i];
    if (absl::Status s = WriteBf16Tokens(shape, w.k_bf16, w.v_bf16,
                                         w.first_slot, w.num_tokens, w.page);
        !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("writes[", i, "]: ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status Device::DemotePages(const kernels::PageShape& shape,
                                 absl::Span<const DemoteJob> jobs) {
  std::vector<float> kf, vf;
  std::vector<uint16_t> k, v;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const DemoteJob& j = jobs[i];
    if (j.num_tokens < 1 || j.num_tokens > shape.tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("jobs[", i, "].num_tokens=", j.num_tokens,
                       " is outside 1..", shape.tokens));
    }
    const size_t n =
        static_cast<size_t>(j.num_tokens) * shape.heads * shape.head_dim;
    kf.resize(n);
    vf.resize(n);
    k.resize(n);
    v.resize(n);
    if (absl::Status s = DecodePage(j.from, shape, j.src, j.num_tokens,
                                    kf.data(), vf.data());
        !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("jobs[", i, "]: ", s.message()));
    }
    for (size_t x = 0; x < n; ++x) {
      k[x] = kernels::FloatToBf16(kf[x]);
      v[x] = kernels::FloatToBf16(vf[x]);
    }
    if (absl::Status s =
            EncodePage(j.to, shape, k.data(), v.data(), j.num_tokens, j.dst);
        !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("jobs[", i, "]: ", s.message()));
    }
  }
  return absl::OkStatus();
}

std::string HostBootId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (!(in >> id) || id.empty()) return "unknown";
  return id;
}

absl::Status Device::Checksum(absl::Span<const DeviceBytes> ranges,
                              absl::Span<uint32_t> crcs) {
  if (crcs.size() != ranges.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Checksum: ", crcs.size(), " outputs for ", ranges.size(), " ranges"));
  }
  std::vector<uint8_t> host;
  for (size_t i = 0; i < ranges.size(); ++i) {
    host.resize(ranges[i].bytes);
    if (!host.empty()) {
      if (absl::Status s =
              CopyToHost(host.data(), ranges[i].data, ranges[i].bytes);
          !s.ok()) {
        return s;
      }
    }
    crcs[i] = Crc32c(host.data(), host.size());
  }
  return absl::OkStatus();
}

absl::Status Device::CopyPagesChecked(absl::Span<const PageCopy> jobs,
                                      absl::Span<uint32_t> crcs) {
  if (crcs.size() != jobs.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("CopyPagesChecked: ", crcs.size(), " outputs for ",
                     jobs.size(), " jobs"));
  }
  std::vector<DeviceBytes> copied(jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (absl::Status s = CopyPage(jobs[i].dst, jobs[i].src, jobs[i].bytes);
        !s.ok()) {
      return s;
    }
    copied[i] = DeviceBytes{jobs[i].dst, jobs[i].bytes};
  }
  return Checksum(copied, crcs);
}

namespace {

// Device::NewCheckedCopies's default: each batch copied and checksummed by
// CopyPagesChecked when it starts.
class SyncCheckedCopies final : public CheckedCopies {
 public:
  explicit SyncCheckedCopies(Device* device) : device_(device) {}
  absl::Status Start(absl::Span<const PageCopy> jobs) override {
    if (in_flight_ == kMaxInFlight) {
      return absl::FailedPreconditionError(
          absl::StrCat("CheckedCopies: ", kMaxInFlight,
                       " batches are in flight; finish one first"));
    }
    std::vector<uint32_t>& crcs = crcs_[(first_ + in_flight_) % kMaxInFlight];
    crcs.resize(jobs.size());
    TRIAX_RETURN_IF_ERROR(
        device_->CopyPagesChecked(jobs, absl::MakeSpan(crcs)));
    in_flight_ += 1;
    return absl::OkStatus();
  }
  absl::Status Finish(absl::Span<uint32_t> crcs) override {
    if (in_flight_ == 0) {
      return absl::FailedPreconditionError(
          "CheckedCopies: no batch is in flight");
    }
    const std::vector<uint32_t>& done = crcs_[first_];
    if (crcs.size() != done.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("CheckedCopies: ", crcs.size(), " outputs for ",
                       done.size(), " jobs"));
    }
    std::copy(done.begin(), done.end(), crcs.begin());
    first_ = (first_ + 1) % kMaxInFlight;
    in_flight_ -= 1;
    return absl::OkStatus();
  }
  size_t in_flight() const override { return in_flight_; }

 private:
  Device* const device_;
  std::vector<uint32_t> crcs_[kMaxInFlight];
  size_t first_ = 0;
  size_t in_flight_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CheckedCopies>> Device::NewCheckedCopies() {
  return std::make_unique<SyncCheckedCopies>(this);
}

absl::StatusOr<std::string> Device::ShareArena(const uint8_t*, size_t) {
  return absl::UnimplementedError(
      absl::StrCat("the ", Name(), " backend does not share its arena"));
}

absl::StatusOr<const uint8_t*> Device::OpenPeerArena(absl::string_view,
                                                     size_t) {
  return absl::UnimplementedError(
      absl::StrCat("the ", Name(), " backend cannot map a peer's arena"));
}

absl::Status Device::EnableLinks(const LinkOptions&) {
  return absl::FailedPreconditionError(
      absl::StrCat("the ", Name(), " backend has no links"));
}

absl::StatusOr<std::string> Device::NewLinkId() {
  return absl::UnimplementedError(
      absl::StrCat("the ", Name(), " backend has no links enabled"));
}

absl::StatusOr<std::unique_ptr<DeviceLink>> Device::ConnectLink(
    absl::string_view, int, absl::Time, const std::function<bool()>&) {
  return absl::UnimplementedError(
      absl::StrCat("the ", Name(), " backend has no links enabled"));
}

CpuDevice::CpuDevice(bool share_arena) : share_arena_(share_arena) {}
CpuDevice::~CpuDevice() = default;

absl::Status CpuDevice::EnableLinks(const LinkOptions& options) {
  if (absl::Status s = TcpLinkFactory::CheckHost(options.tcp_host); !s.ok()) {
    return s;
  }
  links_ = std::make_unique<TcpLinkFactory>(options.tcp_host);
  return absl::OkStatus();
}

std::string CpuDevice::LinkBackend() const {
  return links_ == nullptr ? "" : "tcp";
}

absl::StatusOr<std::string> CpuDevice::NewLinkId() {
  if (links_ == nullptr) return Device::NewLinkId();
  return links_->NewLinkId();
}

absl::StatusOr<std::unique_ptr<DeviceLink>> CpuDevice::ConnectLink(
    absl::string_view id, int rank, absl::Time deadline,
    const std::function<bool()>& cancelled) {
  if (links_ == nullptr) {
    return Device::ConnectLink(id, rank, deadline, cancelled);
  }
  return links_->Connect(id, rank, deadline, cancelled);
}

absl::StatusOr<uint8_t*> CpuDevice::AllocateArena(size_t bytes) {
  if (bytes == 0) {
    return absl::InvalidArgumentError("arena bytes must be > 0");
  }
  if (share_arena_) {
    // A memfd mapping: page aligned, zero filled, and openable by a peer
    // process through /proc/<pid>/fd/<fd>.
    const int fd = memfd_create("triax-arena", MFD_CLOEXEC);
    if (fd < 0) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cpu backend: memfd_create for a shared arena of ",
                       bytes, " bytes: ", std::strerror(errno)));
    }
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      const int err = errno;
      close(fd);
      return absl::ResourceExhaustedError(
          absl::StrCat("cpu backend: sizing a shared arena to ", bytes,
                       " bytes: ", std::strerror(err)));
    }
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      close(fd);
      return absl::ResourceExhaustedError(
          absl::StrCat("cpu backend: mapping a shared arena of ", bytes,
                       " bytes: ", std::strerror(err)));
    }
    absl::MutexLock lock(&mu_);
    shared_fds_[static_cast<const uint8_t*>(p)] = fd;
    return static_cast<uint8_t*>(p);
  }
  const size_t rounded = (bytes + 255) & ~size_t{255};
  void* p = std::aligned_alloc(256, rounded);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cpu backend: cannot allocate an arena of ", bytes,
                     " bytes from host memory"));
  }
  return static_cast<uint8_t*>(p);
}

void CpuDevice::FreeArena(uint8_t* base, size_t bytes) {
  {
    absl::MutexLock lock(&mu_);
    auto it = shared_fds_.find(base);
    if (it != shared_fds_.end()) {
      munmap(base, bytes);
      close(it->second);
      shared_fds_.erase(it);
      return;
    }
  }
  std::free(base);
}

absl::Status CpuDevice::Checksum(absl::Span<const DeviceBytes> ranges,
                                 absl::Span<uint32_t> crcs) {
  if (crcs.size() != ranges.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Checksum: ", crcs.size(), " outputs for ", ranges.size(), " ranges"));
  }
  for (size_t i = 0; i < ranges.size(); ++i) {
    crcs[i] = Crc32c(ranges[i].data, ranges[i].bytes);
  }
  return absl::OkStatus();
}

absl::Status CpuDevice::CopyPagesChecked(absl::Span<const PageCopy> jobs,
                                         absl::Span<uint32_t> crcs) {
  if (crcs.size() != jobs.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("CopyPagesChecked: ", crcs.size(), " outputs for ",
                     jobs.size(), " jobs"));
  }
  for (size_t i = 0; i < jobs.size(); ++i) {
    std::memcpy(jobs[i].dst, jobs[i].src, jobs[i].bytes);
    crcs[i] = Crc32c(jobs[i].dst, jobs[i].bytes);
  }
  return absl::OkStatus();
}

std::string CpuDevice::ShareDomain() const {
  return share_arena_ ? absl::StrCat("cpu:", HostBootId()) : "";
}

absl::StatusOr<std::string> CpuDevice::ShareArena(const uint8_t* base,
                                                  size_t /*bytes*/) {
  if (!share_arena_) return Device::ShareArena(base, 0);
  absl::MutexLock lock(&mu_);
  auto it = shared_fds_.find(base);
  if (it == shared_fds_.end()) {
    return absl::InvalidArgumentError(
        "cpu backend: ShareArena of a pointer that is not a shared arena's "
        "base");
  }
  return absl::StrCat(getpid(), ":", it->second);
}

absl::StatusOr<const uint8_t*> CpuDevice::OpenPeerArena(
    absl::string_view handle, size_t bytes) {
  if (!share_arena_) return Device::OpenPeerArena(handle, bytes);
  std::pair<absl::string_view, absl::string_view> parts =
      absl::StrSplit(handle, absl::MaxSplits(':', 1));
  int pid = 0, fd = 0;
  if (!absl::SimpleAtoi(parts.first, &pid) ||
      !absl::SimpleAtoi(parts.second, &fd) || pid <= 0 || fd < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cpu backend: shared arena handle ", Quote(handle),
                     " is not \"<pid>:<fd>\""));
  }
  if (bytes == 0) {
    return absl::InvalidArgumentError("cpu backend: peer arena bytes is 0");
  }
  const std::string path = absl::StrCat("/proc/", pid, "/fd/", fd);
  const int peer = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (peer < 0) {
    return absl::UnavailableError(
        absl::StrCat("cpu backend: cannot open the peer arena ", path, ": ",
                     std::strerror(errno)));
  }
  struct stat st;
  if (fstat(peer, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    close(peer);
    return absl::InvalidArgumentError(
        absl::StrCat("cpu backend: the peer arena ", path, " has ",
                     static_cast<long long>(st.st_size), " bytes, not the ",
                     bytes, " its handle says"));
  }
  void* p = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, peer, 0);
  const int err = errno;
  close(peer);  // the mapping stays
  if (p == MAP_FAILED) {
    return absl::UnavailableError(
        absl::StrCat("cpu backend: cannot map the peer arena ", path, ": ",
                     std::strerror(err)));
  }
  return static_cast<const uint8_t*>(p);
}

void CpuDevice::ClosePeerArena(const uint8_t* base, size_t bytes) {
  if (base != nullptr) munmap(const_cast<uint8_t*>(base), bytes);
}

absl::Status CpuDevice::EncodePage(const kernels::Encoding& e,
                                   const kernels::PageShape& shape,
                                   const uint16_t* k_bf16,
                                   const uint16_t* v_bf16, int num_tokens,
                                   uint8_t* page) {
  kernels::EncodePage(e, shape, k_bf16, v_bf16, num_tokens, page);
  return absl::OkStatus();
}

absl::Status CpuDevice::DecodePage(const kernels::Encoding& e,
                                   const kernels::PageShape& shape,
                                   const uint8_t* page, int num_tokens,
                                   float* k_out, float* v_out) {
  kernels::DecodePage(e, shape, page, num_tokens, k_out, v_out);
  return absl::OkStatus();
}

absl::Status CpuDevice::WriteBf16Tokens(const kernels::PageShape& shape,
                                        const uint16_t* k_bf16,
                                        const uint16_t* v_bf16, int first_slot,
                                        int num_tokens, uint8_t* page) {
  const size_t stride = static_cast<size_t>(shape.heads) * shape.head_dim;
  for (int i = 0; i < num_tokens; ++i) {
    kernels::WriteBf16Token(shape, k_bf16 + i * stride, v_bf16 + i * stride,
                            first_slot + i, page);
  }
  return absl::OkStatus();
}

absl::Status CpuDevice::CopyPage(uint8_t* dst, const uint8_t* src,
                                 size_t bytes) {
  std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status CpuDevice::DecodeAttention(const kernels::DecodeParams& p) {
  kernels::DecodeAttentionRef(p);
  return absl::OkStatus();
}

absl::Status CpuDevice::CopyToHost(void* host_dst, const uint8_t* dev_src,
                                   size_t bytes) {
  std::memcpy(host_dst, dev_src, bytes);
  return absl::OkStatus();
}

absl::Status CpuDevice::CopyFromHost(uint8_t* dev_dst, const void* host_src,
                                     size_t bytes) {
  std::memcpy(dev_dst, host_src, bytes);
  return absl::OkStatus();
}

absl::StatusOr<uint8_t*> CpuDevice::AllocateHostTier(size_t bytes) {
  if (bytes == 0) {
    return absl::InvalidArgumentError("host tier bytes must be > 0");
  }
  const size_t rounded = (bytes + 255) & ~size_t{255};
  void* p = std::aligned_alloc(256, rounded);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cpu backend: cannot allocate a host tier of ", bytes, " bytes"));
  }
  return static_cast<uint8_t*>(p);
}

void CpuDevice::FreeHostTier(uint8_t* base, size_t /*bytes*/) {
  std::free(base);
}

absl::StatusOr<std::unique_ptr<Device>> CreateDevice(
    absl::string_view backend, const DeviceOptions& options) {
  if (backend == "cpu") {
    return std::unique_ptr<Device>(new CpuDevice(options.share_arena));
  }
  if (backend == "cuda") {
    if (absl::Status s = CudaAvailable(); !s.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("backend=\"cuda\": ", s.message(),
                       "; use --backend=cpu or --backend=auto"));
    }
    return CreateCudaDevice(options.cuda_device);
  }
  if (backend == "auto") {
    if (CudaAvailable().ok()) return CreateCudaDevice(options.cuda_device);
    return std::unique_ptr<Device>(new CpuDevice(options.share_arena));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "backend=", Quote(backend), " is not one of auto, cpu, cuda"));
}

}  // namespace triax::worker
