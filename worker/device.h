// The compute and memory backend of a kvworker, chosen once at startup
// (CreateDevice). Service and store logic talk only to this interface, so a
// CUDA backend slots in without #ifdefs in business code.
//
// Pointer spaces: "device" pointers are inside an arena returned by
// AllocateArena (host memory on the CPU backend, HBM on CUDA); "host" pointers
// are ordinary process memory. Page bytes follow kernels/layout.h exactly.
//
// Thread contract: implementations are thread-safe; calls on disjoint pages
// may run concurrently.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/layout.h"
#include "kernels/ref/kv_ref.h"
#include "worker/link.h"

namespace triax::worker {

// One page re-encoding for Device::DemotePages: the first `num_tokens`
// tokens of `src` (encoding `from`) are decoded, rounded to BF16 (nearest
// even) and encoded into `dst` (encoding `to`), whole page written as
// EncodePage writes it. Both are device pointers; dst may equal src.
struct DemoteJob {
  kernels::Encoding from;
  const uint8_t* src = nullptr;
  int num_tokens = 0;  // 1..shape.tokens
  kernels::Encoding to;
  uint8_t* dst = nullptr;
};

// One write for Device::WriteBf16TokensBatch: `num_tokens` host BF16 tokens
// ([num_tokens][H][D] each for K and V) into slots [first_slot, first_slot +
// num_tokens) of the BF16 device page `page`, as WriteBf16Tokens writes them.
struct TokenWrite {
  const uint16_t* k_bf16 = nullptr;
  const uint16_t* v_bf16 = nullptr;
  int first_slot = 0;
  int num_tokens = 0;
  uint8_t* page = nullptr;
};

// INVALID_ARGUMENT naming "writes[i]" for a write without a page or tokens,
// or whose slots are not a non-empty range of the page's shape.tokens.
absl::Status CheckTokenWrites(const kernels::PageShape& shape,
                              absl::Span<const TokenWrite> writes);

// One device-to-device copy for Device::CopyPagesChecked; `src` may lie in
// a peer's arena mapped by OpenPeerArena.
struct PageCopy {
  uint8_t* dst = nullptr;
  const uint8_t* src = nullptr;
  size_t bytes = 0;
};

// Checked copies in a pipeline (Device::NewCheckedCopies): Start submits a
// batch of copies as CopyPagesChecked does and returns without waiting for
// them; Finish waits for the oldest batch started and not yet finished and
// writes its CRC32Cs (one per job, crcs.size() the batch's job count).
// Batches complete in the order started; at most kMaxInFlight are in
// flight (Start refuses another with FAILED_PRECONDITION, as Finish with
// none in flight). The caller keeps every batch's destinations from moving
// or being freed until it is finished; the destructor waits for the
// batches still in flight, so nothing is written after it returns. Used by
// one thread at a time.
class CheckedCopies {
 public:
  static constexpr size_t kMaxInFlight = 2;
  virtual ~CheckedCopies() = default;
  virtual absl::Status Start(absl::Span<const PageCopy> jobs) = 0;
  virtual absl::Status Finish(absl::Span<uint32_t> crcs) = 0;
  virtual size_t in_flight() const = 0;
};

// A byte range in device memory (Device::Checksum).
struct DeviceBytes {
  const uint8_t* data = nullptr;
  size_t bytes = 0;
};

// Device::EnableLinks.
struct LinkOptions {
  // CPU backend: the host (IP address or name) at which peers reach this
  // worker's TCP link listeners: the host of its advertised gRPC address.
  std::string tcp_host = "127.0.0.1";
  // CUDA backend: the NCCL library to load (dlopen: a file name searched
  // on the library path, or a path).
  std::string nccl_library = "libnccl.so.2";
};

class TcpLinkFactory;

class Device {
 public:
  virtual ~Device() = default;

  // "cpu" or "cuda": what the worker reports to the manager as its backend.
  virtual const char* Name() const = 0;

