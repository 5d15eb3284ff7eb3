// CUDA kernels over KV pages laid out per kernels/layout.h, byte for byte the
// same as the CPU reference (kernels/ref/kv_ref.h):
//   EncodePagesCuda    BF16 token-major tokens -> pages of any format
//   DecodePagesCuda    pages of any format -> float32 token-major
//   DemotePagesCuda    re-encodes pages in place (decode old -> encode new)
//   Crc32cCuda         CRC32C of byte ranges (transfers verify on the device)
//   DecodeAttentionCuda  fused decode attention over per-sequence page lists
//                        whose pages each have their own format (GQA),
//                        split-K (flash-decoding) with a reduce kernel
//
// All pointers are device pointers unless noted. Pages are described by
// DevicePage entries (device memory) so pools of different formats can be
// mixed freely: a page is wherever its `data` points.
//
// Shape requirements (checked on the host; a violation returns
// INVALID_ARGUMENT naming the field and value, nothing is launched):
//   1 <= shape.tokens <= 4096, shape.heads >= 1,
//   head_dim a multiple of 8 in [8, 256], every page's data 16-byte aligned
//   (true for cudaMalloc and for pools sliced at PageBytes, a multiple of 16).
//
// Encodings: each page carries its own (DevicePage::format, packed by
// PackEncoding). The CUDA kernels support K and V each in BF16, FP8, INT8,
// INT4, INT2, TQ4, TQ3, TQ2, any combination, groups 32/64/128, FP16 or FP8
// metadata. TQ needs a power-of-two head_dim in [16, 256] (layout.h); TQ
// encode/decode and the TQ tables (uploaded to each device on first use)
// follow the CPU reference. Callers must run CheckEncodingCuda on every
// encoding they put into a page table (per-page fields live in device
// memory and are not checked on the host). A page whose encoding is
// unsupported or invalid is never silently misread: encode leaves it
// untouched, decode writes NaN to its rows, and attention writes NaN to the
// whole output of the sequence (query-head block) holding it.
//
// Launches are asynchronous on `stream`; a launch failure returns INTERNAL
// with the CUDA error string. Thread contract: functions are reentrant; the
// caller serializes use of the buffers it passes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/crc32c.h"       // IWYU pragma: export
#include "kernels/cuda/device_page.h"  // IWYU pragma: export
#include "kernels/layout.h"

