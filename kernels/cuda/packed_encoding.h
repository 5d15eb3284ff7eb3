// DevicePage::format (PackEncoding in kv_cuda.cuh) unpacked, for the
// kernels and the host: K/V formats, group and scale dtype as an
// UnpackedEncoding (layout.h), and the check a page must pass before any
// kernel reads or writes it. Host and device code (TRIAX_HOST_DEVICE).
//
// Packed word: bits 0-7 K format, 8-15 V format (0 = K's), 16-23 group
// (0 = 32), 24-31 ScaleDtype (0 = FP16).
#pragma once

#include <cstdint>

#include "kernels/host_device.h"
#include "kernels/layout.h"

namespace triax::kernels::cuda {

// The largest head_dim the kernels take (ValidateShape: multiples of 8 in
// [8, kMaxHeadDim]).
inline constexpr int kMaxHeadDim = 256;

// DevicePage::format (PackEncoding): V 0 means K's format, group 0 32 and
// scale dtype 0 FP16.
TRIAX_HOST_DEVICE_FORCEINLINE UnpackedEncoding UnpackEncoding(int32_t packed) {
  const uint32_t p = static_cast<uint32_t>(packed);
  UnpackedEncoding e;
  const int k = p & 0xff;
  e.k = static_cast<FormatCode>(k);
  const int v = (p >> 8) & 0xff;
  e.v = static_cast<FormatCode>(v == 0 ? k : v);
  const int group = (p >> 16) & 0xff;
  e.group = group == 0 ? 32 : group;
  const int sdt = (p >> 24) & 0xff;
  e.scale_dtype = static_cast<ScaleDtypeCode>(sdt == 0 ? 1 : sdt);
  return e;
}

// A page the kernels can read or write (ValidateEncoding's checks for a
// shape that passed ValidateShape: head_dim % 8 == 0).
TRIAX_HOST_DEVICE_FORCEINLINE bool SupportedEncoding(const UnpackedEncoding& e,
                                                     const PageShape& s) {
  return EncodingFitsShape(e, s, /*head_dim_multiple=*/8);
}

}  // namespace triax::kernels::cuda
