#include "kernels/layout.h"

#include <cstdio>
#include <cstring>

namespace triax::kernels {

const char* FormatName(Format f) {
  switch (f) {
    case Format::kBF16:
      return "bf16";
    case Format::kFP8:
      return "fp8";
    case Format::kINT8:
      return "int8";
    case Format::kINT4:
      return "int4";
    case Format::kINT2:
      return "int2";
    case Format::kTQ4:
      return "tq4";
    case Format::kTQ3:
      return "tq3";
    case Format::kTQ2:
      return "tq2";
  }
  return "unknown";
}

bool ParseFormat(const char* name, Format* out) {
  if (name == nullptr) return false;
  for (Format f : kAllFormats) {
    if (std::strcmp(name, FormatName(f)) == 0) {
      *out = f;
      return true;
    }
  }
  return false;
}

const char* EncodingName(const Encoding& e, char* buf, size_t len) {
  if (buf == nullptr || len == 0) return buf;
  const bool fp8 = e.scale_dtype == ScaleDtype::kFP8;
  if (e.k == e.v && e.Group() == 32 && !fp8) {
    std::snprintf(buf, len, "%s", FormatName(e.k));
    return buf;
  }
  int n =
      std::snprintf(buf, len, "k=%s,v=%s", FormatName(e.k), FormatName(e.v));
  if (e.Group() != 32 && n >= 0 && static_cast<size_t>(n) < len) {
    n += std::snprintf(buf + n, len - n, ",g=%d", e.Group());
  }
  if (fp8 && n >= 0 && static_cast<size_t>(n) < len) {
    std::snprintf(buf + n, len - n, ",scale=fp8");
  }
  return buf;
}

const char* EncodingProblemMessage(EncodingProblem p) {
  switch (p) {
    case EncodingProblem::kNone:
      return nullptr;
    case EncodingProblem::kUnknownKeyFormat:
      return "unknown key format";
    case EncodingProblem::kUnknownValueFormat:
      return "unknown value format";
    case EncodingProblem::kGroup:
      return "group must be 32, 64 or 128";
    case EncodingProblem::kScaleDtype:
      return "scale dtype must be fp16 or fp8";
    case EncodingProblem::kInt2HeadDim:
      return "int2 needs head_dim % 4 == 0";
    case EncodingProblem::kTqHeadDim:
      return "tq formats need a power-of-two head_dim in 16..256";
    case EncodingProblem::kKeyGroup:
      return "key group must divide the page's tokens";
    case EncodingProblem::kValueGroup:
      return "value group must divide head_dim";
  }
  return "unknown encoding problem";
}

const char* ValidateEncoding(const Encoding& e, const PageShape& s) {
  if (s.tokens < 1 || s.tokens > 4096) return "tokens must be in 1..4096";
  if (s.heads < 1) return "heads must be >= 1";
  if (s.head_dim < 2 || s.head_dim % 2 != 0) {
    return "head_dim must be even and >= 2";
  }
  return EncodingProblemMessage(CheckEncodingForShape(e, s));
}

double EffectiveBits(const Encoding& e, const PageShape& s) {
  const double values = 2.0 * s.tokens * s.heads * s.head_dim;
  return static_cast<double>(PageBytes(e, s)) * 8.0 / values;
}

}  // namespace triax::kernels
