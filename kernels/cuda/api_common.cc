// api_common.h, and the entry points of kv_cuda.cuh that launch nothing
// (CheckEncodingCuda, CudaPageLayout).
#include "kernels/cuda/api_common.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/kv_cuda.cuh"
#include "kernels/cuda/launch_result.h"
#include "kernels/cuda/packed_encoding.h"

namespace triax::kernels::cuda {

absl::Status ValidateShape(const PageShape& s) {
  if (s.tokens < 1 || s.tokens > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape.tokens must be in [1, 4096], got ", s.tokens));
  }
  if (s.heads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape.heads must be >= 1, got ", s.heads));
  }
  if (s.head_dim < 8 || s.head_dim > kMaxHeadDim || s.head_dim % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape.head_dim must be a multiple of 8 in [8, 256], got ",
                     s.head_dim));
  }
  return absl::OkStatus();
}

absl::Status ToStatus(const LaunchResult& r) {
  switch (r.kind) {
    case LaunchResult::Kind::kOk:
      return absl::OkStatus();
    case LaunchResult::Kind::kNoDevice:
      return absl::InternalError("cudaGetDevice failed");
    case LaunchResult::Kind::kTqUpload:
      return absl::InternalError(
          absl::StrCat("uploading TQ tables: ", cudaGetErrorString(r.error)));
    case LaunchResult::Kind::kSharedMemory:
      return absl::InternalError(absl::StrCat(
          "attention needs ", r.smem_bytes,
          " bytes of shared memory: ", cudaGetErrorString(r.error)));
    case LaunchResult::Kind::kLaunch:
      return absl::InternalError(absl::StrCat(
          r.what, " launch failed: ", cudaGetErrorString(r.error)));
  }
  return absl::InternalError("unknown launch result");
}

absl::Status CheckEncodingCuda(const Encoding& e, const PageShape& shape) {
  if (absl::Status s = ValidateShape(shape); !s.ok()) return s;
  if (const char* why = ValidateEncoding(e, shape); why != nullptr) {
    char name[64];
    return absl::InvalidArgumentError(absl::StrCat(
        "encoding ", EncodingName(e, name, sizeof(name)), ": ", why));
  }
  return absl::OkStatus();
}

PageLayout CudaPageLayout(const Encoding& e, const PageShape& shape) {
  return ComputeLayout(UnpackEncoding(PackEncoding(e)), shape);
}

}  // namespace triax::kernels::cuda
