// The CUDA factory of a build without CUDA (TRIAX_WITH_CUDA=OFF): there is no
// CUDA backend to create, and the error says so.
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "worker/device.h"

namespace triax::worker {

absl::Status CudaAvailable() {
  return absl::FailedPreconditionError(
      "this kvworker was built without CUDA (TRIAX_WITH_CUDA=OFF)");
}

absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(int ordinal) {
  return absl::FailedPreconditionError(
      absl::StrCat("cuda device ", ordinal,
                   ": this kvworker was built without CUDA "
                   "(TRIAX_WITH_CUDA=OFF)"));
}

}  // namespace triax::worker
