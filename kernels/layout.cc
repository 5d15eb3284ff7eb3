#include "kernels/layout.h"

#include <charconv>
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

namespace {

// Appends `s` at buf[*n], truncated and NUL-terminated as snprintf would.
void PutName(const char* s, char* buf, size_t len, size_t* n) {
  while (*s != '\0' && *n + 1 < len) buf[(*n)++] = *s++;
  buf[*n] = '\0';
}

}  // namespace

// Without snprintf: the manager names an encoding in every block event
// (snprintf made this ~600 instructions, a tenth of a block's creation).
const char* EncodingName(const Encoding& e, char* buf, size_t len) {
  if (buf == nullptr || len == 0) return buf;
  size_t n = 0;
  buf[0] = '\0';
  const bool fp8 = e.scale_dtype == ScaleDtype::kFP8;
  if (e.k == e.v && e.Group() == 32 && !fp8) {
    PutName(FormatName(e.k), buf, len, &n);
    return buf;
  }
  PutName("k=", buf, len, &n);
  PutName(FormatName(e.k), buf, len, &n);
  PutName(",v=", buf, len, &n);
  PutName(FormatName(e.v), buf, len, &n);
  if (e.Group() != 32) {
    char group[16];
    const std::to_chars_result r =
        std::to_chars(group, group + sizeof(group) - 1, e.Group());
    *r.ptr = '\0';
    PutName(",g=", buf, len, &n);
    PutName(group, buf, len, &n);
  }
  if (fp8) PutName(",scale=fp8", buf, len, &n);
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