  // OK when this backend can encode, decode and attend over pages of `e` for
  // `shape` (ValidateEncoding(e, shape) having passed); else
  // INVALID_ARGUMENT with the reason (e.g. "tq4 is not supported by the CUDA
  // kernels yet"). The store checks it for every block of a plan before
  // reserving pages, so an unsupported encoding never reaches a kernel.
  virtual absl::Status SupportsEncoding(const kernels::Encoding& e,
                                        const kernels::PageShape& shape) const {
    return absl::OkStatus();
  }

  // OK when DecodeAttention runs for pages of `shape` with `n_q_heads` query
  // heads (a multiple of shape.heads); else INVALID_ARGUMENT with the reason.
  virtual absl::Status SupportsAttention(const kernels::PageShape& shape,
                                         int n_q_heads) const {
    return absl::OkStatus();
  }

  // OK while the backend serves. Once a backend hits an error that poisons
  // its context (a sticky CUDA error), it returns UNAVAILABLE naming the
  // first error, and so does every later call that touches the device.
  virtual absl::Status Health() const { return absl::OkStatus(); }

  // One contiguous arena of `bytes` device bytes, 256-byte aligned.
  // RESOURCE_EXHAUSTED when the backend cannot provide it.
  virtual absl::StatusOr<uint8_t*> AllocateArena(size_t bytes) = 0;
  virtual void FreeArena(uint8_t* base, size_t bytes) = 0;

  // Encodes tokens [0, num_tokens) from host BF16 K/V, token-major
  // [num_tokens][H][D], into the device page (PageBytes(e, shape) bytes).
  // ValidateEncoding(e, shape) must have returned nullptr.
  virtual absl::Status EncodePage(const kernels::Encoding& e,
                                  const kernels::PageShape& shape,
                                  const uint16_t* k_bf16,
                                  const uint16_t* v_bf16, int num_tokens,
                                  uint8_t* page) = 0;

  // Decodes tokens [0, num_tokens) of a device page into host float32,
  // token-major [num_tokens][H][D]. Either output may be null.
  virtual absl::Status DecodePage(const kernels::Encoding& e,
                                  const kernels::PageShape& shape,
                                  const uint8_t* page, int num_tokens,
                                  float* k_out, float* v_out) = 0;

  // Writes `num_tokens` host BF16 tokens ([num_tokens][H][D] each for K and V)
  // into slots [first_slot, first_slot + num_tokens) of a BF16 device page.
  virtual absl::Status WriteBf16Tokens(const kernels::PageShape& shape,
                                       const uint16_t* k_bf16,
                                       const uint16_t* v_bf16, int first_slot,
                                       int num_tokens, uint8_t* page) = 0;

  // Every write of `writes` (pages of one shape; no two writes may share
  // slots of a page), byte-identical to WriteBf16Tokens of each in turn;
  // all complete on return. Every write is checked before anything is
  // written (INVALID_ARGUMENT naming "writes[i]"). The default calls
  // WriteBf16Tokens for each; the CUDA backend uploads them all in one copy
  // and scatters them into their pages in one launch with one
  // synchronization (a decode step's appends: one per sequence).
  virtual absl::Status WriteBf16TokensBatch(
      const kernels::PageShape& shape, absl::Span<const TokenWrite> writes);

  // Copies `bytes` between two device pages.
  virtual absl::Status CopyPage(uint8_t* dst, const uint8_t* src,
                                size_t bytes) = 0;

  // Mixed-format decode attention (kernels/ref/kv_ref.h DecodeParams): q and
  // out are host pointers, pages[i].data device pointers.
  virtual absl::Status DecodeAttention(const kernels::DecodeParams& p) = 0;

