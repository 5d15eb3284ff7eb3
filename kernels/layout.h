// The one definition of where every byte of a KV page lives. Shared by the
// CPU reference (kernels/ref) and the CUDA kernels (kernels/cuda), so both
// agree byte for byte.
//
// A page holds one block of one layer on one worker: T tokens x H KV heads x
// D dims, K and V. K and V are encoded independently (an Encoding names a
// format for each); each tensor's sections are head-major ([H][T][...]) so
// one head's tokens are contiguous for attention. Writers hand tokens in
// token-major order ([T][H][D]), as frontends produce them.
//
// Page = K sections, then V sections; every section starts on a 16-byte
// boundary and padding counts in PageBytes. Per tensor X in {K, V}:
//   BF16:      codes bf16[H][T][D].
//   FP8_E4M3:  codes u8[H][T][D] (E4M3, saturating at +-448);
//              scale f32[H]: one per head per page, amax / 448 (1 if amax 0).
//              value = e4m3(code) * scale.
//   INT8/INT4/INT2 (asymmetric, KIVI-style):
//              codes u8[H][T][D*bits/8], packed low bits first (INT4: byte j
//              holds dims 2j, 2j+1; INT2: dims 4j..4j+3).
//              K is quantized per channel over groups of Gk = min(g, T)
//              tokens: scale, zero [H][T/Gk][D]  (Gk must divide T).
//              V is quantized per token over groups of Gv = min(g, D)
//              channels: scale, zero [H][T][D/Gv] (Gv must divide D).
//              Scale and zero are FP16 or FP8 E4M3 (Encoding::scale_dtype).
//              value = code * scale + zero; zero is the group minimum and
//              scale = (max - min) / (2^bits - 1), both rounded to their
//              storage type before codes are computed.
//   TQ4/TQ3/TQ2 (rotated, after TurboQuant; D a power of two, 16..256):
//              each vector x (one token, one head) is stored as its norm
//              n = |x| (FP16) and codes of y = R x / n, where
//              R = (1/sqrt(D)) * Hadamard_D * diag(signs_D) is orthonormal
//              and signs_D is the fixed +-1 sequence TqSigns(D). Each
//              coordinate of y gets the nearest of 2^b Lloyd-Max levels
//              TqCodebook(b, D) (optimal for one coordinate of a uniformly
//              random unit vector in R^D).
//              codes u8[H][T][D*b/8] (TQ3: 8 codes in 3 bytes, low bits
//              first); norm f16[H][T].
//              Attention runs in the rotated domain: q' = R q once,
//              score = n_k * <q', c_k>; the value sum is accumulated rotated
//              and rotated back once: out = R^T sum_j p_j n_j c_j.
#pragma once

#include <cstddef>
#include <cstdint>

namespace triax::kernels {

// Values equal triax.v1.Format.
enum class Format : uint8_t {
  kBF16 = 1,
  kINT4 = 2,
  kINT2 = 3,
  kFP8 = 4,  // E4M3
  kINT8 = 5,
  kTQ4 = 6,
  kTQ3 = 7,
  kTQ2 = 8,
};
inline constexpr Format kAllFormats[] = {
    Format::kBF16, Format::kFP8, Format::kINT8, Format::kINT4,
    Format::kINT2, Format::kTQ4, Format::kTQ3,  Format::kTQ2};

// Values equal triax.v1.ScaleDtype (0 = unspecified = FP16).
enum class ScaleDtype : uint8_t { kFP16 = 1, kFP8 = 2 };

// Bits per stored code (16 for BF16, 8 for FP8/INT8, b for INTb/TQb).
int FormatBits(Format f);
bool IsIntFormat(Format f);  // INT8, INT4, INT2
bool IsTqFormat(Format f);   // TQ4, TQ3, TQ2
// "bf16", "fp8", "int8", "int4", "int2", "tq4", "tq3", "tq2".
const char* FormatName(Format f);
// Parses a FormatName; returns false for anything else.
bool ParseFormat(const char* name, Format* out);

// How one page is encoded. Implicitly constructible from a Format (same
// format for K and V, default group, FP16 scales).
struct Encoding {
  Format k = Format::kBF16;
  Format v = Format::kBF16;
  int group = 0;  // INT formats: 0 = 32; else 32, 64 or 128
  ScaleDtype scale_dtype = ScaleDtype::kFP16;

  Encoding() = default;
  Encoding(Format f) : k(f), v(f) {}  // NOLINT(runtime/explicit)
  Encoding(Format fk, Format fv, int g = 0, ScaleDtype s = ScaleDtype::kFP16)
      : k(fk), v(fv), group(g), scale_dtype(s) {}

  int Group() const { return group > 0 ? group : 32; }
  bool operator==(const Encoding& o) const {
    return k == o.k && v == o.v && Group() == o.Group() &&
           scale_dtype == o.scale_dtype;
  }
  bool operator!=(const Encoding& o) const { return !(*this == o); }
};

// "int4" when K and V agree with default options; otherwise e.g.
// "k=int4,v=int2,g=64,scale=fp8".
const char* EncodingName(const Encoding& e, char* buf, size_t len);

struct PageShape {
  int tokens = 16;     // T: tokens per page (block_tokens), 1..4096
  int heads = 1;       // H: KV heads
  int head_dim = 128;  // D: even

  int KeyGroup(const Encoding& e) const;    // Gk = min(g, T)
  int ValueGroup(const Encoding& e) const;  // Gv = min(g, D)
};

// Byte offsets of one tensor's sections. Unused sections have size 0.
struct TensorLayout {
  size_t codes = 0, codes_bytes = 0;
  // INT: scale and zero arrays (meta_bytes each). FP8: scale (f32[H]).
  // TQ: norms in `scale` (f16[H][T]).
  size_t scale = 0, zero = 0, meta_bytes = 0;
};

struct PageLayout {
  TensorLayout k, v;
  size_t total = 0;
};

// OK-or-reason check of an encoding for a shape: returns nullptr when
// valid, else a static message naming what is wrong (e.g. "tq formats need
// a power-of-two head_dim", "group must be 32, 64 or 128",
// "key group must divide the page's tokens").
const char* ValidateEncoding(const Encoding& e, const PageShape& shape);

PageLayout ComputeLayout(const Encoding& e, const PageShape& shape);
inline size_t PageBytes(const Encoding& e, const PageShape& shape) {
  return ComputeLayout(e, shape).total;
}
// Stored bits per K/V value including every byte of metadata and padding:
// PageBytes * 8 / (2 * T * H * D).
double EffectiveBits(const Encoding& e, const PageShape& shape);

}  // namespace triax::kernels
