// The CUDA backend of a kvworker (compiled only when TRIAX_WITH_CUDA is on;
// service code reaches it through Device and CreateDevice).
//
// Memory: the arena is one cudaMalloc per AllocateArena call (the page pool,
// --pool_mb), so every page pointer the store holds is HBM.
//
// Lanes: the device keeps kLanes lanes, each a CUDA stream with its own
// pinned host staging buffer (cudaMallocHost), device scratch buffer and
// attention workspace, each grown on demand to the largest request the lane
// has seen and kept (never allocated per call). A call checks out a free
// lane for its whole duration (waiting when all are busy), so up to kLanes
// calls from different threads run concurrently on the GPU; nothing else is
// serialized. Page tables (DevicePage) are built on the host and uploaded
// with the inputs in one copy.
//
// Compute maps one to one onto kernels/cuda/kv_cuda.cuh:
//   EncodePage       -> EncodePagesCuda (one page)
//   DecodePage       -> DecodePagesCuda (one page), then download
//   WriteBf16Tokens  -> host transpose to head-major in the staging buffer,
//                       then one cudaMemcpy2DAsync per tensor into the BF16
//                       page's [H][T][D] codes at the slot offset
//   WriteBf16TokensBatch -> every write's rows head-major in the staging
//                       buffer with a CopyRange table, one upload, one
//                       CopyCrc32cCuda launch scattering the rows into their
//                       pages (its CRC32Cs unused), one synchronization
//                       (per kMaxRangesPerLaunch rows)
//   CopyPage         -> cudaMemcpyAsync device to device
//   CopyToHost/FromHost -> cudaMemcpyAsync device <-> host straight from/to
//                       the caller's buffer (pinned host tier: DMA; pageable
//                       disk staging buffers: staged by the driver)
//   AllocateHostTier -> cudaHostAlloc (pinned), freed by cudaFreeHost
//   DecodeAttention  -> DecodeAttentionBatch of one entry
//   DecodeAttentionBatch -> entries grouped by (shape, n_q_heads, scale);
//                       per group one CSR page table, q up in one copy, one
//                       DecodeAttentionCuda launch, out down in one copy
//                       (a group whose workspace would pass
//                       kMaxWorkspaceBytes runs as several launches)
//   DemotePages      -> DemotePagesCuda over all jobs (src/dst tables up in
//                       one copy; chunks bounded by kMaxDemoteScratchBytes)
//   Checksum         -> Crc32cCuda over all ranges (table up, CRCs down)
//   CopyPagesChecked -> CopyCrc32cCuda: copy and the CRC of the bytes copied,
//   one launch
//                       per kMaxRangesPerLaunch jobs
//   NewCheckedCopies -> a pipeline with a stream of its own (a CopyLane,
//                       kept for the next pipeline) and per batch in flight
//                       a staging pair and an event: Start uploads the table,
//                       launches and queues the CRCs' download, Finish waits
//                       for the batch's event (the one exception below)
//   ShareArena / OpenPeerArena -> cudaIpcGetMemHandle / cudaIpcOpenMemHandle
//                       (lazy peer access); ShareDomain is cuda:<boot id>
// Every call waits for its stream before returning, so host buffers are free
// to reuse and errors surface in the call that caused them; a CheckedCopies
// pipeline's Start does not (its batch's buffers wait for its Finish).
//
// Batch invariance: every attention launch passes pages_per_share =
// PagesPerShare(shape) (one split-K share per ~512 tokens of a sequence's
// pages of one class) and num_splits = AttentionSplits(shape, pages) for
// the group's longest table (enough shares for every entry, at most 64
// splits). The kernel then splits each sequence by its own page count, so
// its output depends only on its own pages and query: batched and
// one-by-one calls are bit-identical (cuda_device_test checks it), and a
// batch of short sequences launches few CTAs (a sequence of ~2k tokens: 1
// split rather than a fixed 64). Workspace grows with the batch (~8.4 MB
// per entry for 32 query heads x head_dim 128 at 16 splits, a 32k-token
// sequence; ~34 MB at 64 splits, 128k tokens). The share was 128 tokens
// until 2026-12-08: at batch 64 x 32k its partials (256 per sequence and
// class, in float32) cost as much traffic as a low-bit sequence's KV and
// the 2.2 GB of workspace split each step into three launches; 512 took
// the kernels' time of a 2-layer step from 11.8 to 6.6 ms (tri-3.5 mix)
// and 7.9 to 5.9 ms (BF16) on the H100, against 0.62 -> 0.76 ms (tri-3.5)
// and 0.41 -> 0.26 ms (BF16) at batch 1 (bench/results/decode_step.md).
//
// Errors: encodings the kernels refuse (CheckEncodingCuda: TQ formats, shapes
// with head_dim not a multiple of 8 in [8, 256], ...) are INVALID_ARGUMENT
// and change nothing. A failed CUDA launch, copy or synchronization returns
// INTERNAL with the CUDA error name and string and marks the device
// unhealthy: CUDA errors from kernels are sticky (the context is poisoned), so
// from then on every call returns UNAVAILABLE naming that first error and
// Health() reports it; the worker must be restarted. Failing to grow a
// lane's buffers is RESOURCE_EXHAUSTED and leaves the device healthy.
//
// Thread contract: thread-safe. Calls on disjoint pages run concurrently
// (one lane each); the health record and the free-lane list have their own
// mutexes (lane list -> health, never the other way). Each call first makes
// the device current on the calling thread (cudaSetDevice), so threads need
// no setup.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kernels/cuda/kv_cuda.cuh"
#include "worker/device.h"
#include "worker/link_nccl.h"

