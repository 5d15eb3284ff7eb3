// The one definition of where every byte of a KV page lives. Shared by the
// CPU reference (kernels/ref) and the CUDA kernels (kernels/cuda), so both
// agree byte for byte.
//
// A page holds one block of one layer on one worker: T tokens x H KV heads x
// D dims, K and V. Inside a page, data is head-major ([H][T][D]) so that one
// head's tokens are contiguous for attention. Writers hand tokens in
// token-major order ([T][H][D]), as frontends produce them.
//
// Formats (values equal triax.v1.Format):
//   BF16: K bf16[H][T][D], V bf16[H][T][D].
//   INT4 / INT2 (asymmetric, KIVI-style):
//     K codes  u8[H][T][D*bits/8]   keys quantized per channel: each (h, d)
//                                   has one scale/zero over the page's tokens
//     K scale  f16[H][D], K zero f16[H][D]
//     V codes  u8[H][T][D*bits/8]   values quantized per token in groups of
//                                   G channels along D
//     V scale  f16[H][T][D/G], V zero f16[H][T][D/G]
//   Codes are packed low bits first: for INT4 byte j holds dims 2j (bits 0-3)
//   and 2j+1 (bits 4-7); for INT2 byte j holds dims 4j..4j+3.
//   Dequantized value = code * scale + zero, where zero is the group minimum
//   and scale = (max - min) / (2^bits - 1) (scale 0 when max == min).
//   Each section starts on a 16-byte boundary; padding counts in PageBytes.
#pragma once

#include <cstddef>
#include <cstdint>

namespace triax::kernels {

enum class Format : uint8_t { kBF16 = 1, kINT4 = 2, kINT2 = 3 };

// Bits per stored code (16 for BF16).
int FormatBits(Format f);
const char* FormatName(Format f);  // "bf16", "int4", "int2"
// Parses "bf16" | "int4" | "int2"; returns false for anything else.
bool ParseFormat(const char* name, Format* out);

struct PageShape {
  int tokens = 16;     // T: tokens per page (block_tokens), 1..4096
  int heads = 1;       // H: KV heads
  int head_dim = 128;  // D: even
  int value_group =
      0;  // G: channels per value group; 0 = min(32, D). Divides D.

  int ValueGroup() const;
};

// Byte offsets of the sections of one page. Unused sections have size 0.
struct PageLayout {
  size_t k_codes = 0, k_codes_bytes = 0;
  size_t k_scale = 0, k_zero = 0, k_meta_bytes = 0;  // each of scale, zero
  size_t v_codes = 0, v_codes_bytes = 0;
  size_t v_scale = 0, v_zero = 0, v_meta_bytes = 0;
  size_t total = 0;
};

PageLayout ComputeLayout(Format f, const PageShape& shape);
inline size_t PageBytes(Format f, const PageShape& shape) {
  return ComputeLayout(f, shape).total;
}
// Stored bits per K/V value including every byte of metadata and padding:
// PageBytes * 8 / (2 * T * H * D).
double EffectiveBits(Format f, const PageShape& shape);

}  // namespace triax::kernels
