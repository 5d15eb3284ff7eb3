#include "bench/transfer/transfer_cases.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "common/status_matchers.h"

namespace triax::bench {
namespace {

using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

std::string Name(const kernels::Encoding& e) {
  char buf[64];
  return kernels::EncodingName(e, buf, sizeof(buf));
}

TEST(ParseSizes, BytesBecomeWholeBlocksOfTokens) {
  const BenchShape shape;
  EXPECT_EQ(shape.Bf16BytesPerToken(), 128u * 1024);
  auto sizes = ParseSizes("1M,16M,256m,4G,3000K", shape, "--sizes");
  ASSERT_THAT(sizes.status(), IsOk());
  ASSERT_EQ(sizes->size(), 5u);
  EXPECT_EQ((*sizes)[0].tokens, 16u);  // 8 tokens, rounded up to a block
  EXPECT_EQ((*sizes)[1].tokens, 128u);
  EXPECT_EQ((*sizes)[2].tokens, 2048u);
  EXPECT_EQ((*sizes)[2].label, "256m");
  EXPECT_EQ((*sizes)[3].tokens, 32768u);  // the 32k-token sequence
  EXPECT_EQ((*sizes)[3].nominal_bytes, uint64_t{4} << 30);
  EXPECT_EQ((*sizes)[4].tokens, 32u);  // 23.4 tokens -> 24 -> 2 blocks
}

TEST(ParseSizes, BadEntriesNameTheFlagAndValue) {
  const BenchShape shape;
  for (const char* bad : {"0", "1X", "", "M", "-1M", "2000T", "1M,,2M"}) {
    EXPECT_THAT(
        ParseSizes(bad, shape, "--sizes").status(),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--sizes: \"")))
        << bad;
  }
  EXPECT_THAT(ParseSizes("1M,7Q", shape, "--overlap_sizes").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--overlap_sizes: \"7Q\"")));
}

TEST(ParseEncodingLabel, ReadsPolicyMdLabels) {
  auto e = ParseEncodingLabel("k=int4,v=int4,g=128");
  ASSERT_THAT(e.status(), IsOk());
  EXPECT_EQ(e->k, kernels::Format::kINT4);
  EXPECT_EQ(e->group, 128);
  for (const char* label :
       {"bf16", "tq2", "k=int8,v=int4", "k=int4,v=int2,g=64,scale=fp8"}) {
    auto parsed = ParseEncodingLabel(label);
    ASSERT_THAT(parsed.status(), IsOk()) << label;
    EXPECT_EQ(Name(*parsed), label);
  }
  EXPECT_THAT(ParseEncodingLabel("k=int5,v=int4").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"int5\" is no format")));
  EXPECT_THAT(ParseEncodingLabel("k=int4").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("needs both k= and v=")));
}

TEST(Tri35Mix, EachCycleOf101BlocksHoldsTheListedCounts) {
  const Mix mix = Tri35Mix();
  ASSERT_EQ(mix.entries.size(), 13u);
  std::map<std::string, int> want;
  int total = 0;
  for (const auto& [e, w] : mix.entries) {
    want[Name(e)] = w;
    total += w;
  }
  EXPECT_EQ(total, 101);
  EXPECT_EQ(want["tq2"], 53);
  EXPECT_EQ(want["k=int8,v=int4"], 9);
  const auto blocks = mix.Assign(3 * 101);
  for (int cycle = 0; cycle < 3; ++cycle) {
    std::map<std::string, int> got;
    for (int i = 0; i < 101; ++i) ++got[Name(blocks[cycle * 101 + i])];
    EXPECT_EQ(got, want) << "cycle " << cycle;
  }
  // Deterministic, and spread out: no run of 4 equal non-tq2 encodings.
  EXPECT_EQ(Name(mix.Assign(5)[0]), Name(blocks[0]));
  for (int i = 0; i + 3 < 101; ++i) {
    const std::string n = Name(blocks[i]);
    if (n == "tq2") continue;
    EXPECT_FALSE(n == Name(blocks[i + 1]) && n == Name(blocks[i + 2]) &&
                 n == Name(blocks[i + 3]))
        << i;
  }
}

TEST(Tri35Mix, BytesAreAboutAFifthOfBf16) {
  const BenchShape shape;
  const Mix mix = Tri35Mix();
  uint64_t bytes = 0;
  for (const auto& e : mix.Assign(101)) bytes += BlockBytes(e, shape);
  const double ratio =
      double(bytes) / (101 * BlockBytes(kernels::Format::kBF16, shape));
  // policy.md gives 0.215 of BF16 for tri-3.5's plan bytes at head_dim 64
  // and its own T; at T = 16, head_dim 128 the metadata weigh differently.
  EXPECT_GT(ratio, 0.15);
  EXPECT_LT(ratio, 0.30);
  EXPECT_EQ(BlockBytes(kernels::Format::kBF16, shape), 32u * 16 * 8 * 128 * 4);
}

TEST(ParseEncodingCases, SidesAndErrors) {
  const BenchShape shape;
  auto cases =
      ParseEncodingCases("bf16,bf16->int4,tri-3.5,bf16->tri-3.5", shape, "--e");
  ASSERT_THAT(cases.status(), IsOk());
  ASSERT_EQ(cases->size(), 4u);
  EXPECT_EQ((*cases)[1].source.name, "bf16");
  EXPECT_EQ((*cases)[1].destination.name, "int4");
  EXPECT_EQ((*cases)[2].source.name, "tri-3.5");
  EXPECT_EQ((*cases)[2].destination.name, "tri-3.5");
  EXPECT_EQ((*cases)[3].destination.entries.size(), 13u);
  EXPECT_THAT(ParseEncodingCases("bf16,int3", shape, "--e").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--e: \"int3\" names no encoding")));
  EXPECT_THAT(ParseEncodingCases("a->b->c", shape, "--e").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("more than one \"->\"")));
  BenchShape odd = shape;
  odd.head_dim = 96;  // TQ needs a power of two
  EXPECT_THAT(ParseEncodingCases("bf16->tq3", odd, "--e").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("is not valid here")));
}

}  // namespace
}  // namespace triax::bench
