// Prints a markdown table of bytes per page and effective bits per value
// (all metadata and padding included) for every page format, for the page
// shapes used in kernels/README.md. Usage: format_table [--heads=N]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "kernels/layout.h"

int main(int argc, char** argv) {
  using triax::kernels::EffectiveBits;
  using triax::kernels::Format;
  using triax::kernels::FormatName;
  using triax::kernels::PageBytes;
  using triax::kernels::PageShape;
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
  std::printf("| format | T | H | D | G | bytes/page | effective bits |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|\n");
  for (Format f : {Format::kBF16, Format::kINT4, Format::kINT2}) {
    for (int t : {16, 32, 64}) {
      for (int d : {64, 128}) {
        const PageShape s{t, heads, d, 0};
        std::printf("| %s | %d | %d | %d | %d | %zu | %.3f |\n", FormatName(f),
                    t, heads, d, s.ValueGroup(), PageBytes(f, s),
                    EffectiveBits(f, s));
      }
    }
  }
  return 0;
}
