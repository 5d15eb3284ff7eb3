// CPU reference for page encoding and mixed-format decode attention. The
// worker's CPU backend runs these directly; CUDA kernels are tested against
// them.
//
// Preconditions (callers validate; nothing is checked here): every page's
// encoding passes ValidateEncoding(e, shape) (which also bounds the shape).
// With valid parameters no function reads or writes outside the buffers
// described.
//
// Numerics: INT scale/zero and the FP8 scale are rounded to their storage
// type before codes are computed, so decode uses exactly what encode
// intended. TQ pages decode to the original domain in DecodePage
// (x = n * R^T c) and are used in the rotated domain by attention.
//
// Thread contract: all functions are thread-safe; each thread keeps its own
// float scratch (thread_local, grown on demand, never shrunk: about
// 8 * T * D + 4 * Hq * D floats), so repeated attention calls do not
// allocate. The TQ tables (tq_codebook.h) are built once on first use.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/layout.h"

namespace triax::kernels {

// Encodes tokens [0, num_tokens) of one page from BF16 K and V given
// token-major ([num_tokens][H][D]) into `page` (PageBytes(e, shape) bytes).
// 1 <= num_tokens <= shape.tokens; slots past num_tokens are zeroed.
// ValidateEncoding(e, shape) must have returned nullptr.
void EncodePage(const Encoding& e, const PageShape& shape,
                const uint16_t* k_bf16, const uint16_t* v_bf16, int num_tokens,
                uint8_t* page);

// Decodes tokens [0, num_tokens) of a page into float32, token-major
// ([num_tokens][H][D]). Either output may be null.
void DecodePage(const Encoding& e, const PageShape& shape, const uint8_t* page,
                int num_tokens, float* k_out, float* v_out);

// Writes token `t` (H*D BF16 values each for K and V, [H][D]) into a BF16
// page in place; used for the recent window, which is BF16 pages.
void WriteBf16Token(const PageShape& shape, const uint16_t* k_bf16,
                    const uint16_t* v_bf16, int t, uint8_t* page);

// One page of a sequence as attention sees it, in sequence order.
struct PageRef {
  Encoding encoding;  // K and V formats of this page
  const uint8_t* data = nullptr;
  int num_tokens = 0;  // valid tokens in this page, 1..shape.tokens
};

// Decode attention for one query vector set over a list of pages of mixed
// encodings (the BF16 recent window is simply BF16 pages at the end). TQ
// keys and values are used in the rotated domain (layout.h).
//   q:   float32 [n_q_heads][D]; query head h uses KV head h / (Hq / H)
//   out: float32 [n_q_heads][D]
//   Tokens attended: the first `attend_tokens` tokens of the concatenated
//   pages (causal limit); 1 <= attend_tokens <= sum of num_tokens.
// Softmax in float32 with max subtraction; scores use `scale`. Each page is
// decoded once per KV head into scratch and shared by the head's query
// group; a per-page online softmax keeps a single pass over the pages.
struct DecodeParams {
  const float* q = nullptr;
  float* out = nullptr;
  int n_q_heads = 0;
  PageShape shape;  // heads = KV heads
  float scale = 0.f;
  const PageRef* pages = nullptr;
  int num_pages = 0;
  long attend_tokens = 0;
};
void DecodeAttentionRef(const DecodeParams& p);

}  // namespace triax::kernels
