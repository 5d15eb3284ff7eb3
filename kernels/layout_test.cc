#include "kernels/layout.h"

#include <gtest/gtest.h>

namespace triax::kernels {
namespace {

struct Expected {
  Format f;
  PageLayout l;
  double bits;
};

void ExpectLayout(const PageShape& s, const Expected& e) {
  SCOPED_TRACE(FormatName(e.f));
  const PageLayout l = ComputeLayout(e.f, s);
  EXPECT_EQ(l.k_codes, e.l.k_codes);
  EXPECT_EQ(l.k_codes_bytes, e.l.k_codes_bytes);
  EXPECT_EQ(l.k_scale, e.l.k_scale);
  EXPECT_EQ(l.k_zero, e.l.k_zero);
  EXPECT_EQ(l.k_meta_bytes, e.l.k_meta_bytes);
  EXPECT_EQ(l.v_codes, e.l.v_codes);
  EXPECT_EQ(l.v_codes_bytes, e.l.v_codes_bytes);
  EXPECT_EQ(l.v_scale, e.l.v_scale);
  EXPECT_EQ(l.v_zero, e.l.v_zero);
  EXPECT_EQ(l.v_meta_bytes, e.l.v_meta_bytes);
  EXPECT_EQ(l.total, e.l.total);
  EXPECT_EQ(PageBytes(e.f, s), e.l.total);
  EXPECT_DOUBLE_EQ(EffectiveBits(e.f, s), e.bits);
}

PageLayout L(size_t kc, size_t kcb, size_t ks, size_t kz, size_t kmb, size_t vc,
             size_t vcb, size_t vs, size_t vz, size_t vmb, size_t total) {
  PageLayout l;
  l.k_codes = kc;
  l.k_codes_bytes = kcb;
  l.k_scale = ks;
  l.k_zero = kz;
  l.k_meta_bytes = kmb;
  l.v_codes = vc;
  l.v_codes_bytes = vcb;
  l.v_scale = vs;
  l.v_zero = vz;
  l.v_meta_bytes = vmb;
  l.total = total;
  return l;
}

// T=16, H=4, D=8 (G = 8): 512 values per K and V.
//   BF16: 1024 B each.                                   2048 B, 16 bits.
//   INT4: codes 4*16*4 = 256, k meta 4*8*2 = 64, v meta 4*16*1*2 = 128
//         0 | 256 | 320 | 384 | 640 | 768 -> 896 B = 7 bits.
//   INT2: codes 128 -> 0 | 128 | 192 | 256 | 384 | 512 -> 640 B = 5 bits.
TEST(LayoutTest, SmallHeadDim) {
  const PageShape s{16, 4, 8, 0};
  EXPECT_EQ(s.ValueGroup(), 8);
  ExpectLayout(
      s, {Format::kBF16, L(0, 1024, 0, 0, 0, 1024, 1024, 0, 0, 0, 2048), 16.0});
  ExpectLayout(s, {Format::kINT4,
                   L(0, 256, 256, 320, 64, 384, 256, 640, 768, 128, 896), 7.0});
  ExpectLayout(s, {Format::kINT2,
                   L(0, 128, 128, 192, 64, 256, 128, 384, 512, 128, 640), 5.0});
}

// T=16, H=2, D=128 (G = 32): 4096 values per K and V.
//   INT4: codes 2*16*64 = 2048, k meta 2*128*2 = 512, v meta 2*16*4*2 = 256
//         0 | 2048 | 2560 | 3072 | 5120 | 5376 -> 5632 B = 5.5 bits.
//   INT2: codes 1024 -> 0 | 1024 | 1536 | 2048 | 3072 | 3328 -> 3584 B = 3.5
//   bits.
TEST(LayoutTest, HeadDim128) {
  const PageShape s{16, 2, 128, 0};
  EXPECT_EQ(s.ValueGroup(), 32);
  ExpectLayout(s, {Format::kBF16,
                   L(0, 8192, 0, 0, 0, 8192, 8192, 0, 0, 0, 16384), 16.0});
  ExpectLayout(
      s, {Format::kINT4,
          L(0, 2048, 2048, 2560, 512, 3072, 2048, 5120, 5376, 256, 5632), 5.5});
  ExpectLayout(
      s, {Format::kINT2,
          L(0, 1024, 1024, 1536, 512, 2048, 1024, 3072, 3328, 256, 3584), 3.5});
}

// One token, one head, D=8: every section rounds up to 16 bytes.
//   INT2: codes 2 -> 16, metas 16 each: 0 | 16 | 32 | 48 | 64 | 80 -> 96 B,
//   96*8 / 16 values = 48 bits: padding dominates tiny pages.
TEST(LayoutTest, PaddingCountsInPageBytes) {
  const PageShape s{1, 1, 8, 0};
  ExpectLayout(
      s, {Format::kINT2, L(0, 2, 16, 32, 16, 48, 2, 64, 80, 2, 96), 48.0});
  ExpectLayout(s,
               {Format::kBF16, L(0, 16, 0, 0, 0, 16, 16, 0, 0, 0, 32), 16.0});
}

TEST(LayoutTest, ExplicitValueGroup) {
  const PageShape s{16, 1, 128, 128};
  // v meta: 16 tokens * 1 group * 2 B = 32 B.
  EXPECT_EQ(ComputeLayout(Format::kINT4, s).v_meta_bytes, 32u);
  const PageShape d{16, 1, 128, 0};
  EXPECT_EQ(ComputeLayout(Format::kINT4, d).v_meta_bytes, 128u);
  EXPECT_LT(PageBytes(Format::kINT4, s), PageBytes(Format::kINT4, d));
}

TEST(LayoutTest, SectionsAreAlignedAndDisjoint) {
  for (Format f : {Format::kBF16, Format::kINT4, Format::kINT2}) {
    for (int t : {1, 7, 16, 64}) {
      for (int d : {8, 24, 64, 128, 256}) {
        const PageShape s{t, 3, d, 0};
        const PageLayout l = ComputeLayout(f, s);
        for (size_t off : {l.k_codes, l.k_scale, l.k_zero, l.v_codes, l.v_scale,
                           l.v_zero, l.total}) {
          EXPECT_EQ(off % 16, 0u);
        }
        EXPECT_LE(l.k_codes + l.k_codes_bytes, l.v_codes);
        EXPECT_LE(l.v_codes + l.v_codes_bytes, l.total);
        if (f != Format::kBF16) {
          EXPECT_LE(l.k_codes + l.k_codes_bytes, l.k_scale);
          EXPECT_LE(l.k_scale + l.k_meta_bytes, l.k_zero);
          EXPECT_LE(l.k_zero + l.k_meta_bytes, l.v_codes);
          EXPECT_LE(l.v_codes + l.v_codes_bytes, l.v_scale);
          EXPECT_LE(l.v_scale + l.v_meta_bytes, l.v_zero);
          EXPECT_LE(l.v_zero + l.v_meta_bytes, l.total);
        }
      }
    }
  }
}

TEST(LayoutTest, FormatNames) {
  for (Format f : {Format::kBF16, Format::kINT4, Format::kINT2}) {
    Format parsed;
    ASSERT_TRUE(ParseFormat(FormatName(f), &parsed));
    EXPECT_EQ(parsed, f);
  }
  Format unused;
  EXPECT_FALSE(ParseFormat("int8", &unused));
  EXPECT_FALSE(ParseFormat("", &unused));
  EXPECT_EQ(FormatBits(Format::kBF16), 16);
  EXPECT_EQ(FormatBits(Format::kINT4), 4);
  EXPECT_EQ(FormatBits(Format::kINT2), 2);
}

}  // namespace
}  // namespace triax::kernels
