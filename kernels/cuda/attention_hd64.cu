// The tensor-core decode attention kernels for head_dim 64 (their own
// translation unit: nvcc builds the head_dims in parallel).
#include "kernels/cuda/attention_launch.cuh"

namespace triax::kernels::cuda {

template struct MmaAttention<64>;

}  // namespace triax::kernels::cuda
