// page_copy_probe: the device work of the ipc transfer path by itself, in
// one process on one GPU, against the device's own copy of the same bytes:
//   copy      cudaMemcpyAsync of the whole buffer (device to device);
//   copy_crc  CopyCrc32cCuda over the buffer cut into pages (what the
//             destination runs on each batch: copy + CRC32C in one pass);
//   crc       Crc32cCuda over the pages (what the source runs per layer).
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
      !Check(cudaMalloc(&dst, bytes), "cudaMalloc") ||
      !Check(cudaMemset(src, 0x5a, bytes), "cudaMemset") ||
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
  const double copy_crc = Time(n, [&] {
    kc::CopyCrc32cParams p;
    p.ranges = static_cast<const kc::CopyRange*>(table);
    p.num_ranges = static_cast<int>(pages);
    p.out = out;
    return kc::CopyCrc32cCuda(p).ok();
  });
  const double crc = Time(n, [&] {
    kc::Crc32cParams p;
    p.ranges = static_cast<const kc::ByteRange*>(range_table);
    p.num_ranges = static_cast<int>(pages);
    p.out = out;
    return kc::Crc32cCuda(p).ok();
  });
  cudaFree(src);
  cudaFree(dst);
  cudaFree(out);
  cudaFree(table);
  cudaFree(range_table);
  if (copy <= 0 || copy_crc <= 0 || crc <= 0) return 1;
  for (auto [name, s] : {std::pair<const char*, double>{"copy", copy},
                         {"copy_crc", copy_crc},
                         {"crc", crc}}) {
    std::printf(
        "%-9s bytes=%zu page=%llu seconds=%.6g gbps=%.1f of_copy=%.3f\n", name,
        bytes, page, s, bytes / s / 1e9, copy / s);
  }
  return 0;
}
