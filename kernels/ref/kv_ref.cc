#include "kernels/ref/kv_ref.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/numeric.h"
#include "kernels/tq_codebook.h"

namespace triax::kernels {
namespace {

// Largest finite values of the metadata types. Scales and zeros are clamped
// to them so that a page never stores an infinity or (FP8) a NaN.
constexpr float kFp16Max = 65504.f;
constexpr float kFp8Max = 448.f;

// Exact values of all 256 FP8 E4M3 codes.
const float* Fp8Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t;
    for (int i = 0; i < 256; ++i)
      t[i] = Fp8E4M3ToFloat(static_cast<uint8_t>(i));
    return t;
  }();
  return table.data();
}

inline uint16_t Load16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline void Store16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

// ---- INT metadata ----------------------------------------------------------

struct QuantParams {
  float scale;  // rounded to the storage type, as stored
  float zero;
  uint16_t scale_bits;  // FP16 bits, or the FP8 code in the low byte
  uint16_t zero_bits;
};

// Scale and zero of one group from its range, rounded to the storage type
// exactly as stored, so the codes are computed against what decode uses.
QuantParams MakeQuant(float lo, float hi, int qmax, ScaleDtype sdt) {
  const float lim = sdt == ScaleDtype::kFP8 ? kFp8Max : kFp16Max;
  float zero = std::min(std::max(lo, -lim), lim);
  if (!(zero == zero)) zero = 0.f;  // no finite input at all
  float scale = (hi - lo) / static_cast<float>(qmax);
  if (!(scale > 0.f)) scale = 0.f;  // max == min (or NaN input)
  scale = std::min(scale, lim);
  QuantParams q;
  if (sdt == ScaleDtype::kFP8) {
    q.scale_bits = FloatToFp8E4M3(scale);
    q.zero_bits = FloatToFp8E4M3(zero);
    q.scale = Fp8E4M3ToFloat(static_cast<uint8_t>(q.scale_bits));
    q.zero = Fp8E4M3ToFloat(static_cast<uint8_t>(q.zero_bits));
  } else {
    q.scale_bits = FloatToFp16(scale);
    q.zero_bits = FloatToFp16(zero);
    q.scale = Fp16ToFloat(q.scale_bits);
    q.zero = Fp16ToFloat(q.zero_bits);
  }
  return q;
}

// Stores element `i` of a scale or zero array.
inline void StoreMeta(uint8_t* base, size_t i, uint16_t bits, ScaleDtype sdt) {
  if (sdt == ScaleDtype::kFP8) {
    base[i] = static_cast<uint8_t>(bits);
  } else {
    Store16(base + 2 * i, bits);
  }
}

// Loads `count` consecutive metadata elements starting at element `first`.
void LoadMeta(const uint8_t* base, size_t first, int count, ScaleDtype sdt,
              float* out) {
  if (sdt == ScaleDtype::kFP8) {
    const float* lut = Fp8Table();
    for (int i = 0; i < count; ++i) out[i] = lut[base[first + i]];
  } else {
    for (int i = 0; i < count; ++i) {
      out[i] = Fp16ToFloat(Load16(base + 2 * (first + i)));
    }
  }
}

// Code of `x` under `q`, rounded to nearest even and clamped to [0, qmax].
inline uint32_t Quantize(float x, const QuantParams& q, int qmax) {
  if (q.scale == 0.f) return 0;
  float c = std::nearbyint((x - q.zero) / q.scale);
  if (!(c >= 0.f)) c = 0.f;  // also catches NaN
  if (c > static_cast<float>(qmax)) c = static_cast<float>(qmax);
  return static_cast<uint32_t>(c);
}

inline void PutCode(uint8_t* row, int d, int bits, uint32_t code) {
  const int per_byte = 8 / bits;
  row[d / per_byte] |= static_cast<uint8_t>(code << ((d % per_byte) * bits));
}

// ---- Encode, one tensor ----------------------------------------------------

// Input element (token t, head h, dim d) of token-major [n][H][D] data.
inline float In(const uint16_t* src, int H, int D, int t, int h, int d) {
  return Bf16ToFloat(src[(static_cast<size_t>(t) * H + h) * D + d]);
}

void EncodeBf16(const PageShape& s, const TensorLayout& l, const uint16_t* src,
                int n, uint8_t* page) {
  const int H = s.heads, T = s.tokens, D = s.head_dim;
  for (int t = 0; t < n; ++t) {
    for (int h = 0; h < H; ++h) {
      std::memcpy(page + l.codes + (static_cast<size_t>(h) * T + t) * D * 2,
                  src + (static_cast<size_t>(t) * H + h) * D,
                  static_cast<size_t>(D) * 2);
    }
  }
}

