// One Manager.SequenceCalls stream shared by many threads of a frontend
// (docs/manager.md "Call streams"): each thread makes a sequence call
// (Open, Extend, Close, Fork, Truncate, Get, ReportAccess) and waits for its
// reply; calls made while a write is on the wire go together in the next
// batch, so a busy frontend sends one HTTP/2 message for many calls and the
// manager pays one message, not one RPC, per batch. Client::Connect uses
// it for those calls with ClientOptions::manager_stream.
//
// The stream opens on the first call and again on the first call after it
// ended (the manager restarted, the connection broke, or the manager ended
// it: every call in flight then gets the stream's status; UNAVAILABLE when
// it ended with OK before replying). A call whose deadline has passed is
// not sent (DEADLINE_EXCEEDED); one that passes its deadline waiting
// returns DEADLINE_EXCEEDED then (the manager may still apply it; its reply
// is dropped) — mutating calls carry request ids, so a retry is safe.
//
// Thread contract: thread-safe; Call blocks only its caller. The destructor
// cancels the stream (calls in flight get CANCELLED) and waits for gRPC to
// be done with it, at most 5 s. A stream is released only on a caller's
// thread, never on gRPC's (see Stream::Open).
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "triax/v1/manager.grpc.pb.h"

namespace triax::client {

class SequenceCallStream {
 public:
  // `stub` outlives this; `token`: the bearer token sent in the stream's
  // metadata (empty: none), which authorizes every call on it.
  SequenceCallStream(triax::v1::Manager::Stub* stub, std::string token);
  ~SequenceCallStream();
  SequenceCallStream(const SequenceCallStream&) = delete;
  SequenceCallStream& operator=(const SequenceCallStream&) = delete;

  // Sends `call` (its call_id is set here) and waits for its reply until
  // `deadline`. The reply's code and message as a grpc::Status; on OK
  // *reply holds the response (reply->reply_case() is the call's kind).
  grpc::Status Call(triax::v1::SequenceCall call,
                    std::chrono::system_clock::time_point deadline,
                    triax::v1::SequenceReply* reply);

  // Streams opened so far (1 after the first call, more after each end).
  uint64_t streams_opened() const;

 private:
  class Stream;
  // The live stream, opened now when there is none or it ended.
  std::shared_ptr<Stream> Current();

  triax::v1::Manager::Stub* const stub_;
  const std::string token_;
  mutable absl::Mutex mu_;
  std::shared_ptr<Stream> stream_ ABSL_GUARDED_BY(mu_);
  // Ended streams gRPC may still be finishing (released once done).
  std::vector<std::shared_ptr<Stream>> retired_ ABSL_GUARDED_BY(mu_);
  uint64_t opened_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace triax::client
