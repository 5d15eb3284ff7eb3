#include "kernels/layout.h"

#include <algorithm>
#include <cstring>

namespace triax::kernels {
namespace {

size_t AlignUp(size_t n) { return (n + 15) & ~size_t{15}; }

}  // namespace

int FormatBits(Format f) {
  switch (f) {
    case Format::kBF16:
      return 16;
    case Format::kINT4:
      return 4;
    case Format::kINT2:
      return 2;
  }
  return 0;
}

const char* FormatName(Format f) {
  switch (f) {
    case Format::kBF16:
      return "bf16";
    case Format::kINT4:
      return "int4";
    case Format::kINT2:
      return "int2";
  }
  return "unknown";
}

bool ParseFormat(const char* name, Format* out) {
  for (Format f : {Format::kBF16, Format::kINT4, Format::kINT2}) {
    if (std::strcmp(name, FormatName(f)) == 0) {
      *out = f;
      return true;
    }
  }
  return false;
}

int PageShape::ValueGroup() const {
  return value_group > 0 ? value_group : std::min(32, head_dim);
}

PageLayout ComputeLayout(Format f, const PageShape& s) {
  PageLayout l;
  const size_t values = static_cast<size_t>(s.heads) * s.tokens * s.head_dim;
  if (f == Format::kBF16) {
    l.k_codes = 0;
    l.k_codes_bytes = values * 2;
    l.v_codes = AlignUp(l.k_codes_bytes);
    l.v_codes_bytes = values * 2;
    l.total = AlignUp(l.v_codes + l.v_codes_bytes);
    return l;
  }
  const int bits = FormatBits(f);
  const size_t codes =
      static_cast<size_t>(s.heads) * s.tokens * (s.head_dim * bits / 8);
  const size_t k_meta = static_cast<size_t>(s.heads) * s.head_dim * 2;
  const size_t v_meta = static_cast<size_t>(s.heads) * s.tokens *
                        (s.head_dim / s.ValueGroup()) * 2;
  size_t off = 0;
  l.k_codes = off;
  l.k_codes_bytes = codes;
  off = AlignUp(off + codes);
  l.k_scale = off;
  l.k_meta_bytes = k_meta;
  off = AlignUp(off + k_meta);
  l.k_zero = off;
  off = AlignUp(off + k_meta);
  l.v_codes = off;
  l.v_codes_bytes = codes;
  off = AlignUp(off + codes);
  l.v_scale = off;
  l.v_meta_bytes = v_meta;
  off = AlignUp(off + v_meta);
  l.v_zero = off;
  off = AlignUp(off + v_meta);
  l.total = off;
  return l;
}

double EffectiveBits(Format f, const PageShape& s) {
  const double values = 2.0 * s.tokens * s.heads * s.head_dim;
  return static_cast<double>(PageBytes(f, s)) * 8.0 / values;
}

}  // namespace triax::kernels