void EncodeFp8(const PageShape& s, const TensorLayout& l, const uint16_t* src,
               int n, uint8_t* page) {
  const int H = s.heads, T = s.tokens, D = s.head_dim;
  for (int h = 0; h < H; ++h) {
    float amax = 0.f;
    for (int t = 0; t < n; ++t) {
      for (int d = 0; d < D; ++d) {
        const float a = std::fabs(In(src, H, D, t, h, d));
        if (a > amax && a <= std::numeric_limits<float>::max()) amax = a;
      }
    }
    const float scale = amax > 0.f ? amax / kFp8Max : 1.f;
    std::memcpy(page + l.scale + 4 * static_cast<size_t>(h), &scale, 4);
    for (int t = 0; t < n; ++t) {
      uint8_t* row = page + l.codes + (static_cast<size_t>(h) * T + t) * D;
      for (int d = 0; d < D; ++d) {
        row[d] = FloatToFp8E4M3(In(src, H, D, t, h, d) / scale);
      }
    }
  }
}

void EncodeInt(Format f, bool is_key, const Encoding& e, const PageShape& s,
               const TensorLayout& l, const uint16_t* src, int n,
               uint8_t* page) {
  const int H = s.heads, T = s.tokens, D = s.head_dim;
  const int bits = FormatBits(f);
  const int qmax = (1 << bits) - 1;
  const size_t row_bytes = static_cast<size_t>(D) * bits / 8;
  const ScaleDtype sdt = e.scale_dtype;
  for (int h = 0; h < H; ++h) {
    uint8_t* codes = page + l.codes + static_cast<size_t>(h) * T * row_bytes;
    if (is_key) {
      // One (scale, zero) per channel per group of Gk tokens; a partial
      // page's last group covers only its valid tokens.
      const int gk = s.KeyGroup(e);
      const int groups = T / gk;
      for (int gi = 0; gi * gk < n; ++gi) {
        const int t0 = gi * gk, t1 = std::min(n, t0 + gk);
        for (int d = 0; d < D; ++d) {
          float lo = std::numeric_limits<float>::infinity();
          float hi = -lo;
          for (int t = t0; t < t1; ++t) {
            const float x = In(src, H, D, t, h, d);
            lo = std::min(lo, x);
            hi = std::max(hi, x);
          }
          const QuantParams q = MakeQuant(lo, hi, qmax, sdt);
          const size_t meta = (static_cast<size_t>(h) * groups + gi) * D + d;
          StoreMeta(page + l.scale, meta, q.scale_bits, sdt);
          StoreMeta(page + l.zero, meta, q.zero_bits, sdt);
          for (int t = t0; t < t1; ++t) {
            PutCode(codes + t * row_bytes, d, bits,
                    Quantize(In(src, H, D, t, h, d), q, qmax));
          }
        }
      }
      continue;
    }
    // Values: one (scale, zero) per token per group of Gv channels.
    const int gv = s.ValueGroup(e);
    const int groups = D / gv;
    for (int t = 0; t < n; ++t) {
      const uint16_t* x = src + (static_cast<size_t>(t) * H + h) * D;
      uint8_t* row = codes + t * row_bytes;
      for (int g = 0; g < groups; ++g) {
        float lo = std::numeric_limits<float>::infinity();
        float hi = -lo;
        for (int d = g * gv; d < (g + 1) * gv; ++d) {
          lo = std::min(lo, Bf16ToFloat(x[d]));
          hi = std::max(hi, Bf16ToFloat(x[d]));
        }
        const QuantParams q = MakeQuant(lo, hi, qmax, sdt);
        const size_t meta = (static_cast<size_t>(h) * T + t) * groups + g;
        StoreMeta(page + l.scale, meta, q.scale_bits, sdt);
        StoreMeta(page + l.zero, meta, q.zero_bits, sdt);
        for (int d = g * gv; d < (g + 1) * gv; ++d) {
          PutCode(row, d, bits, Quantize(Bf16ToFloat(x[d]), q, qmax));
        }
      }
    }
  }
}

