// The CUDA backend of a kvworker (compiled only when TRIAX_WITH_CUDA is on;
// service code reaches it through Device and CreateDevice).
//
// Memory: the arena is one cudaMalloc per AllocateArena call (the page pool,
// --pool_mb), so every page pointer the store holds is HBM. Host inputs and
// outputs (BF16 K/V, float32 q/out, decoded tokens) pass through one pinned
// host staging buffer (cudaMallocHost) and one device scratch buffer, each
// grown on demand to the largest request seen; page tables (DevicePage) are
// built on the host and uploaded with the inputs in one copy.
//
// Compute maps one to one onto kernels/cuda/kv_cuda.cuh:
//   EncodePage       -> EncodePagesCuda (one page)
//   DecodePage       -> DecodePagesCuda (one page), then download
//   WriteBf16Tokens  -> host transpose to head-major in the staging buffer,
//                       then one cudaMemcpy2DAsync per tensor into the BF16
//                       page's [H][T][D] codes at the slot offset
//   CopyPage         -> cudaMemcpyAsync device to device
//   DecodeAttention  -> DevicePage table of the page list (batch 1), q up,
//                       DecodeAttentionCuda, out down
// Every call waits for its stream before returning, so host buffers are free
// to reuse and errors surface in the call that caused them.
//
// Errors: encodings the kernels refuse (CheckEncodingCuda: TQ formats, shapes
// with head_dim not a multiple of 8 in [8, 256], ...) are INVALID_ARGUMENT
// and change nothing. A failed CUDA launch, copy or synchronization returns
// INTERNAL with the CUDA error name and string and marks the device
// unhealthy: CUDA errors from kernels are sticky (the context is poisoned), so
// from then on every call returns UNAVAILABLE naming that first error and
// Health() reports it; the worker must be restarted. Failing to grow the
// staging buffers is RESOURCE_EXHAUSTED and leaves the device healthy.
//
// Thread contract: thread-safe. One CUDA stream per device; calls (from any
// number of gRPC threads) are serialized by a mutex held for the whole call,
// including its synchronization, because the staging buffers are shared.
// Each call first makes the device current on the calling thread
// (cudaSetDevice), so threads need no setup.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/device.h"

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
  absl::Status CopyPage(uint8_t* dst, const uint8_t* src,
                        size_t bytes) override;
  absl::Status DecodeAttention(const kernels::DecodeParams& p) override;

 private:
  CudaDevice(int ordinal, cudaStream_t stream);

  // UNAVAILABLE once poisoned; else makes the device current on this thread.
  absl::Status Begin() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK for cudaSuccess; else records the first sticky error, marks the
  // device unhealthy and returns INTERNAL naming `what` and the error.
  absl::Status Check(cudaError_t e, const char* what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A kernel wrapper's status: INTERNAL (a failed launch) poisons the device
  // like Check; other codes (INVALID_ARGUMENT) pass through untouched.
  absl::Status Launched(absl::Status s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Sync(const char* what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Grows the pinned host staging buffer and the device scratch buffer to at
  // least the given sizes. RESOURCE_EXHAUSTED when CUDA cannot provide them.
  absl::Status Reserve(size_t host_bytes, size_t device_bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int ordinal_;
  const cudaStream_t stream_;

  mutable absl::Mutex mu_;
  std::string poisoned_ ABSL_GUARDED_BY(mu_);     // empty while healthy
  uint8_t* host_ ABSL_GUARDED_BY(mu_) = nullptr;  // pinned
  size_t host_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint8_t* scratch_ ABSL_GUARDED_BY(mu_) = nullptr;  // device
  size_t scratch_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace triax::worker