  // Decode attention over a batch of independent problems (e.g. one query of
  // each sequence in a decode step), each as DecodeAttention describes; the
  // entries may differ in shape, n_q_heads and scale. Batch-invariant: entry
  // i's output is bit-identical to DecodeAttention(batch[i]) whatever else
  // the batch holds. Every entry is checked before anything runs; an invalid
  // one fails the call (INVALID_ARGUMENT prefixed "batch[i]: ") and no
  // output is written. The default runs the entries one by one; the CUDA
  // backend runs them in one kernel launch per (shape, n_q_heads, scale).
  virtual absl::Status DecodeAttentionBatch(
      absl::Span<const kernels::DecodeParams> batch);

  // Re-encodes pages (DemoteJob), byte-identical to DecodePage into float,
  // rounding to BF16 and EncodePage. No two jobs may share a dst. Encodings
  // must be valid for `shape` and supported (SupportsEncoding). The default
  // does exactly that through host memory; the CUDA backend runs
  // DemotePagesCuda on the device. On error some dst pages may have been
  // written (callers write into fresh pages and swap only on success).
  virtual absl::Status DemotePages(const kernels::PageShape& shape,
                                   absl::Span<const DemoteJob> jobs);

  // Spill tiers (worker/tier_store.h). Copies `bytes` from a device page to
  // host memory and back; returns once the copy is complete, so the host
  // buffer may be read or reused right after.
  virtual absl::Status CopyToHost(void* host_dst, const uint8_t* dev_src,
                                  size_t bytes) = 0;
  virtual absl::Status CopyFromHost(uint8_t* dev_dst, const void* host_src,
                                    size_t bytes) = 0;

  // Host memory for the host spill tier, 256-byte aligned: pinned
  // (page-locked, cudaHostAlloc) on CUDA so tier copies run at DMA speed,
  // ordinary aligned memory on the CPU backend. INVALID_ARGUMENT for 0
  // bytes, RESOURCE_EXHAUSTED when it cannot be had.
  virtual absl::StatusOr<uint8_t*> AllocateHostTier(size_t bytes) = 0;
  virtual void FreeHostTier(uint8_t* base, size_t bytes) = 0;

  // CRC32C (worker/checksum.h) of each range into crcs[i] (same size).
  // The default copies each range to the host; the CUDA backend computes
  // them on the device in one launch.
  virtual absl::Status Checksum(absl::Span<const DeviceBytes> ranges,
                                absl::Span<uint32_t> crcs);

  // Copies every job (no two may overlap) and sets crcs[i] to the CRC32C
  // of the bytes job i copied; all complete on return. The default runs
  // CopyPage and Checksum on the copy; the CUDA backend copies and
  // checksums what landed in one launch for all jobs.
  virtual absl::Status CopyPagesChecked(absl::Span<const PageCopy> jobs,
                                        absl::Span<uint32_t> crcs);
  // A pipeline of CopyPagesChecked batches (CheckedCopies). The default
  // runs each batch by CopyPagesChecked in Start (Finish hands its CRC32Cs
  // over); the CUDA backend launches a batch on a stream of the pipeline's
  // own and returns, so the host checks the next batch while the device
  // copies this one.
  virtual absl::StatusOr<std::unique_ptr<CheckedCopies>> NewCheckedCopies();

  // Shared arenas: the "ipc" transfer path between two worker processes on
  // one host, where the destination maps the source's arena and copies
  // pages device to device (CUDA IPC on the CUDA backend; a memfd mapping
  // on the CPU backend, when DeviceOptions::share_arena is set).
  //
  // Where this device's arenas can be mapped: "<backend>:<host boot id>";
  // empty when this backend does not share (the default).
  virtual std::string ShareDomain() const { return ""; }
  // True when work that two processes submit to this device does not
  // overlap (a GPU without MPS time-slices its processes' contexts). A
  // shared export of stored pages then takes all its checksums before the
  // peer starts copying, instead of one checksum launch per layer between
  // the peer's copies. False (the default) where the two processes run on
  // their own cores, which overlap the source's checksums with the peer's
  // copies.
  virtual bool TimeSlicesProcesses() const { return false; }
  // A handle by which another process of the same ShareDomain maps the
  // arena that AllocateArena returned at `base` (`bytes` long).
  // UNIMPLEMENTED when this backend does not share; INVALID_ARGUMENT for a
  // pointer that is not an arena's base.
  virtual absl::StatusOr<std::string> ShareArena(const uint8_t* base,
                                                 size_t bytes);
  // Maps a peer's arena from its handle (read-only use: a source of
  // CopyPagesChecked and Checksum). INVALID_ARGUMENT for a malformed handle
  // or a length other than the arena's; UNAVAILABLE when it cannot be
  // mapped here (another host, a process gone, no peer access).
  virtual absl::StatusOr<const uint8_t*> OpenPeerArena(absl::string_view handle,
                                                       size_t bytes);
  virtual void ClosePeerArena(const uint8_t* base, size_t bytes) {}

