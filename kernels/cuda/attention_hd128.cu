// The tensor-core decode attention kernels for head_dim 128 (their own
// translation unit: nvcc builds the head_dims in parallel).
#include "kernels/cuda/attention_launch.cuh"

namespace triax::kernels::cuda {

template struct MmaAttention<128>;

}  // namespace triax::kernels::cuda
