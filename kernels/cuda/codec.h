// Launchers of the codec kernels (codec.cu), for the kv_cuda.cuh entry
// points in codec_api.cc: each uploads codec.cu's TQ tables (once per
// device), launches one kernel on `stream` and reports how that went
// (launch_result.h). Arguments are validated by the caller.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/device_page.h"
#include "kernels/cuda/launch_result.h"
#include "kernels/layout.h"

namespace triax::kernels::cuda {

// EncodeKernel: one CTA per page.
LaunchResult LaunchEncodePages(const PageShape& shape, const DevicePage* pages,
                               int num_pages, const uint16_t* k_bf16,
                               const uint16_t* v_bf16, cudaStream_t stream);
// DecodeKernel: one CTA per (page, head), blocks = num_pages * heads.
LaunchResult LaunchDecodePages(const PageShape& shape, const DevicePage* pages,
                               unsigned blocks, float* k_out, float* v_out,
                               cudaStream_t stream);
// DemoteKernel: one CTA per page.
LaunchResult LaunchDemotePages(const PageShape& shape, const DevicePage* src,
                               const DevicePage* dst, int num_pages,
                               uint16_t* scratch, cudaStream_t stream);

}  // namespace triax::kernels::cuda
