// What a launcher in one of the kernels' .cu files reports to its caller in
// a .cc file, without absl (nvcc parses each .cu's headers three times:
// absl/status/status.h alone costs about 5 s per file). ToStatus
// (api_common.h) turns it into the absl::Status of the kv_cuda.cuh entry
// point:
//   kNoDevice      INTERNAL "cudaGetDevice failed"
//   kTqUpload      INTERNAL "uploading TQ tables: <CUDA error>"
//   kSharedMemory  INTERNAL "attention needs <smem_bytes> bytes of shared
//                  memory: <CUDA error>"
//   kLaunch        INTERNAL "<what> launch failed: <CUDA error>"
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace triax::kernels::cuda {

struct LaunchResult {
  enum class Kind { kOk, kNoDevice, kTqUpload, kSharedMemory, kLaunch };
  Kind kind = Kind::kOk;
  cudaError_t error = cudaSuccess;
  size_t smem_bytes = 0;       // kSharedMemory
  const char* what = nullptr;  // kLaunch: the entry point or launch named

  bool ok() const { return kind == Kind::kOk; }
};

// The state of the last launch (cudaGetLastError), reported as `what`.
inline LaunchResult LastLaunch(const char* what) {
  LaunchResult r;
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    r.kind = LaunchResult::Kind::kLaunch;
    r.error = e;
    r.what = what;
  }
  return r;
}

}  // namespace triax::kernels::cuda