// Codes are a little-endian bit stream of `bits`-bit fields (for 2 and 4
// bits this is the same as the INT packing; for 3 bits, 8 codes per 3 bytes).
inline void PutBits(uint8_t* row, int i, int bits, uint32_t code) {
  const int bit = i * bits;
  const uint32_t v = code << (bit % 8);
  row[bit / 8] |= static_cast<uint8_t>(v);
  if ((bit % 8) + bits > 8) row[bit / 8 + 1] |= static_cast<uint8_t>(v >> 8);
}

void EncodeTq(Format f, const PageShape& s, const TensorLayout& l,
              const uint16_t* src, int n, uint8_t* page) {
  const int H = s.heads, T = s.tokens, D = s.head_dim;
  const int bits = FormatBits(f);
  const int levels = 1 << bits;
  const float* cb = TqCodebook(bits, D);
  float mid[15];
  for (int i = 0; i + 1 < levels; ++i) mid[i] = 0.5f * (cb[i] + cb[i + 1]);
  const size_t row_bytes = static_cast<size_t>(D) * bits / 8;
  float y[256];
  for (int h = 0; h < H; ++h) {
    for (int t = 0; t < n; ++t) {
      double sq = 0;
      for (int d = 0; d < D; ++d) {
        y[d] = In(src, H, D, t, h, d);
        sq += static_cast<double>(y[d]) * y[d];
      }
      const double norm = std::sqrt(sq);
      Store16(
          page + l.scale + 2 * (static_cast<size_t>(h) * T + t),
          FloatToFp16(static_cast<float>(std::min<double>(norm, kFp16Max))));
      TqRotate(D, y);
      const float inv = norm > 0 ? static_cast<float>(1.0 / norm) : 0.f;
      uint8_t* row =
          page + l.codes + (static_cast<size_t>(h) * T + t) * row_bytes;
      for (int d = 0; d < D; ++d) {
        const float u = y[d] * inv;
        uint32_t code = 0;
        for (int i = 0; i + 1 < levels; ++i) code += u > mid[i] ? 1u : 0u;
        PutBits(row, d, bits, code);
      }
    }
  }
}

void EncodeTensor(Format f, bool is_key, const Encoding& e, const PageShape& s,
                  const TensorLayout& l, const uint16_t* src, int n,
                  uint8_t* page) {
  if (f == Format::kBF16) {
    EncodeBf16(s, l, src, n, page);
  } else if (f == Format::kFP8) {
    EncodeFp8(s, l, src, n, page);
  } else if (IsIntFormat(f)) {
    EncodeInt(f, is_key, e, s, l, src, n, page);
  } else {
    EncodeTq(f, s, l, src, n, page);
  }
}

// ---- Decode, one tensor of one head
// ------------------------------------------

// Unpacks one INT row of D codes: out[d] = code * scale[d / group] + zero[..]
// (keys: group 1, per-channel arrays). Specialized per bit width so the inner
// loop has no switch.
template <int kBits>
void DequantRow(const uint8_t* row, int D, const float* scale,
                const float* zero, int group, float* out) {
  constexpr int kPerByte = 8 / kBits;
  constexpr uint32_t kMask = (1u << kBits) - 1;
  if (group == 1) {
    for (int j = 0; j < D / kPerByte; ++j) {
      const uint32_t b = row[j];
      for (int i = 0; i < kPerByte; ++i) {
        const int d = j * kPerByte + i;
        out[d] =
            static_cast<float>((b >> (i * kBits)) & kMask) * scale[d] + zero[d];
      }
    }
    return;
  }
  for (int g = 0; g < D / group; ++g) {
    const float s = scale[g], z = zero[g];
    for (int d = g * group; d < (g + 1) * group; ++d) {
      const uint32_t code =
          (row[d / kPerByte] >> ((d % kPerByte) * kBits)) & kMask;
      out[d] = static_cast<float>(code) * s + z;
    }
  }
}

