// Crc32cCuda and CopyCrc32cCuda (kv_cuda.cuh): argument checks, then the
// crc32c.cu launcher.
#include "absl/strings/str_cat.h"
#include "kernels/cuda/api_common.h"
#include "kernels/cuda/crc32c.h"
#include "kernels/cuda/kv_cuda.cuh"

namespace triax::kernels::cuda {
namespace {

// INVALID_ARGUMENT for a negative count or a null array with ranges; OK
// with *launch = false for no ranges (nothing to do).
absl::Status CheckArgs(int num_ranges, const void* ranges, const void* out,
                       bool* launch) {
  *launch = false;
  if (num_ranges < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_ranges ", num_ranges, " is negative"));
  }
  if (num_ranges == 0) return absl::OkStatus();
  if (ranges == nullptr || out == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(ranges == nullptr ? "ranges" : "out",
                     " is null with num_ranges ", num_ranges));
  }
  *launch = true;
  return absl::OkStatus();
}

}  // namespace

absl::Status Crc32cCuda(const Crc32cParams& p) {
  bool launch = false;
  if (absl::Status s = CheckArgs(p.num_ranges, p.ranges, p.out, &launch);
      !s.ok() || !launch) {
    return s;
  }
  return ToStatus(LaunchCrc32c(p.ranges, p.num_ranges, p.out, p.stream,
                               p.kernel, p.max_range_bytes));
}

absl::Status CopyCrc32cCuda(const CopyCrc32cParams& p) {
  bool launch = false;
  if (absl::Status s = CheckArgs(p.num_ranges, p.ranges, p.out, &launch);
      !s.ok() || !launch) {
    return s;
  }
  return ToStatus(LaunchCopyCrc32c(p.ranges, p.num_ranges, p.out, p.stream,
                                   p.kernel, p.max_range_bytes));
}

}  // namespace triax::kernels::cuda
