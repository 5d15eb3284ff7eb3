// The CUDA factory of a build with CUDA (TRIAX_WITH_CUDA=ON): the CUDA backend
// when the process sees a CUDA device.
#include <cuda_runtime_api.h>

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "worker/cuda_device.h"
#include "worker/device.h"

namespace triax::worker {

absl::Status CudaAvailable() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    // No driver or no device: not sticky, and nothing else was touched.
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(
        "no CUDA device (cudaGetDeviceCount: ", cudaGetErrorName(e), ": ",
        cudaGetErrorString(e), ")"));
  }
  if (count == 0) {
    return absl::FailedPreconditionError(
        "no CUDA device (cudaGetDeviceCount returned 0)");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(int ordinal) {
  if (absl::Status s = CudaAvailable(); !s.ok()) return s;
  auto device = CudaDevice::Create(ordinal);
  if (!device.ok()) return device.status();
  return std::unique_ptr<Device>(std::move(*device));
}

}  // namespace triax::worker
