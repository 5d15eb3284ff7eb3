#include "kernels/cuda/tq_tables.h"

#include <cstdint>

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

}  // namespace triax::kernels::cuda
