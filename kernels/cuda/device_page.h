// The page table entry of the kv_cuda.cuh API, DevicePage, and how an
// Encoding is packed into it. Part of the public API (kv_cuda.cuh includes
// this); a header of its own so that the kernels' .cu files need no absl
// (nvcc parses each .cu's headers three times: absl/status/status.h costs
// about 5 s per file).
#pragma once

#include <cstdint>

#include "kernels/layout.h"

namespace triax::kernels::cuda {

// Packs an Encoding into DevicePage::format: bits 0-7 K format, 8-15 V
// format (0 = same as K), 16-23 group (0 = 32), 24-31 ScaleDtype (0 =
// FP16). A plain static_cast<int32_t>(Format) is therefore the uniform
// encoding of that format with default options.
inline int32_t PackEncoding(const Encoding& e) {
  return static_cast<int32_t>(static_cast<uint32_t>(e.k) |
                              (static_cast<uint32_t>(e.v) << 8) |
                              (static_cast<uint32_t>(e.Group()) << 16) |
                              (static_cast<uint32_t>(e.scale_dtype) << 24));
}

// One page in device memory. 16 bytes, so an array of them is one copy.
struct DevicePage {
  uint8_t* data = nullptr;  // PageBytes(encoding, shape) bytes, 16-aligned
  int32_t num_tokens = 0;   // valid tokens, 1..shape.tokens
  int32_t format = 0;       // PackEncoding(encoding)
};
static_assert(sizeof(DevicePage) == 16, "DevicePage is copied as raw bytes");

}  // namespace triax::kernels::cuda
