// transfer_bench's cases, free of gRPC and processes: the benched model
// shape, sequence sizes, the encodings of a case on the source and on the
// destination, and the block plans both workers install.
//
// A case moves one sequence of `tokens` tokens of a Llama-3-8B-shaped model
// (32 layers, 8 KV heads, 32 query heads, head_dim 128, blocks of 16
// tokens: 128 KiB of BF16 K+V per token, so 32768 tokens are 4 GiB). Its
// encoding is "<source>-><destination>" or one name for both, each side
// one of:
//   bf16, fp8, int8, int4, int2, tq4, tq3, tq2  every block in that format;
//   tri-3.5                                      the triaxial mix (below).
// "bf16->int4" stores BF16 on the source and asks the import for INT4, so
// the source re-encodes on the way; "int4" moves the stored INT4 bytes.
//
// tri-3.5 is the final plan mix of the committed 3.5-bit triaxial policy on
// kvproxy-18m's held-out BFCL sessions, copied from the "final plan mix
// (tokens)" column of the tri-3.5 row in bench/results/policy.md (whole
// percents, summing to 101). Blocks take the mix's encodings in the order
// of a smooth weighted round robin, so every run gives the same plan and
// each run of 101 consecutive blocks holds exactly the listed counts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/layout.h"

namespace triax::bench {

struct BenchShape {
  uint32_t n_layers = 32;
  uint32_t n_kv_heads = 8;
  uint32_t n_q_heads = 32;
  uint32_t head_dim = 128;
  uint32_t block_tokens = 16;
  // K and V of one token on every layer in BF16.
  uint64_t Bf16BytesPerToken() const {
    return uint64_t{2} * n_kv_heads * head_dim * 2 * n_layers;
  }
};

// One entry of --sizes: a label ("256M") and the sequence's tokens: the
// bytes over Bf16BytesPerToken, rounded up to whole blocks (so every block
// is full and sealed; the 1M case is one block of 16 tokens, 2 MiB).
struct SizeCase {
  std::string label;
  uint64_t nominal_bytes = 0;
  uint32_t tokens = 0;
};

// "1M,16M,256M,1G,4G": a positive integer with an optional K, M or G
// (binary) suffix per entry. INVALID_ARGUMENT naming `flag` and the entry.
absl::StatusOr<std::vector<SizeCase>> ParseSizes(absl::string_view list,
                                                 const BenchShape& shape,
                                                 absl::string_view flag);

// "bf16", "tq2", or "k=int4,v=int2,g=128,scale=fp8" (kernels::EncodingName's
// form). INVALID_ARGUMENT naming the text.
absl::StatusOr<kernels::Encoding> ParseEncodingLabel(absl::string_view text);

// The mix of a side: (encoding, weight) entries.
struct Mix {
  std::string name;
  std::vector<std::pair<kernels::Encoding, int>> entries;
  // The encoding of each of `blocks` blocks (smooth weighted round robin).
  std::vector<kernels::Encoding> Assign(uint32_t blocks) const;
};

// A case's encodings: the source stores `source`, the import asks for
// `destination`.
struct EncodingCase {
  std::string name;  // as given: "bf16->tri-3.5"
  Mix source, destination;
};

// "bf16,int4,bf16->int4,tri-3.5,bf16->tri-3.5". INVALID_ARGUMENT naming
// `flag` and the entry, and any encoding not valid for `shape`.
absl::StatusOr<std::vector<EncodingCase>> ParseEncodingCases(
    absl::string_view list, const BenchShape& shape, absl::string_view flag);

// The tri-3.5 mix (see the file comment).
Mix Tri35Mix();

// Bytes of one block's pages on every layer in `e`.
uint64_t BlockBytes(const kernels::Encoding& e, const BenchShape& shape);

}  // namespace triax::bench