template <int kBits>
void DecodeIntHead(bool is_key, const Encoding& e, const PageShape& s,
                   const TensorLayout& l, const uint8_t* page, int h, int n,
                   float* out, float* meta) {
  const int T = s.tokens, D = s.head_dim;
  const size_t row_bytes = static_cast<size_t>(D) * kBits / 8;
  const uint8_t* codes =
      page + l.codes + static_cast<size_t>(h) * T * row_bytes;
  const ScaleDtype sdt = e.scale_dtype;
  if (is_key) {
    const int gk = s.KeyGroup(e);
    const int groups = T / gk;
    float* ks = meta;
    float* kz = meta + D;
    for (int gi = 0; gi * gk < n; ++gi) {
      const size_t first = (static_cast<size_t>(h) * groups + gi) * D;
      LoadMeta(page + l.scale, first, D, sdt, ks);
      LoadMeta(page + l.zero, first, D, sdt, kz);
      for (int t = gi * gk; t < std::min(n, (gi + 1) * gk); ++t) {
        DequantRow<kBits>(codes + t * row_bytes, D, ks, kz, 1,
                          out + static_cast<size_t>(t) * D);
      }
    }
    return;
  }
  const int gv = s.ValueGroup(e);
  const int groups = D / gv;
  float* vs = meta;
  float* vz = meta + groups;
  for (int t = 0; t < n; ++t) {
    const size_t first = (static_cast<size_t>(h) * T + t) * groups;
    LoadMeta(page + l.scale, first, groups, sdt, vs);
    LoadMeta(page + l.zero, first, groups, sdt, vz);
    DequantRow<kBits>(codes + t * row_bytes, D, vs, vz, gv,
                      out + static_cast<size_t>(t) * D);
  }
}

// Unpacks one TQ row into out[d] = norm * level[code].
template <int kBits>
void TqRow(const uint8_t* row, int D, const float* lv, float* out) {
  if constexpr (kBits == 3) {
    for (int j = 0; j < D / 8; ++j) {
      const uint32_t w = row[size_t{3} * j] | (uint32_t{row[3 * j + 1]} << 8) |
                         (uint32_t{row[3 * j + 2]} << 16);
      for (int i = 0; i < 8; ++i) out[8 * j + i] = lv[(w >> (3 * i)) & 7u];
    }
  } else {
    constexpr int kPerByte = 8 / kBits;
    constexpr uint32_t kMask = (1u << kBits) - 1;
    for (int j = 0; j < D / kPerByte; ++j) {
      const uint32_t b = row[j];
      for (int i = 0; i < kPerByte; ++i) {
        out[j * kPerByte + i] = lv[(b >> (i * kBits)) & kMask];
      }
    }
  }
}

template <int kBits>
void DecodeTqHead(const PageShape& s, const TensorLayout& l,
                  const uint8_t* page, int h, int n, bool rotated, float* out) {
  const int T = s.tokens, D = s.head_dim;
  const float* cb = TqCodebook(kBits, D);
  const size_t row_bytes = static_cast<size_t>(D) * kBits / 8;
  const uint8_t* codes =
      page + l.codes + static_cast<size_t>(h) * T * row_bytes;
  float lv[16];
  for (int t = 0; t < n; ++t) {
    const float norm = Fp16ToFloat(
        Load16(page + l.scale + 2 * (static_cast<size_t>(h) * T + t)));
    for (int i = 0; i < (1 << kBits); ++i) lv[i] = norm * cb[i];
    float* o = out + static_cast<size_t>(t) * D;
    TqRow<kBits>(codes + t * row_bytes, D, lv, o);
    if (!rotated) TqRotateInverse(D, o);
  }
}

// Decodes `n` tokens of head `h` of one tensor into out ([n][D] floats).
// TQ tensors come out rotated (n * c) when `rotated`, else in the original
// domain. `meta` is scratch of at least 2 * D floats. One switch per call;
// the loops below it are specialized.
void DecodeTensorHead(Format f, bool is_key, const Encoding& e,
                      const PageShape& s, const TensorLayout& l,
                      const uint8_t* page, int h, int n, bool rotated,
                      float* out, float* meta) {
  const int T = s.tokens, D = s.head_dim;
  const size_t count = static_cast<size_t>(n) * D;
  switch (f) {
    case Format::kBF16: {
      const uint8_t* src = page + l.codes + static_cast<size_t>(h) * T * D * 2;
      for (size_t i = 0; i < count; ++i)
        out[i] = Bf16ToFloat(Load16(src + 2 * i));
      return;
    }
    case Format::kFP8: {
      const uint8_t* src = page + l.codes + static_cast<size_t>(h) * T * D;
      float scale;
      std::memcpy(&scale, page + l.scale + 4 * static_cast<size_t>(h), 4);
      float lv[256];
      const float* lut = Fp8Table();
      for (int i = 0; i < 256; ++i) lv[i] = lut[i] * scale;
      for (size_t i = 0; i < count; ++i) out[i] = lv[src[i]];
      return;
    }
    case Format::kINT8:
      return DecodeIntHead<8>(is_key, e, s, l, page, h, n, out, meta);
    case Format::kINT4:
      return DecodeIntHead<4>(is_key, e, s, l, page, h, n, out, meta);
    case Format::kINT2:
      return DecodeIntHead<2>(is_key, e, s, l, page, h, n, out, meta);
    case Format::kTQ4:
      return DecodeTqHead<4>(s, l, page, h, n, rotated, out);
    case Format::kTQ3:
      return DecodeTqHead<3>(s, l, page, h, n, rotated, out);
    case Format::kTQ2:
      return DecodeTqHead<2>(s, l, page, h, n, rotated, out);
  }
}

