// CRC32C on the device: the checksum of worker/checksum.h (Castagnoli,
// reflected polynomial 0x82F63B78, CRC32C("123456789") = 0xE3069283)
// computed where the bytes are, so a transfer between GPU workers verifies
// its pages without a host round trip. A header without absl (see
// device_page.h) for crc32c.cu; the absl entry point is Crc32cCuda in
// kv_cuda.cuh.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/launch_result.h"

namespace triax::kernels::cuda {

// One byte range in device memory (any alignment, any length; 16 bytes so
// an array of them is one copy).
struct ByteRange {
  const uint8_t* data = nullptr;
  uint64_t bytes = 0;
};
static_assert(sizeof(ByteRange) == 16, "ByteRange is copied as raw bytes");

// Which kernel computes the checksums (crc32c.cu explains both): the
// striped one (the default), or the first version with one CTA per range
// (kept for page_copy_probe's comparison).
enum class Crc32cKernel { kStriped, kPerCta };

// out[i] = CRC32C of range i (0 for an empty range). `ranges` and `out` are
// device arrays of num_ranges. max_range_bytes, an upper bound on the
// ranges' lengths (0: not known), lets the striped kernel give a large
// range several warps; any value gives the same CRC32Cs.
LaunchResult LaunchCrc32c(const ByteRange* ranges, int num_ranges,
                          uint32_t* out, cudaStream_t stream,
                          Crc32cKernel kernel = Crc32cKernel::kStriped,
                          uint64_t max_range_bytes = 0);

// One device-to-device copy whose CRC32C is taken right after (transfers:
// the destination copies a page out of the source's mapped arena and
// verifies what it installed in the same launch). src and dst must not
// overlap; 32 bytes so an array of them is one copy.
struct CopyRange {
  const uint8_t* src = nullptr;
  uint8_t* dst = nullptr;
  uint64_t bytes = 0;
  uint64_t reserved = 0;
};
static_assert(sizeof(CopyRange) == 32, "CopyRange is copied as raw bytes");

// Copies every range and sets out[i] to the CRC32C of the bytes copied
// (the striped kernels checksum what they read, from registers, as they
// store it; the per-CTA one re-reads what landed in dst).
LaunchResult LaunchCopyCrc32c(const CopyRange* ranges, int num_ranges,
                              uint32_t* out, cudaStream_t stream,
                              Crc32cKernel kernel = Crc32cKernel::kStriped,
                              uint64_t max_range_bytes = 0);

}  // namespace triax::kernels::cuda
