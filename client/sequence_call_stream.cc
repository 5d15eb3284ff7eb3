// SequenceCallStream (sequence_call_stream.h): a ClientBidiReactor per
// stream, its calls in flight keyed by call_id, a queue of calls waiting
// for the write on the wire to finish.
#include "client/sequence_call_stream.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/bearer.h"

namespace triax::client {

namespace v1 = triax::v1;

namespace {

// A caller's wait for one reply.
struct Slot {
  absl::Notification done;
  grpc::Status status;
  v1::SequenceReply reply;
};

}  // namespace

class SequenceCallStream::Stream
    : public grpc::ClientBidiReactor<v1::SequenceCallBatch,
                                     v1::SequenceReplyBatch> {
 public:
  // Starts the call. The owner keeps a reference until done() (OnDone has
  // returned from its last access), so that the stream, and the channel
  // reference its ClientContext holds, are never released on a gRPC
  // thread: the channel's last release there can tear down gRPC's shared
  // callback queue under the thread that is running it.
  static std::shared_ptr<Stream> Open(v1::Manager::Stub* stub,
                                      const std::string& token) {
    std::shared_ptr<Stream> s(new Stream());
    AddBearer(&s->ctx_, token);
    stub->async()->SequenceCalls(&s->ctx_, s.get());
    s->StartRead(&s->in_);
    s->StartCall();
    return s;
  }

  // Queues `call` for the next batch; false when the stream has ended.
  bool Send(v1::SequenceCall* call, const std::shared_ptr<Slot>& slot,
            uint64_t* id) {
    absl::MutexLock lock(&mu_);
    if (ended_) return false;
    *id = ++next_id_;
    call->set_call_id(*id);
    slots_.emplace(*id, slot);
    queue_.push_back(std::move(*call));
    if (!writing_) WriteLocked();
    return true;
  }

  // The caller stopped waiting for `id`: a late reply is dropped.
  void Forget(uint64_t id) {
    absl::MutexLock lock(&mu_);
    slots_.erase(id);
  }

  bool ended() const {
    absl::MutexLock lock(&mu_);
    return ended_;
  }

  // OnDone has run to its end: the stream may be released.
  bool done() const { return done_.HasBeenNotified(); }

  // Cancels the stream and waits (at most `timeout`) until gRPC is done;
  // true when it is.
  bool CancelAndWait(absl::Duration timeout) {
    ctx_.TryCancel();
    return done_.WaitForNotificationWithTimeout(timeout);
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (ok && !queue_.empty()) WriteLocked();
    // !ok: the stream is ending; OnDone fails what is in flight.
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream ended; OnDone follows
    std::vector<std::shared_ptr<Slot>> ready;
    {
      absl::MutexLock lock(&mu_);
      for (v1::SequenceReply& r : *in_.mutable_replies()) {
        auto it = slots_.find(r.call_id());
        if (it == slots_.end()) continue;  // its caller gave up
        std::shared_ptr<Slot> slot = std::move(it->second);
        slots_.erase(it);
        slot->status =
            grpc::Status(static_cast<grpc::StatusCode>(r.code()), r.message());
        slot->reply = std::move(r);
        ready.push_back(std::move(slot));
      }
    }
    for (const auto& slot : ready) slot->done.Notify();
    StartRead(&in_);
  }

  void OnDone(const grpc::Status& status) override {
    // A stream never ends OK while calls wait: the client does not close
    // its side; say so if the manager did.
    const grpc::Status why =
        status.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                   "the SequenceCalls stream ended before "
                                   "the reply")
                    : status;
    absl::flat_hash_map<uint64_t, std::shared_ptr<Slot>> failed;
    {
      absl::MutexLock lock(&mu_);
      ended_ = true;
      failed.swap(slots_);
      queue_.clear();
    }
    for (auto& [id, slot] : failed) {
      slot->status = why;
      slot->done.Notify();
    }
    done_.Notify();  // the last access: the owner may release this now
  }

 private:
  Stream() = default;

  void WriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    out_.Clear();
    for (v1::SequenceCall& c : queue_) out_.add_calls()->Swap(&c);
    queue_.clear();
    writing_ = true;
    StartWrite(&out_);
  }

  grpc::ClientContext ctx_;
  v1::SequenceReplyBatch in_;  // the reading thread's
  absl::Notification done_;
  mutable absl::Mutex mu_;
  v1::SequenceCallBatch out_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::SequenceCall> queue_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::shared_ptr<Slot>> slots_
      ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
};

SequenceCallStream::SequenceCallStream(v1::Manager::Stub* stub,
                                       std::string token)
    : stub_(stub), token_(std::move(token)) {}

SequenceCallStream::~SequenceCallStream() {
  std::vector<std::shared_ptr<Stream>> all;
  {
    absl::MutexLock lock(&mu_);
    all = std::move(retired_);
    if (stream_ != nullptr) all.push_back(std::move(stream_));
  }
  for (std::shared_ptr<Stream>& s : all) {
    if (!s->CancelAndWait(absl::Seconds(5))) {
      // gRPC never finished it: leaked rather than freed under its feet.
      // NOLINTNEXTLINE(bugprone-unhandled-exception-at-new)
      new std::shared_ptr<Stream>(std::move(s));
    }
  }
}

uint64_t SequenceCallStream::streams_opened() const {
  absl::MutexLock lock(&mu_);
  return opened_;
}

std::shared_ptr<SequenceCallStream::Stream> SequenceCallStream::Current() {
  absl::MutexLock lock(&mu_);
  if (stream_ == nullptr || stream_->ended()) {
    // An ended stream is released once gRPC is done with it (below, or in
    // the destructor).
    if (stream_ != nullptr) retired_.push_back(std::move(stream_));
    stream_ = Stream::Open(stub_, token_);
    ++opened_;
  }
  retired_.erase(std::remove_if(retired_.begin(), retired_.end(),
                                [](const std::shared_ptr<Stream>& s) {
                                  return s->done();
                                }),
                 retired_.end());
  return stream_;
}

grpc::Status SequenceCallStream::Call(
    v1::SequenceCall call, std::chrono::system_clock::time_point deadline,
    v1::SequenceReply* reply) {
  if (deadline <= std::chrono::system_clock::now()) {  // as gRPC: not sent
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                        "Deadline Exceeded");
  }
  auto slot = std::make_shared<Slot>();
  std::shared_ptr<Stream> stream;
  uint64_t id = 0;
  // A stream that ended between Current() and Send: one more, fresh.
  for (int attempt = 0; attempt < 2 && stream == nullptr; ++attempt) {
    std::shared_ptr<Stream> s = Current();
    if (s->Send(&call, slot, &id)) stream = std::move(s);
  }
  if (stream == nullptr) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "the SequenceCalls stream ended as it opened");
  }
  if (!slot->done.WaitForNotificationWithDeadline(absl::FromChrono(deadline))) {
    stream->Forget(id);
    // The reply may have come between the timeout and Forget.
    if (!slot->done.HasBeenNotified()) {
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          "Deadline Exceeded");
    }
  }
  *reply = std::move(slot->reply);
  return slot->status;
}

}  // namespace triax::client
