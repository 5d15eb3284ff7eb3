#include "worker/link_nccl.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>

#include <cstring>
#include <deque>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/ids.h"

namespace triax::worker {

struct NcclLinks::Api {
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRankConfig) init_rank_config = nullptr;
  decltype(&ncclCommGetAsyncError) get_async_error = nullptr;
  decltype(&ncclCommAbort) abort = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  decltype(&ncclGetLastError) last_error = nullptr;
  int version = 0;
};

namespace {

using Api = NcclLinks::Api;

std::string NcclError(const Api& api, ncclResult_t r, ncclComm_t comm) {
  std::string s = absl::StrCat("NCCL ", api.error_string(r));
  const char* last = api.last_error(comm);
  if (last != nullptr && last[0] != '\0') absl::StrAppend(&s, " (", last, ")");
  return s;
}

std::string CudaError(cudaError_t e) {
  return absl::StrCat(cudaGetErrorName(e), ": ", cudaGetErrorString(e));
}

// Poll pacing: spin (yielding) for the first 200 us, then sleep 20 us.
void Pace(absl::Time started) {
  if (absl::Now() - started < absl::Microseconds(200)) {
    std::this_thread::yield();
  } else {
    absl::SleepFor(absl::Microseconds(20));
  }
}

class NcclLink final : public DeviceLink {
 public:
  NcclLink(const Api* api, int ordinal, ncclComm_t comm, cudaStream_t stream,
           int peer)
      : api_(api),
        ordinal_(ordinal),
        comm_(comm),
        stream_(stream),
        peer_(peer) {}

  ~NcclLink() override {
    Abort("the link was closed");
    cudaSetDevice(ordinal_);
    cudaStreamSynchronize(stream_);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    cudaStreamDestroy(stream_);
  }

  const char* backend() const override { return "nccl"; }

  absl::StatusOr<uint64_t> PostSend(const uint8_t* src, size_t bytes,
                                    absl::Time deadline) override {
    return Post(true, const_cast<uint8_t*>(src), bytes, deadline);
  }
  absl::StatusOr<uint64_t> PostRecv(uint8_t* dst, size_t bytes,
                                    absl::Time deadline) override {
    return Post(false, dst, bytes, deadline);
  }

