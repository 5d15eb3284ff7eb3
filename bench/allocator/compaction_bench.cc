// compaction_bench: what PageAllocator::Compact costs on the CPU backend.
//
// For each free fraction in --free, fills a --pool_mb arena cut into
// --frame_kb frames with pages of kvproxy-18m's encodings at 16-token blocks
// (2 KV heads x head_dim 128: BF16, FP8, INT8, INT4, INT2 and k=int4/v=int2
// pages), allocated round robin so every pool spreads over interleaved
// frames, frees that fraction of the pages at random (seed --seed), then
// compacts. Prints one markdown row per fraction: fragmentation and free
// frames before and after, pages and MB moved, frames freed, milliseconds
// of the Compact call (median of --runs fresh fills) and the copy rate.
// Pages are written whole when allocated, so the copies measure memory
// bandwidth, not first-touch page faults.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kernels/layout.h"
#include "worker/device.h"
#include "worker/page_allocator.h"

ABSL_FLAG(int64_t, pool_mb, 256, "arena size in MiB");
ABSL_FLAG(int64_t, frame_kb, 256, "frame size in KiB");
ABSL_FLAG(std::string, free, "0.25,0.5,0.75,0.9",
          "comma-separated fractions of the pages freed before compacting");
ABSL_FLAG(int, runs, 5, "fills per fraction (the median Compact is shown)");
ABSL_FLAG(uint64_t, seed, 1, "random seed");

namespace {

namespace kernels = triax::kernels;
using triax::worker::AllocatorStats;
using triax::worker::CompactionResult;
using triax::worker::CpuDevice;
using triax::worker::Page;
using triax::worker::PageAllocator;
using triax::worker::PageUse;

struct Row {
  AllocatorStats before, after;
  CompactionResult c;
};

int Run() {
  const size_t pool = static_cast<size_t>(absl::GetFlag(FLAGS_pool_mb)) << 20;
  const size_t frame = static_cast<size_t>(absl::GetFlag(FLAGS_frame_kb)) << 10;
  std::vector<double> fractions;
  for (absl::string_view f : absl::StrSplit(absl::GetFlag(FLAGS_free), ',')) {
    double x = 0;
    if (!absl::SimpleAtod(f, &x) || x < 0 || x > 1) {
      std::fprintf(stderr, "--free: %s is not a fraction in [0, 1]\n",
                   std::string(f).c_str());
      return 2;
    }
    fractions.push_back(x);
  }
  const int runs = std::max(1, absl::GetFlag(FLAGS_runs));
  const kernels::PageShape shape{16, 2, 128};
  const kernels::Encoding encodings[] = {
      kernels::Format::kBF16,
      kernels::Format::kFP8,
      kernels::Format::kINT8,
      kernels::Format::kINT4,
      kernels::Format::kINT2,
      kernels::Encoding(kernels::Format::kINT4, kernels::Format::kINT2)};
  std::printf("pool %zu MiB, frames of %zu KiB; page bytes:", pool >> 20,
              frame >> 10);
  for (const auto& e : encodings) {
    char buf[96];
    std::printf(" %s %zu", kernels::EncodingName(e, buf, sizeof(buf)),
                kernels::PageBytes(e, shape));
  }
  std::printf(
      "\n\n| freed | pages before | fragmentation before | free frames "
      "before | pages moved | MB moved | frames freed | free frames "
      "after | fragmentation after | Compact ms (median of %d) | "
      "MB/s |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
      "\n",
      runs);
  CpuDevice device;
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  for (double fraction : fractions) {
    std::vector<Row> rows;
    uint64_t pages_before = 0;
    for (int r = 0; r < runs; ++r) {
      auto alloc = PageAllocator::Create(&device, pool, frame);
      if (!alloc.ok()) {
        std::fprintf(stderr, "%s\n", alloc.status().ToString().c_str());
        return 2;
      }
      std::vector<Page*> pages;
      // Round robin until an encoding is refused: every pool holds frames
      // interleaved with the others'.
      for (bool full = false; !full;) {
        for (const auto& e : encodings) {
          auto p = (*alloc)->Allocate(e, kernels::PageBytes(e, shape),
                                      PageUse::kTarget);
          if (!p.ok()) {
            full = true;
            break;
          }
          // Written whole, as a worker's pages are: the copies then measure
          // memory bandwidth, not first-touch page faults.
          std::memset((*p)->data, static_cast<int>(pages.size() & 0xFF),
                      (*p)->bytes);
          pages.push_back(*p);
        }
      }
      pages_before = pages.size();
      std::shuffle(pages.begin(), pages.end(), rng);
      const size_t n_free = static_cast<size_t>(fraction * pages.size());
      for (size_t i = 0; i < n_free; ++i) (*alloc)->Unref(pages[i]);
      Row row;
      row.before = (*alloc)->Stats();
      auto c = (*alloc)->Compact();
      if (!c.ok()) {
        std::fprintf(stderr, "%s\n", c.status().ToString().c_str());
        return 1;
      }
      row.c = *c;
      row.after = (*alloc)->Stats();
      for (size_t i = n_free; i < pages.size(); ++i) (*alloc)->Unref(pages[i]);
      rows.push_back(row);
    }
    std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
      return a.c.seconds < b.c.seconds;
    });
    const Row& m = rows[rows.size() / 2];
    const double mb = m.c.bytes_moved / 1048576.0;
    std::printf(
        "| %.2f | %llu | %.3f | %llu | %llu | %.2f | %llu | %llu | "
        "%.3f | %.3f | %.0f |\n",
        fraction, static_cast<unsigned long long>(pages_before),
        m.before.fragmentation,
        static_cast<unsigned long long>(m.before.free_frames),
        static_cast<unsigned long long>(m.c.pages_moved), mb,
        static_cast<unsigned long long>(m.c.frames_freed),
        static_cast<unsigned long long>(m.after.free_frames),
        m.after.fragmentation, m.c.seconds * 1e3,
        m.c.seconds > 0 ? mb / m.c.seconds : 0.0);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return Run();
}
