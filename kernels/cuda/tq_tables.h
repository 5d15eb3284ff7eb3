// The TQ tables as the CUDA kernels read them (tq.cuh), built on the host
// from kernels/tq_codebook.h: codebook levels and signs for each TQ
// head_dim D = 16 << i (i in 0..4).
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/cuda/launch_result.h"

namespace triax::kernels::cuda {

struct TqTables {
  // cb[i][bits - 2][j]: level j of the bits-bit codebook for D = 16 << i
  // (levels past 2^bits are 0).
  float cb[5][3][16];
  // sign[i][j]: TqSigns(16 << i)[j] as +-1 (0 past D).
  float sign[5][256];
};

// Built once, on first use; thread-safe.
const TqTables& HostTqTables();

// Runs upload() (one .cu file's copy of the tables, tq.cuh) once per
// current device; later calls return OK at once. kNoDevice when
// cudaGetDevice fails, kTqUpload with upload()'s error. Thread-safe.
LaunchResult EnsureTqTablesUploaded(cudaError_t (*upload)());

}  // namespace triax::kernels::cuda
