// Decode attention on one bidirectional stream (Worker.AttendStream): a
// frontend opens it once per worker and sends each layer of each decode
// step as one message carrying the batch's items, waiting for the answer
// before the next layer (which needs this layer's output). The stream
// saves what a unary Attend pays per call: a new HTTP/2 stream with its
// headers, deadline and metadata (the capabilities), and the server's
// dispatch of the call to a thread. Each message is served exactly as an
// Attend (docs/worker.md "AttendStream").
//
// Also here: the two halves of a batched Attend shared by
// Client::AttendBatch and AttendStream (the request built from items, the
// response taken into their outputs), for callers that hold a Worker stub
// of their own (bench/decode_step).
//
// Errors. Attend returns the stream's status once the worker has ended it
// (what fails a whole Attend: a malformed tenant_id, a capability the
// stream lacks, with "messages[<n>]: " in front; CANCELLED after Cancel;
// DEADLINE_EXCEEDED past options.timeout_ms; UNAVAILABLE when the worker
// goes away), prefixed "AttendStream: "; the stream is then done and every
// later call returns the same status. Items fail one by one as in
// Client::AttendBatch. Bad items found locally (INVALID_ARGUMENT naming the
// item) send nothing and leave the stream usable.
//
// Thread contract: one thread calls Attend and Finish; Cancel may be called
// from any thread at any time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/kv_client.h"
#include "triax/v1/worker.grpc.pb.h"

namespace triax::client {

// Checks `items` (INVALID_ARGUMENT naming the item: a null seq, q or out,
// num_queries 0, a model shape without heads, an incomplete append) and
// fills *req (cleared first, so a reused request keeps its buffers): one
// AttendItem per item in order, queries (and outputs) in `wire`'s dtype,
// appends as BF16. Every item's seq must name the same worker as the first
// (INVALID_ARGUMENT naming both addresses).
absl::Status MakeAttendRequest(absl::string_view tenant_id,
                               const std::vector<Client::BatchItem>& items,
                               AttendWire wire, triax::v1::AttendRequest* req);
// The worker's answer to MakeAttendRequest's request: each OK item's output
// converted into its args.out; one status per item, errors prefixed
// "<what>: " with the worker's "items[<i>]: ..." message (and "retry after
// <N> ms" when the worker set retry_after_ms). INTERNAL when the response
// has another number of results or an output of the wrong size.
absl::StatusOr<std::vector<absl::Status>> TakeAttendResponse(
    absl::string_view what, const std::vector<Client::BatchItem>& items,
    AttendWire wire, const triax::v1::AttendResponse& resp);

struct AttendStreamOptions {
  AttendWire wire = AttendWire::kF32;
  // The whole stream's deadline from Open; 0: none (a stream lives as long
  // as the decode loop; Cancel ends it).
  int64_t timeout_ms = 0;
};

class AttendStream {
 public:
  // The stream to `worker_address` (Client::worker's cached channel) with
  // the capabilities of every sequence in `seqs` in its metadata, sent
  // once (docs/security.md "Capabilities": a capability that expires while
  // the stream is open refuses the next message; open a new stream with
  // refreshed handles). Does not wait for the worker: a worker that cannot
  // be reached fails the first Attend UNAVAILABLE.
  static absl::StatusOr<std::unique_ptr<AttendStream>> Open(
      Client* client, const std::string& worker_address,
      const std::vector<const SequenceHandle*>& seqs,
      const AttendStreamOptions& options = {});
  // The same on a stub of the caller's, for tenant_id with `capabilities`.
  static absl::StatusOr<std::unique_ptr<AttendStream>> Open(
      triax::v1::Worker::Stub* stub, const std::string& tenant_id,
      const std::vector<triax::v1::Capability>& capabilities,
      const AttendStreamOptions& options = {});

  // Cancels the stream unless Finish ended it.
  ~AttendStream();
  AttendStream(const AttendStream&) = delete;
  AttendStream& operator=(const AttendStream&) = delete;

  // One message: the items' request (MakeAttendRequest), then the worker's
  // answer (TakeAttendResponse). See the header comment for errors.
  absl::StatusOr<std::vector<absl::Status>> Attend(
      const std::vector<Client::BatchItem>& items);
  // Half-closes and returns the stream's status (OK when the worker ended
  // it cleanly). Idempotent.
  absl::Status Finish();
  // Ends the stream from any thread; a blocked Attend returns CANCELLED.
  void Cancel();

  // Messages answered so far.
  uint64_t messages() const { return messages_; }

 private:
  AttendStream(std::string tenant_id, std::string worker_address,
               AttendWire wire);
  static absl::StatusOr<std::unique_ptr<AttendStream>> Start(
      triax::v1::Worker::Stub* stub, const std::string& tenant_id,
      const std::string& worker_address,
      const std::vector<triax::v1::Capability>& capabilities,
      const AttendStreamOptions& options);
  // The stream's status (Finish after a failed Read or Write), prefixed.
  absl::Status Ended();

  const std::string tenant_id_;
  // Items must be on this worker (empty when opened on a stub: unchecked).
  const std::string worker_address_;
  const AttendWire wire_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<triax::v1::AttendRequest,
                                           triax::v1::AttendResponse>>
      stream_;
  // Reused message to message (their buffers stay allocated).
  triax::v1::AttendRequest req_;
  triax::v1::AttendResponse resp_;
  uint64_t messages_ = 0;
  bool done_ = false;
  absl::Status status_;  // once done_
};

}  // namespace triax::client