  // Links (worker/link.h): the "link" transfer path between two workers
  // on different devices or hosts. EnableLinks turns them on: TCP
  // listeners on options.tcp_host for the CPU backend, NCCL loaded from
  // options.nccl_library for the CUDA backend; FAILED_PRECONDITION saying
  // why when it cannot (the library is not found or lacks a symbol).
  virtual absl::Status EnableLinks(const LinkOptions& options);
  // "nccl" or "tcp" once EnableLinks succeeded; empty before (the
  // default: no links).
  virtual std::string LinkBackend() const { return ""; }
  // Rank 0 of a new link: an id (opaque bytes) to hand to rank 1.
  // UNIMPLEMENTED without a link backend.
  virtual absl::StatusOr<std::string> NewLinkId();
  // Joins the link of `id` as `rank` (0 or 1) and waits until the peer
  // joined too. DEADLINE_EXCEEDED at `deadline` and CANCELLED when
  // `cancelled` (may be empty) turns true, the half-made link torn down
  // either way; INVALID_ARGUMENT for a malformed id or a rank other than
  // 0 and 1; UNAVAILABLE when the peer cannot be reached or the backend
  // fails (NCCL's message); UNIMPLEMENTED without a link backend.
  virtual absl::StatusOr<std::unique_ptr<DeviceLink>> ConnectLink(
      absl::string_view id, int rank, absl::Time deadline,
      const std::function<bool()>& cancelled);

  // Seconds DecodeAttentionBatch has spent in attention kernels so far
  // (monotonic): on CUDA the device time between events recorded around
  // each launch (no page-table builds, uploads, downloads or waits), on the
  // CPU backend the reference kernel's wall time. The worker exports it as
  // triaxkv_worker_attention_kernel_seconds_total beside the whole batch's
  // triaxkv_worker_attention_seconds.
  double AttentionKernelSeconds() const {
    return static_cast<double>(
               attention_kernel_ns_.load(std::memory_order_relaxed)) *
           1e-9;
  }

 protected:
  void AddAttentionKernelNs(uint64_t ns) {
    attention_kernel_ns_.fetch_add(ns, std::memory_order_relaxed);
  }