namespace triax::kernels::cuda {

// DevicePage and PackEncoding (the page table's entries) are in
// device_page.h, which the kernels include without absl.

// OK when the CUDA kernels handle `e` on `shape`; else INVALID_ARGUMENT:
// the ValidateEncoding reason or a shape requirement above.
absl::Status CheckEncodingCuda(const Encoding& e, const PageShape& shape);

// The layout the kernels compute on the device for an encoding (the same
// code, compiled for the host); equals ComputeLayout for every supported
// encoding (tested).
PageLayout CudaPageLayout(const Encoding& e, const PageShape& shape);

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

// Re-encodes num_pages pages in one launch: page i is decoded from
// src[i] (its format, its num_tokens) to BF16 (float values rounded to
// nearest-even BF16, as the worker's CPU path does) and encoded into dst[i]
// with dst[i]'s format; dst[i].num_tokens is ignored (src's count is used).
// dst[i].data may equal src[i].data (in place: the whole page is decoded
// into `scratch` before any byte of it is written) or point elsewhere; two
// entries must not share a destination. `scratch` is device memory of at
// least DemoteScratchBytes(shape, num_pages) bytes, 16-byte aligned.
// A src or dst whose encoding is unsupported leaves dst untouched.
struct DemotePagesParams {
  PageShape shape;
  const DevicePage* src = nullptr;  // [num_pages], device
  const DevicePage* dst = nullptr;  // [num_pages], device
  int num_pages = 0;
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
  cudaStream_t stream = nullptr;
};
size_t DemoteScratchBytes(const PageShape& shape, int num_pages);
absl::Status DemotePagesCuda(const DemotePagesParams& p);

// CRC32C (worker/checksum.h's checksum, Castagnoli) of each byte range:
// out[i] = CRC32C(ranges[i]), 0 for an empty range. Ranges may have any
// alignment and length (crc32c.h). `ranges` and `out` are device arrays of
// num_ranges; INVALID_ARGUMENT for num_ranges < 0 or a null array with
// num_ranges > 0. Asynchronous on `stream` like the other entry points.
struct Crc32cParams {
  const ByteRange* ranges = nullptr;  // [num_ranges], device
  int num_ranges = 0;
  uint32_t* out = nullptr;  // [num_ranges], device
  cudaStream_t stream = nullptr;
  Crc32cKernel kernel = Crc32cKernel::kStriped;  // the default is the best
  // An upper bound on the ranges' bytes (0: not known): a large range then
  // gets several warps. Any value gives the same checksums.
  uint64_t max_range_bytes = 0;
};
absl::Status Crc32cCuda(const Crc32cParams& p);

// Copies each range (src -> dst, no overlap) and sets out[i] to the CRC32C
// of the bytes copied, in one launch. Errors as Crc32cCuda.
struct CopyCrc32cParams {
  const CopyRange* ranges = nullptr;  // [num_ranges], device
  int num_ranges = 0;
  uint32_t* out = nullptr;  // [num_ranges], device
  cudaStream_t stream = nullptr;
  Crc32cKernel kernel = Crc32cKernel::kStriped;
  uint64_t max_range_bytes = 0;  // as Crc32cParams
};
absl::Status CopyCrc32cCuda(const CopyCrc32cParams& p);

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
//
// Kernel choice: for head_dim in {16, 32, 64, 128, 256} a tensor-core
// kernel (mma.sync, float32 accumulation) runs: BF16 and TQ tiles are
// multiplied as BF16 (Q rounded to BF16 after scaling, P BF16; TQ tiles
// hold the BF16-rounded codebook levels, their row norms applied to the
// float32 scores and to P before its BF16 rounding); INT and
// FP8 keys/values are dequantized to FP16 (code * scale + zero rounded
// once to FP16) against an FP16 Q and FP16 P. Outputs carry that operand
// rounding (tolerance in kv_cuda_test.cc: max_abs <= 3e-2 for unit inputs,
// measured below 1.3e-2). FP16 operands overflow for |q * scale|, |k| or |v|
// beyond 65504 (the output is then NaN/inf, not silently wrong); the
// metadata's own FP16 range bounds INT values near that. Sequences are
// split over
// num_splits x 4 warps (flash-decoding); a reduce kernel merges the
// partial results. Other head_dims (multiples of 8) use a float32
// CUDA-core kernel without splits.
// Pages are grouped by encoding class (K format) per sequence, each class
// its own split-K partitions, so a mixed-format page table costs about the
// page-weighted mix of the uniform formats' times.
// Workspace: partial results need AttentionWorkspaceBytes(p) bytes (per
// query head 8 classes x num_splits x 4 partials of head_dim + 1 floats,
// plus per-sequence share tables). Pass
// `workspace` (device, 16-aligned, `workspace_bytes` long) to avoid an
// allocation; with workspace == nullptr the call allocates and frees it
// stream-ordered (cudaMallocAsync). Too small a workspace returns
// INVALID_ARGUMENT naming both sizes.
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
  // Optional: scratch for the split and partial results; nullptr with
  // workspace_bytes 0 lets the call allocate its own.
  void* workspace = nullptr;  // see AttentionWorkspaceBytes
  size_t workspace_bytes = 0;
  // Optional: the encodings of the table's pages, as the OR of
  // AttentionFormatBit(page.format, head_dim) over them (a superset is
  // fine). Kernel configurations that none of them needs are not launched
  // (fewer launches: ~5 us each on small batches). 0 = unknown: all launch.
  // A sequence with a page whose bit is missing gets NaN outputs; bits
  // above the 8 classes are INVALID_ARGUMENT.
  uint32_t formats_present = 0;
  // Optional (with num_splits > 0): split each sequence's pages of a class
  // into one share per pages_per_share pages (at most num_splits x 4
  // shares) instead of num_splits x 4. A sequence's output then depends on
  // its own pages only, not on num_splits, as long as num_splits x 4 covers
  // every sequence's shares: callers that batch sequences can size
  // num_splits to the batch and still get the bits a batch of one gives.
  // Negative: INVALID_ARGUMENT.
  int pages_per_share = 0;
  // CTAs per (sequence, KV head, encoding class); 0 = choose per kernel
  // configuration from batch * heads, the SM count and that kernel's
  // resident CTAs per SM (the fewest splits whose grid fills >= 90% of the
  // slots of its waves). Clamped to [1, 64].
  int num_splits = 0;
};
absl::Status DecodeAttentionCuda(const AttentionParams& p);
// Workspace bytes DecodeAttentionCuda needs for `p` (same split choice);
// 0 for the CUDA-core fallback.
size_t AttentionWorkspaceBytes(const AttentionParams& p);

// Bit of AttentionParams::formats_present for a page's packed format
// (DevicePage::format) at this head_dim; always non-zero.
uint32_t AttentionFormatBit(int32_t packed_format, int head_dim);

// Scheduling decisions of DecodeAttentionCuda, exposed for tests.
namespace internal {
// The kernels that serve head_dim: OK with *tensor_cores true for the
// tensor-core kernels (16, 32, 64, 128, 256), false for the CUDA-core
// kernel (the other multiples of 8 in [8, 256]); else INVALID_ARGUMENT
// naming the value.
absl::Status AttentionKernelFor(int head_dim, bool* tensor_cores);
// Encoding class of a page (packed DevicePage::format) for a head_dim:
// 1-4 INT4/INT2/FP8/INT8 keys with INT/FP8 values and 5/7 TQ4/TQ2 keys with
// TQ4/TQ2 values (head_dim >= 64: the transposed kernel); 6 TQ3 keys and
// other TQ pages; 0 BF16 keys and other INT/FP8 pages.
int AttentionClassOf(int32_t packed_format, int head_dim);
// Splits of one launch: the fewest whose grid of ctas x splits CTAs fills
// >= 90% of the slots of its waves (ctas_per_sm x sms resident), else the
// best filled; in [1, 64].
int AttentionSplitsFor(long long ctas, int ctas_per_sm, int sms);
}  // namespace internal

}  // namespace triax::kernels::cuda