// Dot product with 8 independent partial sums: lets the compiler vectorize
// without -ffast-math (a single accumulator is a serial dependency chain).
// D is even; the tail loop covers D % 8 != 0.
inline float Dot(const float* a, const float* b, int D) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int d = 0;
  for (; d + 8 <= D; d += 8) {
    for (int i = 0; i < 8; ++i) acc[i] += a[d + i] * b[d + i];
  }
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) +
              ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; d < D; ++d) sum += a[d] * b[d];
  return sum;
}

// Per-thread scratch reused across calls so attention allocates only when a
// larger shape than before is seen.
struct Scratch {
  std::vector<float> k, v, meta, scores, acc, acc_rot, q_rot, m, l;
};

Scratch& ThreadScratch() {
  thread_local Scratch s;
  return s;
}

inline void Reserve(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

}  // namespace

void EncodePage(const Encoding& e, const PageShape& shape,
                const uint16_t* k_bf16, const uint16_t* v_bf16, int num_tokens,
                uint8_t* page) {
  const PageLayout l = ComputeLayout(e, shape);
  std::memset(page, 0, l.total);
  EncodeTensor(e.k, /*is_key=*/true, e, shape, l.k, k_bf16, num_tokens, page);
  EncodeTensor(e.v, /*is_key=*/false, e, shape, l.v, v_bf16, num_tokens, page);
}

void DecodePage(const Encoding& e, const PageShape& shape, const uint8_t* page,
                int num_tokens, float* k_out, float* v_out) {
  const PageLayout l = ComputeLayout(e, shape);
  const int H = shape.heads, D = shape.head_dim, n = num_tokens;
  Scratch& s = ThreadScratch();
  const size_t head_elems = static_cast<size_t>(n) * D;
  Reserve(s.k, head_elems);
  Reserve(s.meta, 2 * static_cast<size_t>(D));
  for (int i = 0; i < 2; ++i) {
    float* out = i == 0 ? k_out : v_out;
    if (out == nullptr) continue;
    for (int h = 0; h < H; ++h) {
      DecodeTensorHead(i == 0 ? e.k : e.v, i == 0, e, shape, i == 0 ? l.k : l.v,
                       page, h, n, /*rotated=*/false, s.k.data(),
                       s.meta.data());
      for (int t = 0; t < n; ++t) {
        std::memcpy(out + (static_cast<size_t>(t) * H + h) * D,
                    s.k.data() + static_cast<size_t>(t) * D, D * sizeof(float));
      }
    }
  }
}

void WriteBf16Token(const PageShape& shape, const uint16_t* k_bf16,
                    const uint16_t* v_bf16, int t, uint8_t* page) {
  const PageLayout l = ComputeLayout(Encoding(Format::kBF16), shape);
  const int H = shape.heads, T = shape.tokens, D = shape.head_dim;
  for (int h = 0; h < H; ++h) {
    const size_t dst = (static_cast<size_t>(h) * T + t) * D * 2;
    std::memcpy(page + l.k.codes + dst, k_bf16 + static_cast<size_t>(h) * D,
                static_cast<size_t>(D) * 2);
    std::memcpy(page + l.v.codes + dst, v_bf16 + static_cast<size_t>(h) * D,
                static_cast<size_t>(D) * 2);
  }
}

