#include "kernels/cuda/tq_tables.h"

#include <cstdint>
#include <mutex>
#include <set>
#include <utility>

#include "kernels/tq_codebook.h"

namespace triax::kernels::cuda {
namespace {

TqTables Build() {
  TqTables t;
  for (int i = 0; i < 5; ++i) {
    const int d = 16 << i;
    for (int bits = 2; bits <= 4; ++bits) {
      const float* c = TqCodebook(bits, d);
      for (int j = 0; j < 16; ++j)
        t.cb[i][bits - 2][j] = j < (1 << bits) ? c[j] : 0.f;
    }
    const int8_t* sg = TqSigns(d);
    for (int j = 0; j < 256; ++j) t.sign[i][j] = j < d ? sg[j] : 0.f;
  }
  return t;
}

}  // namespace

const TqTables& HostTqTables() {
  static const TqTables* tables = new TqTables(Build());
  return *tables;
}

LaunchResult EnsureTqTablesUploaded(cudaError_t (*upload)()) {
  // kernels_cuda links no absl::synchronization; a process-wide std::mutex
  // guards the (.cu file's upload function, device) pairs already done.
  static std::mutex* mu = new std::mutex();
  static std::set<std::pair<cudaError_t (*)(), int>>* done =
      new std::set<std::pair<cudaError_t (*)(), int>>();
  LaunchResult r;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    r.kind = LaunchResult::Kind::kNoDevice;
    return r;
  }
  std::lock_guard<std::mutex> lock(*mu);
  if (done->count({upload, dev}) > 0) return r;
  const cudaError_t e = upload();
  if (e != cudaSuccess) {
    r.kind = LaunchResult::Kind::kTqUpload;
    r.error = e;
    return r;
  }
  done->insert({upload, dev});
  return r;
}

}  // namespace triax::kernels::cuda
