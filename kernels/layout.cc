#include "kernels/layout.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace triax::kernels {
namespace {

size_t AlignUp(size_t n) { return (n + 15) & ~size_t{15}; }

bool KnownFormat(Format f) {
  for (Format g : kAllFormats) {
    if (f == g) return true;
  }
  return false;
}

bool PowerOfTwo(int x) { return x > 0 && (x & (x - 1)) == 0; }

// Lays out one tensor starting at `off`; returns the offset past its last
// (aligned) section.
size_t LayoutTensor(Format f, bool is_key, const Encoding& e,
                    const PageShape& s, size_t off, TensorLayout* t) {
  const size_t H = static_cast<size_t>(s.heads);
  const size_t T = static_cast<size_t>(s.tokens);
  const size_t D = static_cast<size_t>(s.head_dim);
  *t = TensorLayout{};
  t->codes = off;
  t->codes_bytes = H * T * (D * FormatBits(f) / 8);
  off = AlignUp(off + t->codes_bytes);
  if (f == Format::kBF16) return off;
  if (f == Format::kFP8) {
    t->scale = off;
    t->meta_bytes = H * 4;
    return AlignUp(off + t->meta_bytes);
  }
  if (IsTqFormat(f)) {
    t->scale = off;
    t->meta_bytes = H * T * 2;
    return AlignUp(off + t->meta_bytes);
  }
  const size_t elem = e.scale_dtype == ScaleDtype::kFP8 ? 1 : 2;
  const size_t count =
      is_key ? H * (T / s.KeyGroup(e)) * D : H * T * (D / s.ValueGroup(e));
  t->meta_bytes = count * elem;
  t->scale = off;
  off = AlignUp(off + t->meta_bytes);
  t->zero = off;
  return AlignUp(off + t->meta_bytes);
}

}  // namespace

int FormatBits(Format f) {
  switch (f) {
    case Format::kBF16:
      return 16;
    case Format::kFP8:
    case Format::kINT8:
      return 8;
    case Format::kINT4:
    case Format::kTQ4:
      return 4;
    case Format::kTQ3:
      return 3;
    case Format::kINT2:
    case Format::kTQ2:
      return 2;
  }
  return 0;
}

bool IsIntFormat(Format f) {
  return f == Format::kINT8 || f == Format::kINT4 || f == Format::kINT2;
}

bool IsTqFormat(Format f) {
  return f == Format::kTQ4 || f == Format::kTQ3 || f == Format::kTQ2;
}

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

int PageShape::KeyGroup(const Encoding& e) const {
  return std::min(e.Group(), tokens);
}

int PageShape::ValueGroup(const Encoding& e) const {
  return std::min(e.Group(), head_dim);
}

const char* ValidateEncoding(const Encoding& e, const PageShape& s) {
  if (s.tokens < 1 || s.tokens > 4096) return "tokens must be in 1..4096";
  if (s.heads < 1) return "heads must be >= 1";
  if (s.head_dim < 2 || s.head_dim % 2 != 0) {
    return "head_dim must be even and >= 2";
  }
  if (!KnownFormat(e.k)) return "unknown key format";
  if (!KnownFormat(e.v)) return "unknown value format";
  if (e.group != 0 && e.group != 32 && e.group != 64 && e.group != 128) {
    return "group must be 32, 64 or 128";
  }
  if (e.scale_dtype != ScaleDtype::kFP16 && e.scale_dtype != ScaleDtype::kFP8) {
    return "scale dtype must be fp16 or fp8";
  }
  for (Format f : {e.k, e.v}) {
    if (f == Format::kINT2 && s.head_dim % 4 != 0) {
      return "int2 needs head_dim % 4 == 0";
    }
    if (IsTqFormat(f) &&
        (!PowerOfTwo(s.head_dim) || s.head_dim < 16 || s.head_dim > 256)) {
      return "tq formats need a power-of-two head_dim in 16..256";
    }
  }
  if (IsIntFormat(e.k) && s.tokens % s.KeyGroup(e) != 0) {
    return "key group must divide the page's tokens";
  }
  if (IsIntFormat(e.v) && s.head_dim % s.ValueGroup(e) != 0) {
    return "value group must divide head_dim";
  }
  return nullptr;
}

PageLayout ComputeLayout(const Encoding& e, const PageShape& s) {
  PageLayout l;
  size_t off = LayoutTensor(e.k, /*is_key=*/true, e, s, 0, &l.k);
  off = LayoutTensor(e.v, /*is_key=*/false, e, s, off, &l.v);
  l.total = off;
  return l;
}

double EffectiveBits(const Encoding& e, const PageShape& s) {
  const double values = 2.0 * s.tokens * s.heads * s.head_dim;
  return static_cast<double>(PageBytes(e, s)) * 8.0 / values;
}

}  // namespace triax::kernels