void DecodeAttentionRef(const DecodeParams& p) {
  const PageShape& shape = p.shape;
  const int H = shape.heads, D = shape.head_dim, T = shape.tokens;
  const int group = p.n_q_heads / H;  // query heads per KV head

  // Which rotated paths this call needs (pages within the causal limit).
  bool tq_k = false, tq_v = false;
  {
    long seen = 0;
    for (int pi = 0; pi < p.num_pages && seen < p.attend_tokens; ++pi) {
      seen += p.pages[pi].num_tokens;
      tq_k = tq_k || IsTqFormat(p.pages[pi].encoding.k);
      tq_v = tq_v || IsTqFormat(p.pages[pi].encoding.v);
    }
  }

  Scratch& s = ThreadScratch();
  const size_t tile = static_cast<size_t>(T) * D;
  const size_t gd = static_cast<size_t>(group) * D;
  Reserve(s.k, tile);
  Reserve(s.v, tile);
  Reserve(s.meta, 2 * static_cast<size_t>(D));
  Reserve(s.scores, T);
  Reserve(s.acc, gd);
  Reserve(s.acc_rot, gd);
  Reserve(s.q_rot, gd);
  Reserve(s.m, group);
  Reserve(s.l, group);
  float* kbuf = s.k.data();
  float* vbuf = s.v.data();
  float* scores = s.scores.data();

  for (int h = 0; h < H; ++h) {
    // Online softmax state per query head of this KV head's group; rotated
    // value sums (TQ V pages) are kept apart and rotated back once.
    std::fill(s.acc.begin(), s.acc.begin() + gd, 0.f);
    if (tq_v) std::fill(s.acc_rot.begin(), s.acc_rot.begin() + gd, 0.f);
    std::fill(s.m.begin(), s.m.begin() + group,
              -std::numeric_limits<float>::infinity());
    std::fill(s.l.begin(), s.l.begin() + group, 0.f);
    if (tq_k) {  // q' = R q, once per query head per call
      for (int g = 0; g < group; ++g) {
        float* qr = s.q_rot.data() + static_cast<size_t>(g) * D;
        std::memcpy(qr, p.q + (static_cast<size_t>(h) * group + g) * D,
                    D * sizeof(float));
        TqRotate(D, qr);
      }
    }
    long done = 0;
    for (int pi = 0; pi < p.num_pages && done < p.attend_tokens; ++pi) {
      const PageRef& page = p.pages[pi];
      const Encoding& e = page.encoding;
      const int n = static_cast<int>(
          std::min<long>(page.num_tokens, p.attend_tokens - done));
      done += n;
      const PageLayout l = ComputeLayout(e, shape);
      DecodeTensorHead(e.k, true, e, shape, l.k, page.data, h, n,
                       /*rotated=*/true, kbuf, s.meta.data());
      DecodeTensorHead(e.v, false, e, shape, l.v, page.data, h, n,
                       /*rotated=*/true, vbuf, s.meta.data());
      const bool k_rot = IsTqFormat(e.k), v_rot = IsTqFormat(e.v);
      for (int g = 0; g < group; ++g) {
        const float* q = k_rot ? s.q_rot.data() + static_cast<size_t>(g) * D
                               : p.q + (static_cast<size_t>(h) * group + g) * D;
        float page_max = -std::numeric_limits<float>::infinity();
        for (int t = 0; t < n; ++t) {
          scores[t] = Dot(q, kbuf + static_cast<size_t>(t) * D, D) * p.scale;
          page_max = std::max(page_max, scores[t]);
        }
        const float m_new = std::max(s.m[g], page_max);
        const float corr = std::exp(s.m[g] - m_new);  // 0 on the first page
        float* acc = s.acc.data() + static_cast<size_t>(g) * D;
        float* acc_rot = s.acc_rot.data() + static_cast<size_t>(g) * D;
        for (int d = 0; d < D; ++d) acc[d] *= corr;
        if (tq_v) {
          for (int d = 0; d < D; ++d) acc_rot[d] *= corr;
        }
        float* target = v_rot ? acc_rot : acc;
        float l_sum = s.l[g] * corr;
        for (int t = 0; t < n; ++t) {
          const float w = std::exp(scores[t] - m_new);
          l_sum += w;
          const float* vr = vbuf + static_cast<size_t>(t) * D;
          for (int d = 0; d < D; ++d) target[d] += w * vr[d];
        }
        s.m[g] = m_new;
        s.l[g] = l_sum;
      }
    }
    for (int g = 0; g < group; ++g) {
      float* acc = s.acc.data() + static_cast<size_t>(g) * D;
      if (tq_v) {  // out = acc + R^T acc_rot
        float* acc_rot = s.acc_rot.data() + static_cast<size_t>(g) * D;
        TqRotateInverse(D, acc_rot);
        for (int d = 0; d < D; ++d) acc[d] += acc_rot[d];
      }
      const float inv = 1.f / s.l[g];
      float* out = p.out + (static_cast<size_t>(h) * group + g) * D;
      for (int d = 0; d < D; ++d) out[d] = acc[d] * inv;
    }
  }
}

}  // namespace triax::kernels
