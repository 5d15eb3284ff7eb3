// Prints a markdown table of bytes per page and effective bits per value
// (all metadata and padding included) for every page format and a few
// K != V / group / scale-dtype variants, for T = 16/32/64 and D = 64/128
// (docs/kernels.md). Usage: format_table [--heads=N]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/layout.h"

int main(int argc, char** argv) {
  using triax::kernels::EffectiveBits;
  using triax::kernels::Encoding;
  using triax::kernels::EncodingName;
  using triax::kernels::Format;
  using triax::kernels::kAllFormats;
  using triax::kernels::PageBytes;
  using triax::kernels::PageShape;
  using triax::kernels::ScaleDtype;
  using triax::kernels::ValidateEncoding;
  int heads = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--heads=", 8) == 0) {
      heads = std::atoi(argv[i] + 8);
    } else {
      std::fprintf(stderr, "unknown flag %s; usage: format_table [--heads=N]\n",
                   argv[i]);
      return 2;
    }
  }
  if (heads < 1) {
    std::fprintf(stderr, "--heads must be >= 1, got %d\n", heads);
    return 2;
  }
  std::vector<Encoding> encodings(std::begin(kAllFormats),
                                  std::end(kAllFormats));
  encodings.emplace_back(Format::kINT4, Format::kINT4, 128);
  encodings.emplace_back(Format::kINT4, Format::kINT4, 32, ScaleDtype::kFP8);
  encodings.emplace_back(Format::kINT2, Format::kINT2, 128, ScaleDtype::kFP8);
  encodings.emplace_back(Format::kINT4, Format::kINT2);
  encodings.emplace_back(Format::kFP8, Format::kINT4);
  encodings.emplace_back(Format::kTQ4, Format::kINT8);
  encodings.emplace_back(Format::kTQ4, Format::kTQ3);

  const int shapes[][2] = {{16, 64},  {16, 128}, {32, 64},
                           {32, 128}, {64, 64},  {64, 128}};
  std::printf("bytes per page / effective bits, H=%d\n\n", heads);
  std::printf("| encoding |");
  for (const auto& td : shapes) std::printf(" T=%d D=%d |", td[0], td[1]);
  std::printf("\n|---|");
  for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); ++i) {
    std::printf("---:|");
  }
  std::printf("\n");
  char name[64];
  for (const Encoding& e : encodings) {
    std::printf("| %s |", EncodingName(e, name, sizeof(name)));
    for (const auto& td : shapes) {
      const PageShape s{td[0], heads, td[1]};
      if (ValidateEncoding(e, s) != nullptr) {
        std::printf(" n/a |");
        continue;
      }
      std::printf(" %zu / %.3f |", PageBytes(e, s), EffectiveBits(e, s));
    }
    std::printf("\n");
  }
  return 0;
}