  absl::Status Wait(uint64_t ticket, absl::Time deadline,
                    const std::function<bool()>& cancelled) override {
    cudaEvent_t event = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (ticket == 0 || ticket > posted_) {
        return absl::InvalidArgumentError(
            absl::StrCat("nccl link: ticket ", ticket, " was not issued (",
                         posted_, " operations posted)"));
      }
      if (ticket <= done_) return absl::OkStatus();
      if (!error_.ok()) return error_;
      event = events_[ticket - done_ - 1];
    }
    cudaSetDevice(ordinal_);
    const absl::Time started = absl::Now();
    while (true) {
      const cudaError_t e = cudaEventQuery(event);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) {
        const std::string why = absl::StrCat("cudaEventQuery: ", CudaError(e));
        Abort(why);
        return absl::UnavailableError(absl::StrCat("nccl link: ", why));
      }
      if (absl::Status s = Poll(deadline, cancelled, ticket); !s.ok()) {
        return s;
      }
      Pace(started);
    }
    absl::MutexLock lock(&mu_);
    while (done_ < ticket && !events_.empty()) {
      cudaEventDestroy(events_.front());
      events_.pop_front();
      ++done_;
    }
    return absl::OkStatus();
  }

  void Abort(absl::string_view why) override {
    absl::MutexLock lock(&mu_);
    AbortLocked(why);
  }

  bool aborted() const override {
    absl::MutexLock lock(&mu_);
    return comm_ == nullptr;
  }

 private:
  void AbortLocked(absl::string_view why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (comm_ == nullptr) return;
    if (error_.ok()) {
      error_ = absl::UnavailableError(absl::StrCat("nccl link aborted: ", why));
    }
    cudaSetDevice(ordinal_);
    api_->abort(comm_);  // ends the link's kernels; needs no peer
    comm_ = nullptr;
  }

  // One look at the communicator's state and the clock: OK to go on
  // waiting; else the link is aborted and the reason returned.
  absl::Status Poll(absl::Time deadline, const std::function<bool()>& cancelled,
                    uint64_t ticket) {
    absl::MutexLock lock(&mu_);
    if (comm_ == nullptr) return error_;
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = api_->get_async_error(comm_, &state);
    if (r != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
      const std::string why =
          NcclError(*api_, r != ncclSuccess ? r : state, comm_);
      AbortLocked(why);
      return absl::UnavailableError(absl::StrCat("nccl link: ", why));
    }
    if (cancelled && cancelled()) {
      AbortLocked("the transfer was cancelled");
      return absl::CancelledError(
          "nccl link: the transfer was cancelled; the communicator is "
          "aborted");
    }
    if (absl::Now() >= deadline) {
      AbortLocked("an operation missed its deadline");
      return absl::DeadlineExceededError(absl::StrCat(
          "nccl link: operation ", ticket,
          " did not complete by its "
          "deadline (",
          done_, " of ", posted_, " done); the communicator is aborted"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<uint64_t> Post(bool send, uint8_t* data, size_t bytes,
                                absl::Time deadline) {
    if (bytes == 0) {
      return absl::InvalidArgumentError("nccl link: an operation of 0 bytes");
    }
    cudaSetDevice(ordinal_);
    {
      absl::MutexLock lock(&mu_);
      if (comm_ == nullptr) return error_;
      const ncclResult_t r =
          send ? api_->send(data, bytes, ncclUint8, peer_, comm_, stream_)
               : api_->recv(data, bytes, ncclUint8, peer_, comm_, stream_);
      if (r != ncclSuccess && r != ncclInProgress) {
        const std::string why = NcclError(*api_, r, comm_);
        AbortLocked(why);
        return absl::UnavailableError(
            absl::StrCat("nccl link: ", send ? "ncclSend" : "ncclRecv", " of ",
                         bytes, " bytes: ", why));
      }
    }
    // A non-blocking communicator may still be enqueuing (connecting to
    // the peer on the first operation): wait until it is done.
    const absl::Time started = absl::Now();
    while (true) {
      {
        absl::MutexLock lock(&mu_);
        if (comm_ == nullptr) return error_;
        ncclResult_t state = ncclSuccess;
        api_->get_async_error(comm_, &state);
        if (state == ncclSuccess) break;
      }
      if (absl::Status s = Poll(deadline, nullptr, posted_ + 1); !s.ok()) {
        return s;
      }
      Pace(started);
    }
    cudaEvent_t event = nullptr;
    cudaError_t e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(event, stream_);
    absl::MutexLock lock(&mu_);
    if (e != cudaSuccess) {
      if (event != nullptr) cudaEventDestroy(event);
      const std::string why = absl::StrCat("cudaEventRecord: ", CudaError(e));
      AbortLocked(why);
      return absl::UnavailableError(absl::StrCat("nccl link: ", why));
    }
    events_.push_back(event);
    return ++posted_;
  }

  const Api* const api_;
  const int ordinal_;
  mutable absl::Mutex mu_;
  ncclComm_t comm_ ABSL_GUARDED_BY(mu_);  // null once aborted
  cudaStream_t stream_;
  const int peer_;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  // Events of operations (done_, posted_].
  std::deque<cudaEvent_t> events_ ABSL_GUARDED_BY(mu_);
  uint64_t posted_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t done_ ABSL_GUARDED_BY(mu_) = 0;
};

template <typename F>
bool Bind(void* handle, const char* name, F* out, std::string* missing) {
  *out = reinterpret_cast<F>(dlsym(handle, name));
  if (*out == nullptr && missing->empty()) *missing = name;
  return *out != nullptr;
}

}  // namespace

NcclLinks::NcclLinks(void* handle, std::unique_ptr<Api> api, int ordinal)
    : handle_(handle), api_(std::move(api)), ordinal_(ordinal) {}

// The library stays loaded: NCCL's own threads may outlive the last link.
NcclLinks::~NcclLinks() = default;

absl::StatusOr<std::unique_ptr<NcclLinks>> NcclLinks::Load(
    const std::string& library, int ordinal) {
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = dlerror();
    return absl::FailedPreconditionError(
        absl::StrCat("cannot load NCCL from ", Quote(library), ": ",
                     err == nullptr ? "dlopen failed" : err));
  }
  auto api = std::make_unique<Api>();
  std::string missing;
  Bind(handle, "ncclGetVersion", &api->get_version, &missing);
  Bind(handle, "ncclGetUniqueId", &api->get_unique_id, &missing);
  Bind(handle, "ncclCommInitRankConfig", &api->init_rank_config, &missing);
  Bind(handle, "ncclCommGetAsyncError", &api->get_async_error, &missing);
  Bind(handle, "ncclCommAbort", &api->abort, &missing);
  Bind(handle, "ncclSend", &api->send, &missing);
  Bind(handle, "ncclRecv", &api->recv, &missing);
  Bind(handle, "ncclGetErrorString", &api->error_string, &missing);
  Bind(handle, "ncclGetLastError", &api->last_error, &missing);
  if (!missing.empty()) {
    dlclose(handle);
    return absl::FailedPreconditionError(absl::StrCat(
        "NCCL library ", Quote(library), " lacks ", missing,
        " (NCCL 2.14 or later is needed: non-blocking communicators)"));
  }
  api->get_version(&api->version);
  if (api->version < NCCL_VERSION(2, 14, 0)) {
    dlclose(handle);
    return absl::FailedPreconditionError(absl::StrCat(
        "NCCL library ", Quote(library), " is version ", api->version,
        "; 2.14 or later is needed (non-blocking communicators)"));
  }
  return std::unique_ptr<NcclLinks>(
      new NcclLinks(handle, std::move(api), ordinal));
}

std::string NcclLinks::version() const {
  const int v = api_->version;
  return absl::StrCat(v / 10000, ".", (v / 100) % 100, ".", v % 100);
}

absl::StatusOr<std::string> NcclLinks::NewLinkId() {
  ncclUniqueId id;
  const ncclResult_t r = api_->get_unique_id(&id);
  if (r != ncclSuccess) {
    return absl::UnavailableError(
        absl::StrCat("ncclGetUniqueId: ", NcclError(*api_, r, nullptr)));
  }
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<DeviceLink>> NcclLinks::Connect(
    absl::string_view id, int rank, absl::Time deadline,
    const std::function<bool()>& cancelled) {
  if (rank != 0 && rank != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("link rank ", rank, " is not 0 or 1"));
  }
  ncclUniqueId unique;
  if (id.size() != sizeof(unique.internal)) {
    return absl::InvalidArgumentError(absl::StrCat("an NCCL link id has ",
                                                   sizeof(unique.internal),
                                                   " bytes, not ", id.size()));
  }
  std::memcpy(unique.internal, id.data(), sizeof(unique.internal));
  cudaError_t e = cudaSetDevice(ordinal_);
  cudaStream_t stream = nullptr;
  if (e == cudaSuccess) {
    e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  }
  if (e != cudaSuccess) {
    return absl::UnavailableError(
        absl::StrCat("nccl link: cuda device ", ordinal_, ": ", CudaError(e)));
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  // An older library reads the fields of its own version.
  if (static_cast<unsigned>(api_->version) < config.version) {
    config.version = static_cast<unsigned>(api_->version);
  }
  ncclComm_t comm = nullptr;
  ncclResult_t r = api_->init_rank_config(&comm, 2, unique, rank, &config);
  const absl::Time started = absl::Now();
  auto fail = [&](absl::Status s) {
    if (comm != nullptr) api_->abort(comm);
    cudaStreamDestroy(stream);
    return s;
  };
  while (r == ncclSuccess || r == ncclInProgress) {
    ncclResult_t state = ncclInProgress;
    if (comm != nullptr) api_->get_async_error(comm, &state);
    if (state == ncclSuccess) {
      return std::unique_ptr<DeviceLink>(
          new NcclLink(api_.get(), ordinal_, comm, stream, 1 - rank));
    }
    if (state != ncclInProgress) {
      r = state;
      break;
    }
    if (cancelled && cancelled()) {
      return fail(absl::CancelledError(
          "nccl link: cancelled while the communicator was being made"));
    }
    if (absl::Now() >= deadline) {
      return fail(absl::DeadlineExceededError(absl::StrCat(
          "nccl link: the peer did not join rank ", 1 - rank,
          " of the communicator in time (ncclCommInitRankConfig aborted)")));
    }
    Pace(started);
  }
  return fail(absl::UnavailableError(
      absl::StrCat("nccl link: ncclCommInitRankConfig as rank ", rank, ": ",
                   NcclError(*api_, r, comm))));
}

}  // namespace triax::worker
