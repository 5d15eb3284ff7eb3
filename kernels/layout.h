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
//
// Functions marked TRIAX_HOST_DEVICE are defined in layout_inl.h; the CUDA
// kernels run them on the device (section offsets and validity of each page,
// from DevicePage::format unpacked into an UnpackedEncoding).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/host_device.h"

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

// Format and ScaleDtype with int underlying type, the same values: how
// the CUDA kernels keep formats (unpacked from DevicePage::format) in
// registers, and what the layout functions below compute on. Device code
// compares these with their own enumerators (f == FormatCode::kBF16):
// compares of the uint8_t enums compile to 16-bit sequences there, and
// compares through a helper function or a class wrapper order the
// generated code differently from plain int compares. Code() converts.
enum class FormatCode : int {
  kBF16 = static_cast<int>(Format::kBF16),
  kINT4 = static_cast<int>(Format::kINT4),
  kINT2 = static_cast<int>(Format::kINT2),
  kFP8 = static_cast<int>(Format::kFP8),
  kINT8 = static_cast<int>(Format::kINT8),
  kTQ4 = static_cast<int>(Format::kTQ4),
  kTQ3 = static_cast<int>(Format::kTQ3),
  kTQ2 = static_cast<int>(Format::kTQ2),
};
enum class ScaleDtypeCode : int {
  kFP16 = static_cast<int>(ScaleDtype::kFP16),
  kFP8 = static_cast<int>(ScaleDtype::kFP8),
};
TRIAX_HOST_DEVICE_FORCEINLINE constexpr FormatCode Code(Format f) {
  return static_cast<FormatCode>(f);
}
TRIAX_HOST_DEVICE_FORCEINLINE constexpr ScaleDtypeCode Code(ScaleDtype s) {
  return static_cast<ScaleDtypeCode>(s);
}

// Bits per stored code (16 for BF16, 8 for FP8/INT8, b for INTb/TQb; 0 for
// a value that is no Format).
TRIAX_HOST_DEVICE_FORCEINLINE constexpr int FormatBits(Format f);
TRIAX_HOST_DEVICE_FORCEINLINE constexpr int FormatBits(FormatCode f);
// INT8, INT4, INT2.
TRIAX_HOST_DEVICE_FORCEINLINE constexpr bool IsIntFormat(Format f);
TRIAX_HOST_DEVICE_FORCEINLINE constexpr bool IsIntFormat(FormatCode f);
// TQ4, TQ3, TQ2.
TRIAX_HOST_DEVICE_FORCEINLINE constexpr bool IsTqFormat(Format f);
TRIAX_HOST_DEVICE_FORCEINLINE constexpr bool IsTqFormat(FormatCode f);
// One of the 8 formats.
TRIAX_HOST_DEVICE_FORCEINLINE constexpr bool IsKnownFormat(FormatCode f);
// TQ formats need a power-of-two head_dim in 16..256.
TRIAX_HOST_DEVICE_FORCEINLINE constexpr bool IsTqHeadDim(int head_dim);
// The INT group of an encoding: 0 means the default, 32.
TRIAX_HOST_DEVICE_FORCEINLINE constexpr int GroupOrDefault(int group) {
  return group > 0 ? group : 32;
}
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

  int Group() const { return GroupOrDefault(group); }
  bool operator==(const Encoding& o) const {
    return k == o.k && v == o.v && Group() == o.Group() &&
           scale_dtype == o.scale_dtype;
  }
  bool operator!=(const Encoding& o) const { return !(*this == o); }
};

// "int4" when K and V agree with default options; otherwise e.g.
// "k=int4,v=int2,g=64,scale=fp8".
const char* EncodingName(const Encoding& e, char* buf, size_t len);

// An Encoding in int fields, as the layout functions read it and as the
// CUDA kernels unpack DevicePage::format; an Encoding converts implicitly.
// Same fields and meaning (group 0 = 32).
struct UnpackedEncoding {
  FormatCode k = FormatCode::kBF16;
  FormatCode v = FormatCode::kBF16;
  int group = 0;
  ScaleDtypeCode scale_dtype = ScaleDtypeCode::kFP16;