namespace triax::worker {

class CudaDevice final : public Device {
 public:
  // Sets up device `ordinal`: INVALID_ARGUMENT when it is not in
  // [0, cudaGetDeviceCount), INTERNAL when the stream cannot be created.
  static absl::StatusOr<std::unique_ptr<CudaDevice>> Create(int ordinal);
  ~CudaDevice() override;

  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  const char* Name() const override { return "cuda"; }
  int ordinal() const { return ordinal_; }

  absl::Status SupportsEncoding(const kernels::Encoding& e,
                                const kernels::PageShape& shape) const override;
  absl::Status SupportsAttention(const kernels::PageShape& shape,
                                 int n_q_heads) const override;
  absl::Status Health() const override;

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
  absl::Status WriteBf16TokensBatch(
      const kernels::PageShape& shape,
      absl::Span<const TokenWrite> writes) override;
  absl::Status CopyPage(uint8_t* dst, const uint8_t* src,
                        size_t bytes) override;
  absl::Status DecodeAttention(const kernels::DecodeParams& p) override;
  absl::Status DecodeAttentionBatch(
      absl::Span<const kernels::DecodeParams> batch) override;
  absl::Status DemotePages(const kernels::PageShape& shape,
                           absl::Span<const DemoteJob> jobs) override;
  absl::Status CopyToHost(void* host_dst, const uint8_t* dev_src,
                          size_t bytes) override;
  absl::Status CopyFromHost(uint8_t* dev_dst, const void* host_src,
                            size_t bytes) override;
  absl::StatusOr<uint8_t*> AllocateHostTier(size_t bytes) override;
  void FreeHostTier(uint8_t* base, size_t bytes) override;
  // Transfers (worker/cuda_device_transfer.cc).
  absl::Status Checksum(absl::Span<const DeviceBytes> ranges,
                        absl::Span<uint32_t> crcs) override;
  absl::Status CopyPagesChecked(absl::Span<const PageCopy> jobs,
                                absl::Span<uint32_t> crcs) override;
  absl::StatusOr<std::unique_ptr<CheckedCopies>> NewCheckedCopies() override;
  std::string ShareDomain() const override;
  bool TimeSlicesProcesses() const override { return true; }
  absl::StatusOr<std::string> ShareArena(const uint8_t* base,
                                         size_t bytes) override;
  absl::StatusOr<const uint8_t*> OpenPeerArena(absl::string_view handle,
                                               size_t bytes) override;
  void ClosePeerArena(const uint8_t* base, size_t bytes) override;
  // NCCL links (worker/link_nccl.h); EnableLinks runs before the device
  // serves.
  absl::Status EnableLinks(const LinkOptions& options) override;
  std::string LinkBackend() const override;
  absl::StatusOr<std::string> NewLinkId() override;
  absl::StatusOr<std::unique_ptr<DeviceLink>> ConnectLink(
      absl::string_view id, int rank, absl::Time deadline,
      const std::function<bool()>& cancelled) override;

 public:
  // Ranges per Checksum / CopyPagesChecked launch.
  static constexpr size_t kMaxRangesPerLaunch = 16384;
  static constexpr int kLanes = 4;
  // A batch group whose attention workspace would pass this runs as
  // several launches (still batch-invariant: shares depend on each
  // sequence only).
  static constexpr size_t kMaxWorkspaceBytes = size_t{1} << 30;
  static constexpr size_t kMaxDemoteScratchBytes = size_t{64} << 20;

