// CUDA kernels over KV pages laid out per kernels/layout.h, byte for byte the
// same as the CPU reference (kernels/ref/kv_ref.h):
//   EncodePagesCuda    BF16 token-major tokens -> pages of any format
//   DecodePagesCuda    pages of any format -> float32 token-major
//   DecodeAttentionCuda  fused decode attention over per-sequence page lists
//                        whose pages each have their own format (GQA)
//
// All pointers are device pointers unless noted. Pages are described by
// DevicePage entries (device memory) so pools of different formats can be
// mixed freely: a page is wherever its `data` points.
//
// Shape requirements (checked on the host; a violation returns
// INVALID_ARGUMENT naming the field and value, nothing is launched):
//   1 <= shape.tokens <= 4096, shape.heads >= 1,
//   head_dim a multiple of 8 in [8, 256], value group a multiple of 8 that
//   divides head_dim, every page's data 16-byte aligned (true for cudaMalloc
//   and for pools sliced at PageBytes, which is a multiple of 16).
// Per-page fields (format, num_tokens) live in device memory and are not
// checked on the host: callers build them from validated metadata. A format
// other than 1..3 makes the kernels skip that page (encode/decode) or treat
// it as empty (attention).
//
// Launches are asynchronous on `stream`; a launch failure returns INTERNAL
// with the CUDA error string. Thread contract: functions are reentrant; the
// caller serializes use of the buffers it passes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/layout.h"

namespace triax::kernels::cuda {

// One page in device memory. 16 bytes, so an array of them is one copy.
struct DevicePage {
  uint8_t* data = nullptr;  // PageBytes(format, shape) bytes, 16-byte aligned
  int32_t num_tokens = 0;   // valid tokens, 1..shape.tokens
  int32_t format = 0;       // static_cast<int32_t>(Format)
};
static_assert(sizeof(DevicePage) == 16, "DevicePage is copied as raw bytes");

// Encodes num_pages pages. Page i takes its tokens from
//   k_bf16 + i * shape.tokens * H * D   ([num_tokens][H][D] bf16 bits)
// (same for v), i.e. the input is the concatenation of full pages' worth of
// tokens; only the first num_tokens rows of each page are read, so a
// sequence's contiguous [L][H][D] tokens with L <= num_pages * T may be
// passed directly. Whole pages are written: padding and slots past
// num_tokens are zeroed, so output bytes equal EncodePage's.
struct EncodePagesParams {
  PageShape shape;
  const DevicePage* pages = nullptr;  // [num_pages], device
  int num_pages = 0;
  const uint16_t* k_bf16 = nullptr;
  const uint16_t* v_bf16 = nullptr;
  cudaStream_t stream = nullptr;
};
absl::Status EncodePagesCuda(const EncodePagesParams& p);

// Decodes num_pages pages into float32 token-major outputs laid out like
// the encode input: page i's token t, head h, dim d goes to
//   out[((i * T + t) * H + h) * D + d]   for t < num_tokens.
// Rows t >= num_tokens are not written. Either output may be null.
struct DecodePagesParams {
  PageShape shape;
  const DevicePage* pages = nullptr;  // [num_pages], device
  int num_pages = 0;
  float* k_out = nullptr;
  float* v_out = nullptr;
  cudaStream_t stream = nullptr;
};
absl::Status DecodePagesCuda(const DecodePagesParams& p);

// Decode attention for a batch of sequences, one query token each.
//   q:   float32 [batch][n_q_heads][D]; query head h reads KV head
//        h / (n_q_heads / H). out: float32 [batch][n_q_heads][D].
//   Sequence b's pages, in order, are pages[page_indptr[b] ..
//   page_indptr[b+1]) (CSR block table; page_indptr is device memory);
//   it attends to its first attend_tokens[b] tokens (device memory,
//   1 <= attend_tokens[b] <= sum of its pages' num_tokens). A sequence
//   with no tokens gets zeros.
//   Softmax in float32 with max subtraction; scores are scaled by `scale`.
// n_q_heads must be a multiple of H with (n_q_heads / H) * D <= 4096.
struct AttentionParams {
  PageShape shape;  // heads = KV heads
  int batch = 0;
  int n_q_heads = 0;
  float scale = 0.f;
  const float* q = nullptr;
  float* out = nullptr;
  const DevicePage* pages = nullptr;
  const int32_t* page_indptr = nullptr;    // [batch + 1]
  const int32_t* attend_tokens = nullptr;  // [batch]
  cudaStream_t stream = nullptr;
};
absl::Status DecodeAttentionCuda(const AttentionParams& p);

}  // namespace triax::kernels::cuda
