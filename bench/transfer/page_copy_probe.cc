// page_copy_probe: the device work of the ipc transfer path by itself, in
// one process on one GPU, against the device's own copy of the same bytes:
//   copy      cudaMemcpyAsync of the whole buffer (device to device);
//   copy_crc  CopyCrc32cCuda over the buffer cut into pages (what the
//             destination runs on each batch: copy + CRC32C in one pass);
//   crc       Crc32cCuda over the pages (what a source runs for pages
//             without a CRC32C kept from sealing, and a seal per write).
// Each checksum line is printed for every kernel (crc32c.h Crc32cKernel:
// striped, told the page size or not, and one CTA per range), on random bytes
// (table lookups of constant bytes never collide in shared memory); every
// kernel's CRC32Cs must agree or the probe exits 1.
// Without a second process on the GPU this leaves out the time slicing of
// two worker contexts and the per-page control of the transfer protocol.
//
//   page_copy_probe <total bytes> <page bytes> <repeats> [device]
//
// Prints one line per kernel: name, bytes, median seconds (CUDA events),
// GB/s (bytes / seconds / 1e9) and the ratio to `copy`. Exit 1 on a CUDA
// error, 2 on bad arguments.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "kernels/cuda/kv_cuda.cuh"

namespace {

namespace kc = ::triax::kernels::cuda;

bool Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "page_copy_probe: %s: %s\n", what,
               cudaGetErrorString(e));
  return false;
}

bool Parse(const char* text, unsigned long long* out) {
  char* end = nullptr;
  *out = std::strtoull(text, &end, 10);
  return end != text && *end == '\0' && text[0] != '-';
}

// Median seconds of `repeats` runs of `launch` (after one untimed run).
double Time(int repeats, const std::function<bool()>& launch) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<double> s;
  if (!launch() || !Check(cudaDeviceSynchronize(), "warm-up")) return -1;
  for (int r = 0; r < repeats; ++r) {
    float ms = 0;
    cudaEventRecord(a);
    if (!launch()) return -1;
    cudaEventRecord(b);
    if (!Check(cudaEventSynchronize(b), "sync")) return -1;
    cudaEventElapsedTime(&ms, a, b);
    s.push_back(ms / 1e3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(s.begin(), s.end());
  return s[s.size() / 2];
}

// Random bytes (xorshift64) into the device buffer, 64 MiB at a time.
bool Fill(uint8_t* dev, size_t bytes) {
  std::vector<uint64_t> host((size_t{64} << 20) / 8);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (size_t at = 0; at < bytes; at += host.size() * 8) {
    for (uint64_t& w : host) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      w = x;
    }
    const size_t n = std::min(bytes - at, host.size() * 8);
    if (!Check(cudaMemcpy(dev + at, host.data(), n, cudaMemcpyHostToDevice),
               "fill")) {
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  unsigned long long total = 0, page = 0, repeats = 0, device = 0;
  if ((argc != 4 && argc != 5) || !Parse(argv[1], &total) ||
      !Parse(argv[2], &page) || page == 0 || page % 16 != 0 || total < page ||
      !Parse(argv[3], &repeats) || repeats == 0 || repeats > 1000 ||
      (argc == 5 && !Parse(argv[4], &device))) {
    std::fprintf(stderr,
                 "usage: page_copy_probe <total bytes> <page bytes, a "
                 "multiple of 16> <repeats 1..1000> [device]\n");
    return 2;
  }
  const size_t pages = total / page;
  const size_t bytes = pages * page;
  uint8_t *src = nullptr, *dst = nullptr;
  void* table = nullptr;
  uint32_t* out = nullptr;
  if (!Check(cudaSetDevice(static_cast<int>(device)), "cudaSetDevice") ||
      !Check(cudaMalloc(&src, bytes), "cudaMalloc") ||
      !Check(cudaMalloc(&dst, bytes), "cudaMalloc") || !Fill(src, bytes) ||
      !Check(cudaMalloc(&out, pages * 4), "cudaMalloc") ||
      !Check(cudaMalloc(&table, pages * sizeof(kc::CopyRange)), "cudaMalloc")) {
    return 1;
  }
  // Destination pages in reverse order: a gather, as installing is.
  std::vector<kc::CopyRange> copies(pages);
  std::vector<kc::ByteRange> ranges(pages);
  for (size_t i = 0; i < pages; ++i) {
    copies[i].src = src + i * page;
    copies[i].dst = dst + (pages - 1 - i) * page;
    copies[i].bytes = page;
    ranges[i].data = src + i * page;
    ranges[i].bytes = page;
  }
  void* range_table = nullptr;
  if (!Check(cudaMalloc(&range_table, pages * sizeof(kc::ByteRange)),
             "cudaMalloc") ||
      !Check(cudaMemcpy(table, copies.data(), pages * sizeof(kc::CopyRange),
                        cudaMemcpyHostToDevice),
             "upload") ||
      !Check(cudaMemcpy(range_table, ranges.data(),
                        pages * sizeof(kc::ByteRange), cudaMemcpyHostToDevice),
             "upload")) {
    return 1;
  }
  const int n = static_cast<int>(repeats);
  const double copy = Time(n, [&] {
    return Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice),
                 "cudaMemcpyAsync");
  });
  struct Kernel {
    kc::Crc32cKernel kernel;
    uint64_t max_range_bytes;
    const char* name;
  };
  const Kernel kernels[] = {{kc::Crc32cKernel::kStriped, page, "striped"},
                            {kc::Crc32cKernel::kStriped, 0, "striped_nobound"},
                            {kc::Crc32cKernel::kPerCta, 0, "percta"}};
  struct Line {
    std::string name;
    double seconds;
  };
  std::vector<Line> lines = {{"copy", copy}};
  std::vector<uint32_t> first, got(pages);
  bool agree = true;
  for (const Kernel& k : kernels) {
    for (bool with_copy : {true, false}) {
      const double s = Time(n, [&] {
        if (with_copy) {
          kc::CopyCrc32cParams p;
          p.ranges = static_cast<const kc::CopyRange*>(table);
          p.num_ranges = static_cast<int>(pages);
          p.out = out;
          p.kernel = k.kernel;
          p.max_range_bytes = k.max_range_bytes;
          return kc::CopyCrc32cCuda(p).ok();
        }
        kc::Crc32cParams p;
        p.ranges = static_cast<const kc::ByteRange*>(range_table);
        p.num_ranges = static_cast<int>(pages);
        p.out = out;
        p.kernel = k.kernel;
        p.max_range_bytes = k.max_range_bytes;
        return kc::Crc32cCuda(p).ok();
      });
      lines.push_back(
          {std::string(with_copy ? "copy_crc/" : "crc/") + k.name, s});
      if (!Check(cudaMemcpy(got.data(), out, pages * 4, cudaMemcpyDeviceToHost),
                 "download")) {
        return 1;
      }
      if (first.empty()) {
        first = got;
      } else if (got != first) {
        std::fprintf(stderr, "page_copy_probe: %s gives other CRC32Cs\n",
                     lines.back().name.c_str());
        agree = false;
      }
    }
  }
  cudaFree(src);
  cudaFree(dst);
  cudaFree(out);
  cudaFree(table);
  cudaFree(range_table);
  for (const Line& l : lines) {
    if (l.seconds <= 0) return 1;
    std::printf(
        "%-18s bytes=%zu page=%llu seconds=%.6g gbps=%.1f of_copy=%.3f\n",
        l.name.c_str(), bytes, page, l.seconds, bytes / l.seconds / 1e9,
        copy / l.seconds);
  }
  return agree ? 0 : 1;
}