  // Pages per split-K share: max(1, 512 / shape.tokens).
  static int PagesPerShare(const kernels::PageShape& shape);
  // The split count that gives a table of `pages` pages all its shares
  // (ceil(ceil(pages / PagesPerShare) / 4)), clamped to [1, 64]; a group
  // uses it for its longest table.
  static int AttentionSplits(const kernels::PageShape& shape, size_t pages);

 private:
  // One stream and the buffers only calls holding it touch.
  struct Lane {
    cudaStream_t stream = nullptr;
    uint8_t* host = nullptr;  // pinned staging
    size_t host_bytes = 0;
    uint8_t* scratch = nullptr;  // device: inputs, page tables, outputs
    size_t scratch_bytes = 0;
    uint8_t* workspace = nullptr;  // device: attention partials
    size_t workspace_bytes = 0;
    // Recorded around each attention launch (AttentionKernelSeconds).
    cudaEvent_t kernel_start = nullptr, kernel_stop = nullptr;
  };
  // A CheckedCopies pipeline's stream and, per batch in flight, buffers
  // (a Lane's host / scratch; its stream unused) and a completion event.
  struct CopyLane {
    cudaStream_t stream = nullptr;
    Lane slots[CheckedCopies::kMaxInFlight];
    cudaEvent_t done[CheckedCopies::kMaxInFlight] = {};
  };
  class PipelinedCopies;
  // A free CopyLane, made on first use (RESOURCE_EXHAUSTED / INTERNAL when
  // CUDA cannot make its stream or events).
  absl::StatusOr<CopyLane*> TakeCopyLane();
  void GiveCopyLane(CopyLane* lane);
  // A checked-out lane, returned to the free list on destruction.
  class Lease {
   public:
    Lease(CudaDevice* device, Lane* lane) : device_(device), lane_(lane) {}
    Lease(Lease&& o) noexcept : device_(o.device_), lane_(o.lane_) {
      o.lane_ = nullptr;
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    Lease& operator=(Lease&&) = delete;
    ~Lease();
    Lane& operator*() const { return *lane_; }
    Lane* operator->() const { return lane_; }

   private:
    CudaDevice* device_;
    Lane* lane_;
  };

  CudaDevice(int ordinal, std::vector<std::unique_ptr<Lane>> lanes);

  // UNAVAILABLE once poisoned; else makes the device current on this thread
  // and checks out a free lane (waiting for one).
  absl::StatusOr<Lease> Begin();
  // UNAVAILABLE once poisoned; else makes the device current (no lane).
  absl::Status BeginNoLane();
  // OK for cudaSuccess; else records the first sticky error, marks the
  // device unhealthy and returns INTERNAL naming `what` and the error.
  absl::Status Check(cudaError_t e, const char* what);
  // A kernel wrapper's status: INTERNAL (a failed launch) poisons the device
  // like Check; other codes (INVALID_ARGUMENT) pass through untouched.
  absl::Status Launched(absl::Status s);
  absl::Status Sync(Lane& lane, const char* what);
  void Poison(absl::string_view msg);
  // Grows the lane's pinned host staging buffer and device scratch buffer
  // to at least the given sizes. RESOURCE_EXHAUSTED when CUDA cannot.
  absl::Status Reserve(Lane& lane, size_t host_bytes, size_t device_bytes);
  absl::Status ReserveWorkspace(Lane& lane, size_t bytes);
  // One attention launch over entries `idx` of `batch` (same shape,
  // n_q_heads and scale; page tables already checked in `tables`).
  absl::Status AttendGroup(
      Lane& lane, absl::Span<const kernels::DecodeParams> batch,
      const std::vector<size_t>& idx,
      const std::vector<std::vector<kernels::cuda::DevicePage>>& tables);

  const int ordinal_;
  const std::vector<std::unique_ptr<Lane>> lanes_;

  absl::Mutex lanes_mu_;
  std::vector<Lane*> free_lanes_ ABSL_GUARDED_BY(lanes_mu_);
  // Every CopyLane made (one per pipeline running at once), and the free.
  std::vector<std::unique_ptr<CopyLane>> copy_lanes_ ABSL_GUARDED_BY(lanes_mu_);
  std::vector<CopyLane*> free_copy_lanes_ ABSL_GUARDED_BY(lanes_mu_);

  mutable absl::Mutex health_mu_;
  std::string poisoned_ ABSL_GUARDED_BY(health_mu_);  // empty while healthy

  std::unique_ptr<NcclLinks> links_;  // set by EnableLinks
};

}  // namespace triax::worker