  UnpackedEncoding() = default;
  TRIAX_HOST_DEVICE_FORCEINLINE UnpackedEncoding(  // NOLINT(runtime/explicit)
      const Encoding& e)
      : k(Code(e.k)),
        v(Code(e.v)),
        group(e.group),
        scale_dtype(Code(e.scale_dtype)) {}
  TRIAX_HOST_DEVICE_FORCEINLINE int Group() const {
    return GroupOrDefault(group);
  }
};

struct PageShape {
  int tokens = 16;     // T: tokens per page (block_tokens), 1..4096
  int heads = 1;       // H: KV heads
  int head_dim = 128;  // D: even

  // Gk = min(g, T), Gv = min(g, D).
  TRIAX_HOST_DEVICE_FORCEINLINE int KeyGroup(const UnpackedEncoding& e) const;
  TRIAX_HOST_DEVICE_FORCEINLINE int ValueGroup(const UnpackedEncoding& e) const;
  int KeyGroup(const Encoding& e) const {
    return KeyGroup(UnpackedEncoding(e));
  }
  int ValueGroup(const Encoding& e) const {
    return ValueGroup(UnpackedEncoding(e));
  }
};

inline bool operator==(const PageShape& a, const PageShape& b) {
  return a.tokens == b.tokens && a.heads == b.heads && a.head_dim == b.head_dim;
}
inline bool operator!=(const PageShape& a, const PageShape& b) {
  return !(a == b);
}

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
// "key group must divide the page's tokens"). The shape's own limits
// (tokens, heads, head_dim even) are checked first, then
// CheckEncodingForShape.
const char* ValidateEncoding(const Encoding& e, const PageShape& shape);

// The encoding's part of ValidateEncoding: format codes, group, scale
// dtype and what they need of the shape, checked in this order, for a shape
// within the shape limits. `head_dim_multiple`: a number head_dim is known
// to be a multiple of; checks it implies are left out (the CUDA kernels,
// whose shapes have head_dim % 8 == 0, pass 8, and check no INT2
// requirement).
enum class EncodingProblem {
  kNone = 0,
  kUnknownKeyFormat,
  kUnknownValueFormat,
  kGroup,
  kScaleDtype,
  kInt2HeadDim,
  kTqHeadDim,
  kKeyGroup,
  kValueGroup,
};
TRIAX_HOST_DEVICE_FORCEINLINE EncodingProblem
CheckEncodingForShape(const UnpackedEncoding& e, const PageShape& shape,
                      int head_dim_multiple = 2);
// CheckEncodingForShape(...) == kNone, the same checks without naming the
// problem (the CUDA kernels' form).
TRIAX_HOST_DEVICE_FORCEINLINE bool EncodingFitsShape(const UnpackedEncoding& e,
                                                     const PageShape& shape,
                                                     int head_dim_multiple = 2);
// ValidateEncoding's message for a problem; nullptr for kNone.
const char* EncodingProblemMessage(EncodingProblem p);

// Sections of one tensor (format f; K when is_key) of a page encoded as e,
// laid out from byte `off`; returns the offset past its last section
// (16-byte aligned). ComputeLayout is this for K from 0, then for V.
TRIAX_HOST_DEVICE size_t LayoutTensor(FormatCode f, bool is_key,
                                      const UnpackedEncoding& e,
                                      const PageShape& shape, size_t off,
                                      TensorLayout* t);
TRIAX_HOST_DEVICE PageLayout ComputeLayout(const UnpackedEncoding& e,
                                           const PageShape& shape);
TRIAX_HOST_DEVICE PageLayout ComputeLayout(const Encoding& e,
                                           const PageShape& shape);
TRIAX_HOST_DEVICE size_t PageBytes(const Encoding& e, const PageShape& shape);
// Stored bits per K/V value including every byte of metadata and padding:
// PageBytes * 8 / (2 * T * H * D).
double EffectiveBits(const Encoding& e, const PageShape& shape);

}  // namespace triax::kernels

#include "kernels/layout_inl.h"  // IWYU pragma: export
