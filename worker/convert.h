// proto <-> domain conversion for the worker service, in one place. The
// shared vocabulary (ModelShape, BlockSpec and its encodings, Tier) goes
// through common/model_proto.h. Enum values are cast (both sides share
// numbers); range checks happen in the core and the store, which reject an
// out-of-range wire value naming the field.
//
// Domain requests hold views of the message's tensors (KvChunk k / v,
// Attend queries and positions): the message must outlive the request.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/model_proto.h"
#include "triax/v1/types.pb.h"
#include "triax/v1/worker.pb.h"
#include "worker/sequence_store.h"
#include "worker/worker_core.h"

namespace triax::worker {

// The shared vocabulary's converters.
using triax::FromProto;
using triax::ToProto;

// Requests.
AllocatePagesRequest FromProto(const v1::AllocatePagesRequest& p);
ForkRequest FromProto(const v1::WorkerForkRequest& p);
DemoteRequest FromProto(const v1::DemoteRequest& p);
FreeRequest FromProto(const v1::FreePagesRequest& p);
SpillRequest FromProto(const v1::SpillRequest& p);
RestoreRequest FromProto(const v1::RestoreRequest& p);
EvictRequest FromProto(const v1::EvictRequest& p);
WriteMessage FromProto(const v1::WriteKVRequest& p);
KvWrite FromProto(const v1::KvChunk& p);
ReadRequest FromProto(const v1::ReadKVRequest& p);
AttendRequest FromProto(const v1::AttendRequest& p);
InventoryRequest FromProto(const v1::GetInventoryRequest& p);
ImportRequest FromProto(const v1::ImportSequenceRequest& p);
ExportRequest FromProto(const v1::ExportPagesRequest& p);
// The ExportPages request a destination sends for `req`: its non-evicted
// blocks with their encodings here.
v1::ExportPagesRequest ExportRequestFor(const ImportRequest& req);
// Moves the payload's data into the page.
TransferPage FromProto(v1::PagePayload* p);
void ToProto(TransferPage&& d, v1::PagePayload* p);
void ToProto(const ImportReply& d, v1::ImportSequenceResponse* p);
// Appends pages without bytes (shared or link pages: arena_offset and
// shared_bytes) to batch->refs, their encodings to batch->encodings.
void AppendRefs(absl::Span<const TransferPage> pages, v1::PageBatch* batch);
// The batch's pages without bytes, in order (`pages` of shared pages, then
// `refs`), appended to *out. INVALID_ARGUMENT naming the field when refs'
// fields differ in length or an encoding index is outside encodings.
absl::Status PagesWithoutBytes(v1::PageBatch* batch,
                               std::vector<TransferPage>* out);

// Builds batch->runs (PageRuns) from shared pages added in order: a page
// extends the open run when it is the next block of the same layer with
// the same encoding, sealed flag, num_tokens and length, and lies `stride`
// bytes after the run's previous page (the run's second page sets the
// stride, at least the pages' length). Encodings go to batch->encodings.
class RunWriter {
 public:
  explicit RunWriter(v1::PageBatch* batch) : batch_(batch) {}
  void Add(const TransferPage& page);
  // Writes the open run: call before the batch is sent, then Reset once it
  // is cleared for the next.
  void Finish();
  void Reset();
  size_t pages() const { return pages_; }

 private:
  v1::PageBatch* const batch_;
  std::vector<kernels::Encoding> known_;  // batch_->encodings
  size_t pages_ = 0;
  bool open_ = false;
  // The open run.
  kernels::Encoding encoding_;
  uint32_t encoding_index_ = 0;
  uint32_t layer_ = 0;
  uint32_t first_block_ = 0;
  uint32_t count_ = 0;
  uint32_t num_tokens_ = 0;
  bool sealed_ = false;
  uint64_t offset_ = 0;
  uint64_t stride_ = 0;
  uint64_t bytes_ = 0;
};

// The batch's runs (PageRuns) appended to *out, their lineage ids and
// CRC32Cs read in place (the batch must outlive them). INVALID_ARGUMENT
// naming the field when the per-run fields differ in length, an encoding
// index is outside encodings, or the per-page fields' length is not the
// counts' sum.
absl::Status SharedRunsOf(const v1::PageBatch& batch,
                          std::vector<SharedRun>* out);

// Replies.
void ToProto(const AllocateResult& d, v1::AllocatePagesResponse* p);
void ToProto(const ForkResult& d, v1::WorkerForkResponse* p);
void ToProto(const WriteResult& d, v1::WriteKVResponse* p);
void ToProto(const DemoteResult& d, v1::DemoteResponse* p);
void ToProto(const FreeResult& d, v1::FreePagesResponse* p);
void ToProto(const SpillResult& d, v1::SpillResponse* p);
void ToProto(const RestoreResult& d, v1::RestoreResponse* p);
void ToProto(const EvictResult& d, v1::EvictResponse* p);
// One AttendResult per item; a failed item's message is prefixed
// "items[<i>]: " and carries the status's retry_after_ms; an output goes
// in the item's dtype (BF16: rounded to nearest even). Results are added
// to *p: clear it first to reuse its buffers (AttendStream).
void ToProto(const AttendResult& d, v1::AttendResponse* p);
// Tokens [offset, offset + n) of a read as one chunk of `layer`, values in
// `dtype` (F32 as read; BF16 rounded to nearest even).
void ToProto(const ReadResult& d, uint32_t layer, KvDtype dtype,
             uint32_t offset, uint32_t n, v1::KvChunk* p);
// Capacity, usage per K format, sequences, both spill tiers (TIER_HOST,
// TIER_DISK; capacity 0 when disabled), counters and device_error.
void ToProto(const InventorySnapshot& d, v1::Inventory* p);

}  // namespace triax::worker
