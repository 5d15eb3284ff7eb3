// device_copy_probe: the GPU's own device-to-device copy rate on the same
// bytes, the baseline transfer_bench compares a CUDA transfer path (IPC
// between two workers on one GPU) with. Built only with TRIAX_WITH_CUDA;
// transfer_bench runs it when it is in the bin directory.
//
//   device_copy_probe <bytes> <repeats> <device>
//
// Copies <bytes> between two cudaMalloc buffers with cudaMemcpyAsync
// (device to device, the copy engine path an IPC copy takes), once untimed,
// then <repeats> times, each timed with CUDA events. Prints one line
//   device_copy bytes=<bytes> seconds=<median> gbps=<bytes/median/1e9>
// and exits 0; on a CUDA error (no GPU, out of memory) prints the error on
// stderr and exits 1; bad arguments exit 2.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

bool Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "device_copy_probe: %s: %s\n", what,
               cudaGetErrorString(e));
  return false;
}

bool ParsePositive(const char* text, unsigned long long* out) {
  char* end = nullptr;
  *out = std::strtoull(text, &end, 10);
  return end != text && *end == '\0' && text[0] != '-';
}

}  // namespace

int main(int argc, char** argv) {
  unsigned long long bytes = 0, repeats = 0, device = 0;
  if (argc != 4 || !ParsePositive(argv[1], &bytes) || bytes == 0 ||
      !ParsePositive(argv[2], &repeats) || repeats == 0 || repeats > 1000 ||
      !ParsePositive(argv[3], &device) || device > 1024) {
    std::fprintf(stderr,
                 "usage: device_copy_probe <bytes >= 1> <repeats 1..1000> "
                 "<device>\n");
    return 2;
  }
  void* from = nullptr;
  void* to = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  std::vector<double> seconds;
  bool ok = Check(cudaSetDevice(static_cast<int>(device)), "cudaSetDevice") &&
            Check(cudaMalloc(&from, bytes), "cudaMalloc") &&
            Check(cudaMalloc(&to, bytes), "cudaMalloc") &&
            Check(cudaMemset(from, 0x5a, bytes), "cudaMemset") &&
            Check(cudaEventCreate(&start), "cudaEventCreate") &&
            Check(cudaEventCreate(&stop), "cudaEventCreate") &&
            Check(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice),
                  "cudaMemcpyAsync") &&
            Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  for (unsigned long long r = 0; ok && r < repeats; ++r) {
    float ms = 0;
    ok = Check(cudaEventRecord(start), "cudaEventRecord") &&
         Check(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice),
               "cudaMemcpyAsync") &&
         Check(cudaEventRecord(stop), "cudaEventRecord") &&
         Check(cudaEventSynchronize(stop), "cudaEventSynchronize") &&
         Check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    seconds.push_back(ms / 1e3);
  }
  if (start != nullptr) cudaEventDestroy(start);
  if (stop != nullptr) cudaEventDestroy(stop);
  if (from != nullptr) cudaFree(from);
  if (to != nullptr) cudaFree(to);
  if (!ok) return 1;
  std::sort(seconds.begin(), seconds.end());
  const size_t n = seconds.size();
  const double median =
      n % 2 == 1 ? seconds[n / 2] : (seconds[n / 2 - 1] + seconds[n / 2]) / 2;
  std::printf("device_copy bytes=%llu seconds=%.9g gbps=%.6g\n", bytes, median,
              median > 0 ? bytes / median / 1e9 : 0.0);
  return 0;
}