 private:
  std::atomic<uint64_t> attention_kernel_ns_{0};
};

// The CPU backend: the arena is host memory and compute is kernels/ref.
//
// With `share_arena` its arenas are memfd mappings (MAP_SHARED) that a
// process of the same host opens through /proc/<pid>/fd/<fd> (the handle
// is "<pid>:<fd>"), so two CPU workers on one host can use the ipc
// transfer path; without it they are ordinary aligned allocations and the
// backend does not share.
class CpuDevice final : public Device {
 public:
  explicit CpuDevice(bool share_arena = false);
  const char* Name() const override { return "cpu"; }
  absl::StatusOr<uint8_t*> AllocateArena(size_t bytes) override;
  void FreeArena(uint8_t* base, size_t bytes) override;
  absl::Status EncodePage(const kernels::Encoding& e,
                          const kernels::PageShape& shape,
                          const uint16_t* k_bf16, const uint16_t* v_bf16,
                          int num_tokens, uint8_t* page) override;
  absl::Status DecodePage(const kernels::Encoding& e,
                          const kernels::PageShape& shape, const uint8_t* page,
                          int num_tokens, float* k_out, float* v_out) override;
  absl::Status WriteBf16Tokens(const kernels::PageShape& shape,
                               const uint16_t* k_bf16, const uint16_t* v_bf16,
                               int first_slot, int num_tokens,
                               uint8_t* page) override;
  absl::Status CopyPage(uint8_t* dst, const uint8_t* src,
                        size_t bytes) override;
  absl::Status DecodeAttention(const kernels::DecodeParams& p) override;
  absl::Status CopyToHost(void* host_dst, const uint8_t* dev_src,
                          size_t bytes) override;
  absl::Status CopyFromHost(uint8_t* dev_dst, const void* host_src,
                            size_t bytes) override;
  absl::StatusOr<uint8_t*> AllocateHostTier(size_t bytes) override;
  void FreeHostTier(uint8_t* base, size_t bytes) override;
  absl::Status Checksum(absl::Span<const DeviceBytes> ranges,
                        absl::Span<uint32_t> crcs) override;
  absl::Status CopyPagesChecked(absl::Span<const PageCopy> jobs,
                                absl::Span<uint32_t> crcs) override;
  std::string ShareDomain() const override;
  absl::StatusOr<std::string> ShareArena(const uint8_t* base,
                                         size_t bytes) override;
  absl::StatusOr<const uint8_t*> OpenPeerArena(absl::string_view handle,
                                               size_t bytes) override;
  void ClosePeerArena(const uint8_t* base, size_t bytes) override;
  // TCP links (worker/link_tcp.h).
  absl::Status EnableLinks(const LinkOptions& options) override;
  std::string LinkBackend() const override;
  absl::StatusOr<std::string> NewLinkId() override;
  absl::StatusOr<std::unique_ptr<DeviceLink>> ConnectLink(
      absl::string_view id, int rank, absl::Time deadline,
      const std::function<bool()>& cancelled) override;
  ~CpuDevice() override;

 private:
  const bool share_arena_;
  std::unique_ptr<TcpLinkFactory> links_;
  absl::Mutex mu_;
  // Shared arenas: base -> memfd.
  absl::flat_hash_map<const uint8_t*, int> shared_fds_ ABSL_GUARDED_BY(mu_);
};

struct DeviceOptions {
  int cuda_device = 0;  // CUDA device ordinal for the "cuda" backend
  // The CPU backend's arenas are shared memory (CpuDevice); the CUDA
  // backend always shares (cudaMalloc memory is IPC-capable).
  bool share_arena = false;
};

// The host's boot id (/proc/sys/kernel/random/boot_id): two processes with
// the same one run on the same kernel; "unknown" when it cannot be read.
std::string HostBootId();

// Picks the backend named by the --backend flag:
//   "cpu"  -> CpuDevice
//   "cuda" -> the CUDA backend on options.cuda_device; FAILED_PRECONDITION
//             when this build has no CUDA ("built without CUDA") or no CUDA
//             device is visible ("no CUDA device"); INVALID_ARGUMENT for an
//             ordinal out of range; RESOURCE_EXHAUSTED / INTERNAL when the
//             device cannot be set up.
//   "auto" -> "cuda" when CudaAvailable() is OK, else "cpu"
//   anything else -> INVALID_ARGUMENT naming the value.
absl::StatusOr<std::unique_ptr<Device>> CreateDevice(
    absl::string_view backend, const DeviceOptions& options = {});

// OK when this build has the CUDA backend and at least one CUDA device is
// visible; else FAILED_PRECONDITION saying which of the two is missing.
// Implemented by worker/device_factory_cuda.cc or
// worker/device_factory_nocuda.cc, whichever the build picks.
absl::Status CudaAvailable();

// The CUDA backend on device `ordinal` (errors as for CreateDevice("cuda")).
absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(int ordinal);

}  // namespace triax::worker
