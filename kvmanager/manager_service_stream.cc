// SequenceCalls: the sequence calls (Open, Extend, Close, Fork, Truncate,
// Get, ReportAccess) on one long-lived bidirectional stream.
//
// Each call of a batch goes through the same body as its unary RPC
// (ManagerService::Start*/Do*), so authorization, validation, admission
// after reclaim and the codes and messages are the unary ones; only the way
// the answer leaves differs. A reply waits for the call's durable ticket
// (ManagerCore::WhenDurable) like a unary reply, then joins the stream's
// pending replies; one write at a time carries all of them (a batch), so
// under load one HTTP/2 message answers many calls.
//
// State (mu_): calls in flight from their read until their reply is
// written (their ids, to refuse a reused one), those not answered yet, the
// pending replies, whether a read or a write is outstanding, and why the
// stream ends. Reads stop while max_stream_calls calls are in flight and
// resume as replies are written, so a client that does not read its
// replies makes the stream hold at most that many. The reactor finishes
// once nothing is outstanding: every call answered (even after a
// cancellation: the calls' changes are made and their completions still
// run), no read, no write; it deletes itself in OnDone.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "common/grpc_status.h"
#include "kvmanager/arena_messages.h"
#include "kvmanager/manager_service.h"

namespace triax::manager {

namespace {

const std::string& MethodName(v1::SequenceCall::CallCase c) {
  static const std::string kOpen = "SequenceCalls.OpenSequence";
  static const std::string kExtend = "SequenceCalls.ExtendSequence";
  static const std::string kClose = "SequenceCalls.CloseSequence";
  static const std::string kFork = "SequenceCalls.ForkSequence";
  static const std::string kTruncate = "SequenceCalls.TruncateSequence";
  static const std::string kGet = "SequenceCalls.GetSequence";
  static const std::string kReport = "SequenceCalls.ReportAccess";
  static const std::string kNone = "SequenceCalls.unset";
  switch (c) {
    case v1::SequenceCall::kOpen:
      return kOpen;
    case v1::SequenceCall::kExtend:
      return kExtend;
    case v1::SequenceCall::kClose:
      return kClose;
    case v1::SequenceCall::kFork:
      return kFork;
    case v1::SequenceCall::kTruncate:
      return kTruncate;
    case v1::SequenceCall::kGet:
      return kGet;
    case v1::SequenceCall::kReportAccess:
      return kReport;
    case v1::SequenceCall::CALL_NOT_SET:
      break;
  }
  return kNone;
}

}  // namespace

class SequenceCallReactor final
    : public grpc::ServerBidiReactor<v1::SequenceCallBatch,
                                     v1::SequenceReplyBatch> {
  // A reply on its lease's arena (lease null: on the heap).
  struct Pending {
    v1::SequenceReply* reply;
    ArenaPool::Lease* lease;
  };
  // A call's reply, ready once its changes are durable.
  struct Answered {
    v1::SequenceReply* reply;  // on lease's arena
    ArenaPool::Lease* lease;
    v1::SequenceCall::CallCase kind;
    absl::Time start;
  };

 public:
  SequenceCallReactor(ManagerService* service, grpc::CallbackServerContext* ctx)
      : service_(service),
        ctx_(ctx),
        max_calls_(std::max<uint32_t>(1, service->limits_.max_stream_calls)) {
    absl::MutexLock lock(&mu_);
    reading_ = true;
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client is done writing (or the stream broke)
      absl::MutexLock lock(&mu_);
      reading_ = false;
      reads_done_ = true;
      MaybeFinishLocked();
      return;
    }
    const int n = in_.calls_size();
    int admitted = 0;
    int in_flight_before = 0;
    {
      absl::MutexLock lock(&mu_);
      if (absl::Status bad = CheckBatchLocked(); !bad.ok()) {
        reading_ = false;
        ended_ = ToGrpcStatus(bad);
        DropPendingLocked();
        MaybeFinishLocked();
        return;
      }
      // Room is at least 1: the stream is read only below the limit.
      in_flight_before = in_flight_;
      admitted = std::min<int>(n, max_calls_ - in_flight_);
      in_flight_ += n;
      running_ += n;
    }
    // Without the lock: a call may be answered on this thread. Answers
    // made here wait for durability together, after the loop.
    batch_.clear();
    dispatching_ = std::this_thread::get_id();
    for (int i = 0; i < n; ++i) {
      const v1::SequenceCall& call = in_.calls(i);
      if (i < admitted) {
        Start(call);
        continue;
      }
      // On the heap (no arena's block for a refusal).
      auto* reply = new v1::SequenceReply;
      reply->set_call_id(call.call_id());
      Answer(reply, /*lease=*/nullptr, call.call_case(), absl::Now(),
             grpc::Status(
                 grpc::StatusCode::RESOURCE_EXHAUSTED,
                 absl::StrCat("calls[", i, "] (call_id ", call.call_id(),
                              "): the stream had ", in_flight_before,
                              " calls in flight and room for ", admitted,
                              " of this batch's ", n,
                              "; the limit max_stream_calls = ", max_calls_)));
    }
    dispatching_ = std::thread::id();
    if (!batch_.empty()) {
      // One durable wait for the batch's replies: the thread's ticket is
      // the largest of its calls'. Never in this thread, which reads the
      // next batch meanwhile.
      service_->core_->WhenDurable(
          ManagerCore::TakeDurableTicket(),
          [this, ready = std::move(batch_)] { Delivered(ready); },
          /*may_wait=*/false);
      batch_.clear();
    }
    absl::MutexLock lock(&mu_);
    reading_ = false;
    if (!ended_.has_value()) {
      if (in_flight_ < max_calls_) {
        reading_ = true;
        StartRead(&in_);
      } else {
        paused_ = true;  // OnWriteDone reads again below the limit
      }
    }
    MaybeFinishLocked();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    ReleaseWrittenLocked();
    if (!ok) {  // the stream is gone: nothing more can be sent
      if (!ended_.has_value()) {
        ended_ = grpc::Status(grpc::StatusCode::CANCELLED,
                              "the stream broke while replies were sent");
      }
      DropPendingLocked();
    } else {
      if (!pending_.empty()) WriteLocked();
      if (paused_ && !ended_.has_value() && in_flight_ < max_calls_) {
        paused_ = false;
        reading_ = true;
        StartRead(&in_);
      }
    }
    MaybeFinishLocked();
  }

  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    if (!ended_.has_value()) {
      ended_ = grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled");
    }
    DropPendingLocked();
    MaybeFinishLocked();
  }

  void OnDone() override {
    service_->call_streams_->fetch_sub(1);
    delete this;
  }

 private:
  // A batch is refused whole (the stream ends) for a call with nothing set
  // or a call_id in flight, named with its index: either would make the
  // replies ambiguous. On success the batch's ids are in flight.
  absl::Status CheckBatchLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (in_.calls_size() > max_calls_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "calls has ", in_.calls_size(), " calls, more than a stream may ",
          "have in flight: max_stream_calls = ", max_calls_));
    }
    for (int i = 0; i < in_.calls_size(); ++i) {
      const v1::SequenceCall& call = in_.calls(i);
      absl::Status bad;
      if (call.call_case() == v1::SequenceCall::CALL_NOT_SET) {
        bad = absl::InvalidArgumentError(
            absl::StrCat("calls[", i, "] (call_id ", call.call_id(),
                         ") has no call set (open, extend, close, fork, "
                         "truncate, get or report_access)"));
      } else if (!ids_.insert(call.call_id()).second) {
        bad = absl::InvalidArgumentError(
            absl::StrCat("calls[", i, "]: call_id ", call.call_id(),
                         " is already in flight on this stream"));
      }
      if (!bad.ok()) {
        for (int j = 0; j < i; ++j) ids_.erase(in_.calls(j).call_id());
        return bad;
      }
    }
    return absl::OkStatus();
  }

  // Runs one call's body; its answer comes through Answer, on this thread
  // or later on another.
  void Start(const v1::SequenceCall& call) {
    const absl::Time start = absl::Now();
    const v1::SequenceCall::CallCase kind = call.call_case();
    // The reply on a pooled arena: a plan's BlockPlans and Tags are
    // bump-allocated, not one heap allocation each.
    ArenaPool::Lease* lease = service_->reply_arenas_.Take();
    auto* reply = google::protobuf::Arena::CreateMessage<v1::SequenceReply>(
        lease->arena());
    reply->set_call_id(call.call_id());
    auto done = [this, reply, lease, kind, start](const grpc::Status& status) {
      Answer(reply, lease, kind, start, status);
    };
    ManagerService* s = service_;
    switch (kind) {
      case v1::SequenceCall::kOpen:
        s->StartOpen(ctx_, call.open(), reply->mutable_open(), done);
        return;
      case v1::SequenceCall::kExtend:
        s->StartExtend(ctx_, call.extend(), reply->mutable_extend(), done);
        return;
      case v1::SequenceCall::kReportAccess:
        s->StartReportAccess(ctx_, call.report_access(),
                             reply->mutable_report_access(), done);
        return;
      case v1::SequenceCall::kClose:
        done(ToGrpcStatus(
            s->DoClose(*ctx_, call.close(), reply->mutable_close())));
        return;
      case v1::SequenceCall::kFork:
        done(
            ToGrpcStatus(s->DoFork(*ctx_, call.fork(), reply->mutable_fork())));
        return;
      case v1::SequenceCall::kTruncate:
        done(ToGrpcStatus(
            s->DoTruncate(*ctx_, call.truncate(), reply->mutable_truncate())));
        return;
      case v1::SequenceCall::kGet:
        done(ToGrpcStatus(s->DoGet(*ctx_, call.get(), reply->mutable_get())));
        return;
      case v1::SequenceCall::CALL_NOT_SET:
        break;  // refused by CheckBatchLocked
    }
    done(grpc::Status(grpc::StatusCode::INTERNAL, "call not set"));
  }

  // The call's status is known: its reply goes out once this thread's
  // changes are durable.
  void Answer(v1::SequenceReply* reply, ArenaPool::Lease* lease,
              v1::SequenceCall::CallCase kind, absl::Time start,
              const grpc::Status& status) {
    reply->set_code(static_cast<int32_t>(status.error_code()));
    if (!status.ok()) {
      reply->set_message(status.error_message());
      reply->clear_reply();  // as a unary call sends no response on error
    }
    Answered a{reply, lease, kind, start};
    if (std::this_thread::get_id() == dispatching_) {
      batch_.push_back(a);  // OnReadDone waits for the batch at once
      return;
    }
    service_->core_->WhenDurable(ManagerCore::TakeDurableTicket(), [this, a] {
      Delivered({&a, 1});
    });
  }

  // The replies are ready (durable): they go out with the next write, all
  // of them together. A call stays in flight until its reply is written,
  // so a client that does not read its replies stops the stream being read
  // (what it holds is bounded by max_stream_calls).
  void Delivered(absl::Span<const Answered> ready) {
    if (service_->record_call_) {
      const absl::Time now = absl::Now();
      for (const Answered& a : ready) {
        service_->record_call_(MethodName(a.kind), a.reply->code(),
                               now - a.start);
      }
    }
    absl::MutexLock lock(&mu_);
    for (const Answered& a : ready) {
      ids_.erase(a.reply->call_id());
      --running_;
      if (ended_.has_value()) {
        Free({a.reply, a.lease});  // nobody will read it
        --in_flight_;
      } else {
        pending_.push_back({a.reply, a.lease});
      }
    }
    if (!writing_ && !pending_.empty()) WriteLocked();
    MaybeFinishLocked();
  }

  void Free(const Pending& p) {
    if (p.lease != nullptr) {
      service_->reply_arenas_.Give(p.lease);
    } else {
      delete p.reply;
    }
  }

  // Every pending reply in one message. out_ is on the heap and only
  // borrows the replies (UnsafeArena*: they stay their arenas'), which go
  // back to the pool once written.
  void WriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const Pending& p : pending_) {
      out_.mutable_replies()->UnsafeArenaAddAllocated(p.reply);
    }
    written_.swap(pending_);
    pending_.clear();
    writing_ = true;
    StartWrite(&out_);
  }

  void ReleaseWrittenLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    out_.mutable_replies()->UnsafeArenaExtractSubrange(0, out_.replies_size(),
                                                       nullptr);
    for (const Pending& p : written_) Free(p);
    in_flight_ -= written_.size();
    written_.clear();
  }

  void DropPendingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const Pending& p : pending_) Free(p);
    in_flight_ -= pending_.size();
    pending_.clear();
  }

  void MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || reading_ || writing_ || running_ > 0) return;
    if (!ended_.has_value()) {
      if (!reads_done_ || !pending_.empty()) return;
      ended_ = grpc::Status::OK;  // the client is done and every call answered
    }
    finished_ = true;
    Finish(*ended_);
  }

  ManagerService* const service_;
  grpc::CallbackServerContext* const ctx_;
  // The thread in OnReadDone's loop (none outside it), and the answers it
  // made there; both only touched by that thread while it is set.
  std::atomic<std::thread::id> dispatching_{};
  std::vector<Answered> batch_;
  const int max_calls_;
  v1::SequenceCallBatch in_;  // read into; used by the reading thread only
  absl::Mutex mu_;
  v1::SequenceReplyBatch out_ ABSL_GUARDED_BY(mu_);
  std::vector<Pending> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<Pending> written_ ABSL_GUARDED_BY(mu_);  // out_'s
  absl::flat_hash_set<uint64_t> ids_ ABSL_GUARDED_BY(mu_);
  // Calls read and not yet written (or dropped); of them, those whose
  // answer is not ready yet (a completion may still call in).
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  // Set when the stream is to end with this status (a refused batch, a
  // cancellation, a failed write); replies are dropped from then on.
  std::optional<grpc::Status> ended_ ABSL_GUARDED_BY(mu_);
};

grpc::ServerBidiReactor<v1::SequenceCallBatch, v1::SequenceReplyBatch>*
ManagerService::SequenceCalls(grpc::CallbackServerContext* ctx) {
  // Counted from here; a refused stream gives its place back at once.
  const uint32_t open = call_streams_->fetch_add(1);
  if (limits_.max_call_streams != 0 && open >= limits_.max_call_streams) {
    call_streams_->fetch_sub(1);
    class Rejected final
        : public grpc::ServerBidiReactor<v1::SequenceCallBatch,
                                         v1::SequenceReplyBatch> {
     public:
      explicit Rejected(grpc::Status s) { Finish(std::move(s)); }
      void OnDone() override { delete this; }
    };
    return new Rejected(
        grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                     absl::StrCat(open,
                                  " SequenceCalls streams are open, the limit "
                                  "max_call_streams = ",
                                  limits_.max_call_streams)));
  }
  return new SequenceCallReactor(this, ctx);
}

}  // namespace triax::manager
