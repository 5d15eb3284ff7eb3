// The kv_cuda.cuh entry points of the codecs: argument checks (messages
// per kv_cuda.cuh), then the launchers of codec.cu.
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/api_common.h"
#include "kernels/cuda/codec.h"
#include "kernels/cuda/kv_cuda.cuh"

namespace triax::kernels::cuda {

size_t DemoteScratchBytes(const PageShape& shape, int num_pages) {
  return static_cast<size_t>(std::max(num_pages, 0)) * 2 *
         static_cast<size_t>(std::max(shape.tokens, 0)) *
         std::max(shape.heads, 0) * std::max(shape.head_dim, 0) *
         sizeof(uint16_t);
}

absl::Status DemotePagesCuda(const DemotePagesParams& p) {
  TRIAX_RETURN_IF_ERROR(ValidateShape(p.shape));
  if (p.num_pages < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_pages must be >= 0, got ", p.num_pages));
  }
  if (p.num_pages == 0) return absl::OkStatus();
  if (p.src == nullptr || p.dst == nullptr || p.scratch == nullptr) {
    return absl::InvalidArgumentError("src, dst and scratch must be non-null");
  }
  const size_t need = DemoteScratchBytes(p.shape, p.num_pages);
  if (p.scratch_bytes < need || !Aligned16(p.scratch)) {
    return absl::InvalidArgumentError(
        absl::StrCat("scratch must be 16-byte aligned and hold ", need,
                     " bytes, got ", p.scratch_bytes));
  }
  return ToStatus(LaunchDemotePages(p.shape, p.src, p.dst, p.num_pages,
                                    static_cast<uint16_t*>(p.scratch),
                                    p.stream));
}

absl::Status EncodePagesCuda(const EncodePagesParams& p) {
  if (absl::Status s = ValidateShape(p.shape); !s.ok()) return s;
  if (p.num_pages < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_pages must be >= 0, got ", p.num_pages));
  }
  if (p.num_pages == 0) return absl::OkStatus();
  if (p.pages == nullptr || p.k_bf16 == nullptr || p.v_bf16 == nullptr) {
    return absl::InvalidArgumentError(
        "pages, k_bf16 and v_bf16 must be non-null");
  }
  if (!Aligned16(p.k_bf16) || !Aligned16(p.v_bf16)) {
    return absl::InvalidArgumentError(
        "k_bf16 and v_bf16 must be 16-byte aligned");
  }
  return ToStatus(LaunchEncodePages(p.shape, p.pages, p.num_pages, p.k_bf16,
                                    p.v_bf16, p.stream));
}

absl::Status DecodePagesCuda(const DecodePagesParams& p) {
  if (absl::Status s = ValidateShape(p.shape); !s.ok()) return s;
  if (p.num_pages < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_pages must be >= 0, got ", p.num_pages));
  }
  if (p.num_pages == 0 || (p.k_out == nullptr && p.v_out == nullptr))
    return absl::OkStatus();
  if (p.pages == nullptr)
    return absl::InvalidArgumentError("pages must be non-null");
  const long long blocks = static_cast<long long>(p.num_pages) * p.shape.heads;
  if (blocks > 0x7fffffffLL) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_pages * heads too large: ", blocks));
  }
  return ToStatus(LaunchDecodePages(p.shape, p.pages,
                                    static_cast<unsigned>(blocks), p.k_out,
                                    p.v_out, p.stream));
}

}  // namespace triax::kernels::cuda
