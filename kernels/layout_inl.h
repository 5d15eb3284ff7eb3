// Definitions of layout.h's TRIAX_HOST_DEVICE functions: the page-layout
// arithmetic that the CPU reference, host code and the CUDA kernels share
// (one definition, so both sides agree on where every byte lives). Include
// layout.h, not this file.
//
// Written for the device as much as for the host: integer arithmetic on
// int-held codes (FormatCode), no std:: calls, and range checks where the
// format values are consecutive.
#pragma once

#include "kernels/layout.h"

namespace triax::kernels {

// IsKnownFormat and IsTqFormat check ranges: the 8 formats are 1..8, the
// TQ ones 6..8.
static_assert(static_cast<int>(Format::kBF16) == 1 &&
                  static_cast<int>(Format::kTQ2) == 8 &&
                  sizeof(kAllFormats) / sizeof(kAllFormats[0]) == 8 &&
                  static_cast<int>(Format::kTQ4) == 6,
              "Format values are 1..8, TQ formats 6..8");

TRIAX_HOST_DEVICE_FORCEINLINE constexpr int FormatBits(FormatCode f) {
  switch (f) {
    case FormatCode::kBF16:
      return 16;
    case FormatCode::kFP8:
    case FormatCode::kINT8:
      return 8;
    case FormatCode::kINT4:
    case FormatCode::kTQ4:
      return 4;
    case FormatCode::kTQ3:
      return 3;
    case FormatCode::kINT2:
    case FormatCode::kTQ2:
      return 2;
  }
  return 0;
}

TRIAX_HOST_DEVICE_FORCEINLINE constexpr bool IsIntFormat(FormatCode f) {
  return f == FormatCode::kINT4 || f == FormatCode::kINT2 ||
         f == FormatCode::kINT8;
}

TRIAX_HOST_DEVICE_FORCEINLINE constexpr bool IsTqFormat(FormatCode f) {
  return f >= FormatCode::kTQ4 && f <= FormatCode::kTQ2;
}

TRIAX_HOST_DEVICE_FORCEINLINE constexpr bool IsKnownFormat(FormatCode f) {
  return f >= FormatCode::kBF16 && f <= FormatCode::kTQ2;
}

TRIAX_HOST_DEVICE_FORCEINLINE constexpr int FormatBits(Format f) {
  return FormatBits(Code(f));
}
TRIAX_HOST_DEVICE_FORCEINLINE constexpr bool IsIntFormat(Format f) {
  return IsIntFormat(Code(f));
}
TRIAX_HOST_DEVICE_FORCEINLINE constexpr bool IsTqFormat(Format f) {
  return IsTqFormat(Code(f));
}

TRIAX_HOST_DEVICE_FORCEINLINE constexpr bool IsTqHeadDim(int d) {
  return d >= 16 && d <= 256 && (d & (d - 1)) == 0;
}

TRIAX_HOST_DEVICE_FORCEINLINE int PageShape::KeyGroup(
    const UnpackedEncoding& e) const {
  return MinInt(e.Group(), tokens);
}

TRIAX_HOST_DEVICE_FORCEINLINE int PageShape::ValueGroup(
    const UnpackedEncoding& e) const {
  return MinInt(e.Group(), head_dim);
}

namespace layout_internal {

// What CheckEncoding returns: the problem (host messages), or only whether
// there is one (the kernels; a chain of `return false` compiles to less
// than problem codes compared afterwards).
template <typename R>
struct CheckResult;
template <>
struct CheckResult<EncodingProblem> {
  TRIAX_HOST_DEVICE_FORCEINLINE static constexpr EncodingProblem Ok() {
    return EncodingProblem::kNone;
  }
  TRIAX_HOST_DEVICE_FORCEINLINE static constexpr EncodingProblem Fail(
      EncodingProblem p) {
    return p;
  }
};
template <>
struct CheckResult<bool> {
  TRIAX_HOST_DEVICE_FORCEINLINE static constexpr bool Ok() { return true; }
  TRIAX_HOST_DEVICE_FORCEINLINE static constexpr bool Fail(EncodingProblem) {
    return false;
  }
};

template <typename R>
TRIAX_HOST_DEVICE_FORCEINLINE R CheckEncoding(const UnpackedEncoding& e,
                                              const PageShape& s,
                                              int head_dim_multiple) {
  using Result = CheckResult<R>;
  if (!IsKnownFormat(e.k) || !IsKnownFormat(e.v)) {
    return Result::Fail(IsKnownFormat(e.k)
                            ? EncodingProblem::kUnknownValueFormat
                            : EncodingProblem::kUnknownKeyFormat);
  }
  // 0 (the default) or 32, 64, 128: Group() resolves the 0, and the kernels'
  // groups (defaults resolved when unpacked) skip the negative check.
  const int g = e.Group();
  if (e.group < 0 || (g != 32 && g != 64 && g != 128)) {
    return Result::Fail(EncodingProblem::kGroup);
  }
  if (e.scale_dtype != ScaleDtypeCode::kFP16 &&
      e.scale_dtype != ScaleDtypeCode::kFP8) {
    return Result::Fail(EncodingProblem::kScaleDtype);
  }
  // K's problems are reported before V's: an INT2 V is named only when K is
  // not a TQ format (whose head_dim problem comes first; a head_dim that
  // suits TQ is a multiple of 4 anyway).
  if (head_dim_multiple % 4 != 0 && s.head_dim % 4 != 0 &&
      (e.k == FormatCode::kINT2 ||
       (e.v == FormatCode::kINT2 && !IsTqFormat(e.k)))) {
    return Result::Fail(EncodingProblem::kInt2HeadDim);
  }
  if ((IsTqFormat(e.k) || IsTqFormat(e.v)) && !IsTqHeadDim(s.head_dim)) {
    return Result::Fail(EncodingProblem::kTqHeadDim);
  }
  if (IsIntFormat(e.k) && s.tokens % s.KeyGroup(e) != 0) {
    return Result::Fail(EncodingProblem::kKeyGroup);
  }
  if (IsIntFormat(e.v) && s.head_dim % s.ValueGroup(e) != 0) {
    return Result::Fail(EncodingProblem::kValueGroup);
  }
  return Result::Ok();
}

}  // namespace layout_internal

TRIAX_HOST_DEVICE_FORCEINLINE EncodingProblem CheckEncodingForShape(
    const UnpackedEncoding& e, const PageShape& s, int head_dim_multiple) {
  return layout_internal::CheckEncoding<EncodingProblem>(e, s,
                                                         head_dim_multiple);
}

TRIAX_HOST_DEVICE_FORCEINLINE bool EncodingFitsShape(const UnpackedEncoding& e,
                                                     const PageShape& s,
                                                     int head_dim_multiple) {
  return layout_internal::CheckEncoding<bool>(e, s, head_dim_multiple);
}

namespace layout_internal {
TRIAX_HOST_DEVICE_FORCEINLINE size_t AlignUp16(size_t n) {
  return (n + 15) & ~size_t{15};
}
}  // namespace layout_internal

TRIAX_HOST_DEVICE inline size_t LayoutTensor(FormatCode f, bool is_key,
                                             const UnpackedEncoding& e,
                                             const PageShape& s, size_t off,
                                             TensorLayout* t) {
  using layout_internal::AlignUp16;
  const size_t H = static_cast<size_t>(s.heads);
  const size_t T = static_cast<size_t>(s.tokens);
  const size_t D = static_cast<size_t>(s.head_dim);
  *t = TensorLayout{};
  t->codes = off;
  t->codes_bytes = H * T * (D * FormatBits(f) / 8);
  off = AlignUp16(off + t->codes_bytes);
  if (f == FormatCode::kBF16) return off;
  if (f == FormatCode::kFP8) {
    t->scale = off;
    t->meta_bytes = H * 4;
    return AlignUp16(off + t->meta_bytes);
  }
  if (IsTqFormat(f)) {
    t->scale = off;
    t->meta_bytes = H * T * 2;
    return AlignUp16(off + t->meta_bytes);
  }
  const size_t elem = e.scale_dtype == ScaleDtypeCode::kFP8 ? 1 : 2;
  const size_t count =
      is_key ? H * (T / s.KeyGroup(e)) * D : H * T * (D / s.ValueGroup(e));
  t->meta_bytes = count * elem;
  t->scale = off;
  off = AlignUp16(off + t->meta_bytes);
  t->zero = off;
  return AlignUp16(off + t->meta_bytes);
}

TRIAX_HOST_DEVICE inline PageLayout ComputeLayout(const UnpackedEncoding& e,
                                                  const PageShape& s) {
  PageLayout l;
  size_t off = LayoutTensor(e.k, /*is_key=*/true, e, s, 0, &l.k);
  off = LayoutTensor(e.v, /*is_key=*/false, e, s, off, &l.v);
  l.total = off;
  return l;
}

TRIAX_HOST_DEVICE inline PageLayout ComputeLayout(const Encoding& e,
                                                  const PageShape& s) {
  return ComputeLayout(UnpackedEncoding(e), s);
}

TRIAX_HOST_DEVICE inline size_t PageBytes(const Encoding& e,
                                          const PageShape& s) {
  return ComputeLayout(e, s).total;
}

}  // namespace triax::kernels
