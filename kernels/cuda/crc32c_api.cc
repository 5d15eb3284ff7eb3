// Crc32cCuda and CopyCrc32cCuda (kv_cuda.cuh): argument checks, then the
// crc32c.cu launcher.
#include "absl/strings/str_cat.h"
#include "kernels/cuda/api_common.h"
#include "kernels/cuda/crc32c.h"
#include "kernels/cuda/kv_cuda.cuh"

namespace triax::kernels::cuda {

absl::Status Crc32cCuda(const Crc32cParams& p) {
  if (p.num_ranges < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_ranges ", p.num_ranges, " is negative"));
  }
  if (p.num_ranges == 0) return absl::OkStatus();
  if (p.ranges == nullptr || p.out == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(p.ranges == nullptr ? "ranges" : "out",
                     " is null with num_ranges ", p.num_ranges));
  }
  return ToStatus(LaunchCrc32c(p.ranges, p.num_ranges, p.out, p.stream));
}

absl::Status CopyCrc32cCuda(const CopyCrc32cParams& p) {
  if (p.num_ranges < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_ranges ", p.num_ranges, " is negative"));
  }
  if (p.num_ranges == 0) return absl::OkStatus();
  if (p.ranges == nullptr || p.out == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(p.ranges == nullptr ? "ranges" : "out",
                     " is null with num_ranges ", p.num_ranges));
  }
  return ToStatus(LaunchCopyCrc32c(p.ranges, p.num_ranges, p.out, p.stream));
}

}  // namespace triax::kernels::cuda
