// ImportSession's state (worker/store_transfer.h), shared by the files
// that implement it: store_transfer.cc (begin, per-page installs, commit)
// and store_import_shared.cc (the shared-arena batches of the ipc path).
// Internal to the worker's store; guarded by the sequence's mutex as the
// comments in ImportSession say.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "absl/time/time.h"
#include "kernels/layout.h"
#include "worker/device.h"
#include "worker/sequence_store_internal.h"
#include "worker/store_transfer.h"

namespace triax::worker {

struct ImportSession::State {
  std::shared_ptr<store_internal::Sequence> seq;
  // [block * layers + layer]: 0 not yet, 1 sealed page, 2 window page,
  // kPending in the batch being installed.
  static constexpr uint8_t kPending = 3;
  std::vector<uint8_t> have;
  uint32_t layers = 0;
  uint8_t& Have(uint32_t block, uint32_t layer) {
    return have[size_t{block} * layers + layer];
  }
  // CheckShared's output (the batch's copies, the `have` entries it marked
  // kPending, the pages the copies write) and the CRC32Cs of a batch's
  // copies: buffers kept from batch to batch.
  std::vector<PageCopy> jobs;
  std::vector<uint8_t*> marked;
  std::vector<Page*> dst;
  std::vector<uint32_t> crcs;
  // StartSharedRuns: the pipeline and its batches in flight, oldest first.
  struct Batch {
    std::vector<SharedRun> runs;  // crc32cs point into `want`
    std::vector<uint32_t> want;   // the source's CRC32Cs
    std::vector<uint8_t*> marked;
    std::vector<Page*> pinned;  // the pages the copies write
  };
  std::unique_ptr<CheckedCopies> copier;
  std::deque<Batch> in_flight;
  std::vector<uint32_t> layer_pages;  // installed per layer
  uint32_t prefix_blocks = 0;         // blocks shared with the prefix
  uint32_t pages_per_layer = 0;       // non-evicted blocks
  absl::Time start;
  ImportResult result;
  bool committed = false;
  // PageBytes of the last encoding asked for (pages come in runs of one
  // encoding) and of BF16, for the per-page checks and figures.
  kernels::Encoding last_encoding;
  size_t last_bytes = 0;
  size_t bf16_bytes = 0;
  size_t BytesOf(const kernels::Encoding& e, const kernels::PageShape& shape) {
    if (last_bytes == 0 || !(e == last_encoding)) {
      last_encoding = e;
      last_bytes = kernels::PageBytes(e, shape);
    }
    return last_bytes;
  }
};

}  // namespace triax::worker
