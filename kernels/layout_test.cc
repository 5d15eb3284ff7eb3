#include "kernels/layout.h"

#include <gtest/gtest.h>

#include <string>

namespace triax::kernels {
namespace {

// Offsets and sizes of one tensor: codes, codes_bytes, scale, zero,
// meta_bytes.
TensorLayout TL(size_t c, size_t cb, size_t s, size_t z, size_t mb) {
  TensorLayout t;
  t.codes = c;
  t.codes_bytes = cb;
  t.scale = s;
  t.zero = z;
  t.meta_bytes = mb;
  return t;
}

void ExpectTensor(const TensorLayout& got, const TensorLayout& want,
                  const char* which) {
  SCOPED_TRACE(which);
  EXPECT_EQ(got.codes, want.codes);
  EXPECT_EQ(got.codes_bytes, want.codes_bytes);
  EXPECT_EQ(got.scale, want.scale);
  EXPECT_EQ(got.zero, want.zero);
  EXPECT_EQ(got.meta_bytes, want.meta_bytes);
}

void ExpectLayout(const Encoding& e, const PageShape& s, const TensorLayout& k,
                  const TensorLayout& v, size_t total, double bits) {
  char name[64];
  SCOPED_TRACE(EncodingName(e, name, sizeof(name)));
  ASSERT_EQ(ValidateEncoding(e, s), nullptr);
  const PageLayout l = ComputeLayout(e, s);
  ExpectTensor(l.k, k, "K");
  ExpectTensor(l.v, v, "V");
  EXPECT_EQ(l.total, total);
  EXPECT_EQ(PageBytes(e, s), total);
  EXPECT_DOUBLE_EQ(EffectiveBits(e, s), bits);
}

// T=16, H=1, D=128: 2048 values per K and V (4096 in all). Default group 32
// (Gk = min(32, 16) = 16, Gv = 32), FP16 metadata.
//   bf16: 4096 B per tensor                                  8192 B, 16 bits
//   fp8:  codes 2048 @0, scale f32 @2048 (4 B -> 16);
//         V codes @2064, scale @4112 -> 4128 B = 8.0625 bits
//   int8: codes 2048 @0; K meta 1 group x 128 x 2 = 256: scale @2048,
//         zero @2304; V codes @2560; V meta 16 x 4 x 2 = 128: scale @4608,
//         zero @4736 -> 4864 B = 9.5 bits
//   int4: codes 1024; K meta 256: @1024, @1280; V codes @1536; V meta 128:
//         @2560, @2688 -> 2816 B = 5.5 bits
//   int2: codes 512; K meta @512, @768; V codes @1024; V meta @1536, @1664
//         -> 1792 B = 3.5 bits
//   tq4:  codes 16 x 64 = 1024, norms 16 x 2 = 32: @1024; V codes @1056,
//         norms @2080 -> 2112 B = 4.125 bits
//   tq3:  codes 16 x 48 = 768, norms @768; V @800, norms @1568 -> 1600 B
//         = 3.125 bits
//   tq2:  codes 512, norms @512; V @544, norms @1056 -> 1088 B = 2.125 bits
TEST(LayoutTest, EveryFormatT16D128) {
  const PageShape s{16, 1, 128};
  ExpectLayout(Format::kBF16, s, TL(0, 4096, 0, 0, 0), TL(4096, 4096, 0, 0, 0),
               8192, 16.0);
  ExpectLayout(Format::kFP8, s, TL(0, 2048, 2048, 0, 4),
               TL(2064, 2048, 4112, 0, 4), 4128, 8.0625);
  ExpectLayout(Format::kINT8, s, TL(0, 2048, 2048, 2304, 256),
               TL(2560, 2048, 4608, 4736, 128), 4864, 9.5);
  ExpectLayout(Format::kINT4, s, TL(0, 1024, 1024, 1280, 256),
               TL(1536, 1024, 2560, 2688, 128), 2816, 5.5);
  ExpectLayout(Format::kINT2, s, TL(0, 512, 512, 768, 256),
               TL(1024, 512, 1536, 1664, 128), 1792, 3.5);
  ExpectLayout(Format::kTQ4, s, TL(0, 1024, 1024, 0, 32),
               TL(1056, 1024, 2080, 0, 32), 2112, 4.125);
  ExpectLayout(Format::kTQ3, s, TL(0, 768, 768, 0, 32),
               TL(800, 768, 1568, 0, 32), 1600, 3.125);
  ExpectLayout(Format::kTQ2, s, TL(0, 512, 512, 0, 32),
               TL(544, 512, 1056, 0, 32), 1088, 2.125);
}

// K and V in different formats, group 64, FP8 metadata; T=16, H=1, D=128.
//   K int4: codes 1024 @0; Gk = 16: meta 1 x 128 x 1 B = 128: scale @1024,
//           zero @1152.
//   V int2: codes 512 @1280; Gv = 64: meta 16 x 2 x 1 B = 32: scale @1792,
//           zero @1824 -> 1856 B = 3.625 bits.
TEST(LayoutTest, MixedEncodingGroup64Fp8Scales) {
  const PageShape s{16, 1, 128};
  const Encoding e(Format::kINT4, Format::kINT2, 64, ScaleDtype::kFP8);
  ExpectLayout(e, s, TL(0, 1024, 1024, 1152, 128),
               TL(1280, 512, 1792, 1824, 32), 1856, 3.625);
  // K tq4 / V int8 (group 32, FP16): K codes 1024, norms 32 @1024; V codes
  // 2048 @1056; V meta 16 x 4 x 2 = 128: @3104, @3232 -> 3360 B = 6.5625.
  ExpectLayout(Encoding(Format::kTQ4, Format::kINT8), s,
               TL(0, 1024, 1024, 0, 32), TL(1056, 2048, 3104, 3232, 128), 3360,
               6.5625);
}

// T=64, H=2, D=64, group 128: K fp8 / V int4.
//   K codes 2 x 64 x 64 = 8192 @0, scale f32[2] = 8 B @8192 (-> 16).
//   V codes 2 x 64 x 32 = 4096 @8208; Gv = min(128, 64) = 64: meta
//   2 x 64 x 1 x 2 = 256: scale @12304, zero @12560 -> 12816 B;
//   16384 values -> 6.2578125 bits.
TEST(LayoutTest, Fp8KeysInt4ValuesTwoHeads) {
  const PageShape s{64, 2, 64};
  ExpectLayout(Encoding(Format::kFP8, Format::kINT4, 128), s,
               TL(0, 8192, 8192, 0, 8), TL(8208, 4096, 12304, 12560, 256),
               12816, 6.2578125);
}

// T=64 with the default group: keys get two token groups (Gk = 32).
//   int4 T=64 H=1 D=128: K codes 4096; meta 2 x 128 x 2 = 512: @4096, @4608;
//   V codes @5120; V meta 64 x 4 x 2 = 512: @9216, @9728 -> 10240 B = 5 bits.
TEST(LayoutTest, KeyGroupsSplitLongPages) {
  const PageShape s{64, 1, 128};
  EXPECT_EQ(s.KeyGroup(Format::kINT4), 32);
  EXPECT_EQ(s.ValueGroup(Format::kINT4), 32);
  ExpectLayout(Format::kINT4, s, TL(0, 4096, 4096, 4608, 512),
               TL(5120, 4096, 9216, 9728, 512), 10240, 5.0);
  // Group 128: one key group (Gk = 64), one value group (Gv = 128):
  // K meta 128 x 2 = 256: @4096, @4352; V codes @4608; V meta 64 x 2 = 128:
  // @8704, @8832 -> 8960 B = 4.375 bits.
  ExpectLayout(Encoding(Format::kINT4, Format::kINT4, 128), s,
               TL(0, 4096, 4096, 4352, 256), TL(4608, 4096, 8704, 8832, 128),
               8960, 4.375);
}

// One token, one head, D=16: every section rounds up to 16 bytes.
//   int2: codes 4 -> 16; K meta 16 x 2 = 32; V meta 1 x 1 x 2 = 2 -> 16
//   0 | 16 | 48 | 80 | 96 | 112 -> 128 B; 32 values -> 32 bits.
TEST(LayoutTest, PaddingCountsInPageBytes) {
  const PageShape s{1, 1, 16};
  ExpectLayout(Format::kINT2, s, TL(0, 4, 16, 48, 32), TL(80, 4, 96, 112, 2),
               128, 32.0);
}

TEST(LayoutTest, SectionsAreAlignedAndDisjoint) {
  for (Format fk : kAllFormats) {
    for (Format fv : kAllFormats) {
      for (int g : {0, 64, 128}) {
        for (ScaleDtype sd : {ScaleDtype::kFP16, ScaleDtype::kFP8}) {
          for (int t : {1, 7, 16, 64}) {
            for (int d : {16, 64, 128, 256}) {
              const Encoding e(fk, fv, g, sd);
              const PageShape s{t, 3, d};
              if (ValidateEncoding(e, s) != nullptr) continue;
              const PageLayout l = ComputeLayout(e, s);
              size_t end = 0;
              for (const TensorLayout* x : {&l.k, &l.v}) {
                ASSERT_EQ(x->codes % 16, 0u);
                ASSERT_GE(x->codes, end);
                end = x->codes + x->codes_bytes;
                if (x->meta_bytes > 0) {
                  ASSERT_EQ(x->scale % 16, 0u);
                  ASSERT_GE(x->scale, end);
                  end = x->scale + x->meta_bytes;
                }
                if (x->zero != 0) {
                  ASSERT_EQ(x->zero % 16, 0u);
                  ASSERT_GE(x->zero, end);
                  end = x->zero + x->meta_bytes;
                }
              }
              ASSERT_EQ(l.total % 16, 0u);
              ASSERT_GE(l.total, end);
              ASSERT_LT(l.total, end + 16);
            }
          }
        }
      }
    }
  }
}

TEST(LayoutTest, ValidateEncoding) {
  const PageShape s{16, 2, 128};
  for (Format f : kAllFormats) EXPECT_EQ(ValidateEncoding(f, s), nullptr);
  auto msg = [](const Encoding& e, const PageShape& s) {
    const char* m = ValidateEncoding(e, s);
    return std::string(m == nullptr ? "OK" : m);
  };
  EXPECT_EQ(msg(Encoding(static_cast<Format>(9), Format::kBF16), s),
            "unknown key format");
  EXPECT_EQ(msg(Encoding(Format::kBF16, static_cast<Format>(0)), s),
            "unknown value format");
  EXPECT_EQ(msg(Encoding(Format::kINT4, Format::kINT4, 16), s),
            "group must be 32, 64 or 128");
  EXPECT_EQ(msg(Encoding(Format::kINT4, Format::kINT4, 48), s),
            "group must be 32, 64 or 128");
  EXPECT_EQ(
      msg(Encoding(Format::kINT4, Format::kINT4, 0, static_cast<ScaleDtype>(3)),
          s),
      "scale dtype must be fp16 or fp8");
  // Key group must divide T for INT keys only: T=48, g=32.
  const PageShape t48{48, 1, 128};
  EXPECT_EQ(msg(Encoding(Format::kINT8, Format::kBF16), t48),
            "key group must divide the page's tokens");
  EXPECT_EQ(msg(Encoding(Format::kBF16, Format::kINT8), t48), "OK");
  EXPECT_EQ(msg(Encoding(Format::kTQ4, Format::kINT4, 64), t48),
            "OK");  // Gk 48
  // Value group must divide D for INT values only: D=48, g=32.
  const PageShape d48{16, 1, 48};
  EXPECT_EQ(msg(Encoding(Format::kBF16, Format::kINT4), d48),
            "value group must divide head_dim");
  EXPECT_EQ(msg(Encoding(Format::kINT4, Format::kFP8), d48), "OK");
  EXPECT_EQ(msg(Encoding(Format::kBF16, Format::kINT4, 64), d48),
            "OK");  // Gv 48
  // INT2 needs D % 4 == 0.
  const PageShape d18{16, 1, 18};
  EXPECT_EQ(msg(Format::kINT2, d18), "int2 needs head_dim % 4 == 0");
  EXPECT_EQ(msg(Format::kINT4, d18), "OK");  // Gv = 18
  // TQ needs a power-of-two D in 16..256, on either side.
  for (int d : {8, 48, 96, 512}) {
    for (Format f : {Format::kTQ4, Format::kTQ3, Format::kTQ2}) {
      EXPECT_EQ(msg(Encoding(Format::kBF16, f), PageShape{16, 1, d}),
                "tq formats need a power-of-two head_dim in 16..256")
          << d;
      EXPECT_EQ(msg(Encoding(f, Format::kBF16), PageShape{16, 1, d}),
                "tq formats need a power-of-two head_dim in 16..256")
          << d;
    }
  }
  for (int d : {16, 32, 64, 128, 256}) {
    EXPECT_EQ(msg(Format::kTQ3, PageShape{16, 1, d}), "OK") << d;
  }
  EXPECT_EQ(msg(Format::kBF16, PageShape{16, 1, 127}),
            "head_dim must be even and >= 2");
  EXPECT_EQ(msg(Format::kBF16, PageShape{0, 1, 128}),
            "tokens must be in 1..4096");
  EXPECT_EQ(msg(Format::kBF16, PageShape{16, 0, 128}), "heads must be >= 1");
}

TEST(LayoutTest, NamesAndBits) {
  for (Format f : kAllFormats) {
    Format parsed;
    ASSERT_TRUE(ParseFormat(FormatName(f), &parsed));
    EXPECT_EQ(parsed, f);
  }
  Format unused;
  EXPECT_FALSE(ParseFormat("int3", &unused));
  EXPECT_FALSE(ParseFormat("", &unused));
  EXPECT_FALSE(ParseFormat(nullptr, &unused));
  const int want_bits[] = {16, 8, 8, 4, 2, 4, 3, 2};
  for (int i = 0; i < 8; ++i)
    EXPECT_EQ(FormatBits(kAllFormats[i]), want_bits[i]);
  EXPECT_TRUE(IsIntFormat(Format::kINT8));
  EXPECT_FALSE(IsIntFormat(Format::kFP8));
  EXPECT_TRUE(IsTqFormat(Format::kTQ3));
  EXPECT_FALSE(IsTqFormat(Format::kINT2));

  char buf[64];
  EXPECT_STREQ(EncodingName(Format::kINT4, buf, sizeof(buf)), "int4");
  EXPECT_STREQ(EncodingName(Encoding(Format::kINT4, Format::kINT4, 32), buf,
                            sizeof(buf)),
               "int4");
  EXPECT_STREQ(
      EncodingName(Encoding(Format::kINT4, Format::kINT2, 64, ScaleDtype::kFP8),
                   buf, sizeof(buf)),
      "k=int4,v=int2,g=64,scale=fp8");
  EXPECT_STREQ(
      EncodingName(Encoding(Format::kTQ4, Format::kINT8), buf, sizeof(buf)),
      "k=tq4,v=int8");
  EXPECT_STREQ(EncodingName(Encoding(Format::kINT8, Format::kINT8, 128), buf,
                            sizeof(buf)),
               "k=int8,v=int8,g=128");
  char tiny[6];
  EXPECT_STREQ(
      EncodingName(Encoding(Format::kTQ4, Format::kINT8), tiny, sizeof(tiny)),
      "k=tq4");  // truncated, still terminated
  EXPECT_EQ(Encoding(Format::kINT4),
            Encoding(Format::kINT4, Format::kINT4, 32));
  EXPECT_NE(Encoding(Format::kINT4),
            Encoding(Format::kINT4, Format::kINT4, 0, ScaleDtype::kFP8));
}

}  // namespace
}  // namespace triax::kernels
