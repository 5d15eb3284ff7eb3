// Manager.SequenceCalls (manager_service_stream.cc) over real gRPC on
// loopback (manager_service_test_util.h): each call answered as its unary
// RPC, batches, bad input (a call with nothing set, a call_id in flight),
// the limits (calls in flight per stream, streams open), a client that
// closes or cancels with calls in flight, one that writes without reading;
// and the client library's SequenceCallStream shared by many threads.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/sequence_call_stream.h"
#include "kvmanager/manager_service.h"
#include "kvmanager/manager_service_test_util.h"

namespace triax::manager {
namespace {

using Stream =
    grpc::ClientReaderWriter<v1::SequenceCallBatch, v1::SequenceReplyBatch>;

class StreamTest : public ServiceTest {
 protected:
  std::unique_ptr<Stream> OpenStream(grpc::ClientContext* ctx) {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::seconds(20));
    return stub_->SequenceCalls(ctx);
  }

  // Reads replies until `n` are in, keyed by call_id; fails the test when
  // the stream ends first.
  std::map<uint64_t, v1::SequenceReply> ReadReplies(Stream* s, size_t n) {
    std::map<uint64_t, v1::SequenceReply> out;
    v1::SequenceReplyBatch batch;
    while (out.size() < n && s->Read(&batch)) {
      for (const auto& r : batch.replies()) {
        EXPECT_TRUE(out.emplace(r.call_id(), r).second)
            << "call_id " << r.call_id() << " answered twice";
      }
    }
    EXPECT_EQ(out.size(), n);
    return out;
  }

  static v1::SequenceCall OpenCall(uint64_t id, v1::OpenSequenceRequest req) {
    v1::SequenceCall c;
    c.set_call_id(id);
    *c.mutable_open() = std::move(req);
    return c;
  }
  static v1::SequenceCall CloseCall(uint64_t id, const std::string& seq) {
    v1::SequenceCall c;
    c.set_call_id(id);
    c.mutable_close()->set_tenant_id("acme");
    c.mutable_close()->set_sequence_id(seq);
    return c;
  }
  static v1::SequenceCall GetCall(uint64_t id, const std::string& seq) {
    v1::SequenceCall c;
    c.set_call_id(id);
    c.mutable_get()->set_tenant_id("acme");
    c.mutable_get()->set_sequence_id(seq);
    return c;
  }
};

TEST_F(StreamTest, CallsAreAnsweredAsTheirUnaryRpcs) {
  grpc::ClientContext ctx;
  auto s = OpenStream(&ctx);
  v1::SequenceCallBatch batch;
  *batch.add_calls() = OpenCall(7, OpenReq());
  *batch.add_calls() = OpenCall(8, OpenReq());
  v1::OpenSequenceRequest bad = OpenReq();
  bad.clear_model();
  *batch.add_calls() = OpenCall(9, bad);
  *batch.add_calls() = GetCall(10, "no-such-sequence");
  ASSERT_TRUE(s->Write(batch));
  auto first = ReadReplies(s.get(), 4);
  ASSERT_EQ(first[7].code(), 0) << first[7].message();
  ASSERT_EQ(first[8].code(), 0) << first[8].message();
  const v1::SequenceInfo& a = first[7].open().sequence();
  EXPECT_FALSE(a.sequence_id().empty());
  EXPECT_NE(a.sequence_id(), first[8].open().sequence().sequence_id());
  // The same plan as the unary RPC's for the same request.
  v1::OpenSequenceResponse unary_open;
  ASSERT_TRUE(
      Call(&v1::Manager::Stub::OpenSequence, OpenReq(), &unary_open).ok());
  EXPECT_EQ(a.blocks_size(), unary_open.sequence().blocks_size());
  EXPECT_EQ(a.num_tokens(), unary_open.sequence().num_tokens());
  // The errors are the unary RPCs' own, code and message, with no reply.
  v1::OpenSequenceResponse unary_resp;
  const grpc::Status unary_bad =
      Call(&v1::Manager::Stub::OpenSequence, bad, &unary_resp);
  EXPECT_EQ(first[9].code(), unary_bad.error_code());
  EXPECT_EQ(first[9].message(), unary_bad.error_message());
  EXPECT_EQ(first[9].reply_case(), v1::SequenceReply::REPLY_NOT_SET);
  v1::GetSequenceRequest get;
  get.set_tenant_id("acme");
  get.set_sequence_id("no-such-sequence");
  v1::GetSequenceResponse get_resp;
  const grpc::Status unary_get =
      Call(&v1::Manager::Stub::GetSequence, get, &get_resp);
  EXPECT_EQ(unary_get.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(first[10].code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(first[10].message(), unary_get.error_message());

  // Every other kind, on the sequences just opened.
  batch.Clear();
  v1::SequenceCall* c = batch.add_calls();
  c->set_call_id(11);
  auto* ext = c->mutable_extend();
  ext->set_tenant_id("acme");
  ext->set_sequence_id(a.sequence_id());
  ext->set_new_turn(true);
  auto* span = ext->add_spans();
  span->set_role(v1::ROLE_ASSISTANT);
  span->set_num_tokens(16);
  c = batch.add_calls();
  c->set_call_id(12);
  c->mutable_fork()->set_tenant_id("acme");
  c->mutable_fork()->set_parent_sequence_id(
      first[8].open().sequence().sequence_id());
  c->mutable_fork()->set_num_tokens(16);
  c = batch.add_calls();
  c->set_call_id(13);
  c->mutable_report_access()->set_tenant_id("acme");
  c->mutable_report_access()->set_sequence_id(a.sequence_id());
  c->mutable_report_access()->set_active(true);
  *batch.add_calls() = GetCall(14, first[8].open().sequence().sequence_id());
  ASSERT_TRUE(s->Write(batch));
  auto second = ReadReplies(s.get(), 4);
  for (uint64_t id : {11, 12, 13, 14}) {
    EXPECT_EQ(second[id].code(), 0) << id << ": " << second[id].message();
  }
  EXPECT_EQ(second[11].extend().sequence().num_tokens(), 48u);
  EXPECT_EQ(second[11].extend().new_blocks_size(), 1);
  EXPECT_EQ(second[12].fork().sequence().parent_sequence_id(),
            first[8].open().sequence().sequence_id());
  EXPECT_EQ(second[14].get().sequence().sequence_id(),
            first[8].open().sequence().sequence_id());

  batch.Clear();
  c = batch.add_calls();
  c->set_call_id(15);
  c->mutable_truncate()->set_tenant_id("acme");
  c->mutable_truncate()->set_sequence_id(a.sequence_id());
  c->mutable_truncate()->set_num_tokens(32);
  ASSERT_TRUE(s->Write(batch));
  auto third = ReadReplies(s.get(), 1);
  EXPECT_EQ(third[15].code(), 0) << third[15].message();
  EXPECT_EQ(third[15].truncate().sequence().num_tokens(), 32u);

  // Closed on the stream, seen closed through the unary RPC.
  batch.Clear();
  *batch.add_calls() = CloseCall(16, a.sequence_id());
  ASSERT_TRUE(s->Write(batch));
  auto fourth = ReadReplies(s.get(), 1);
  EXPECT_EQ(fourth[16].code(), 0) << fourth[16].message();
  EXPECT_GT(fourth[16].close().freed_lineage_ids_size(), 0);
  get.set_sequence_id(a.sequence_id());
  ASSERT_TRUE(Call(&v1::Manager::Stub::GetSequence, get, &get_resp).ok());
  EXPECT_EQ(get_resp.sequence().state(), v1::SEQUENCE_STATE_CLOSED);

  s->WritesDone();
  const grpc::Status end = s->Finish();
  EXPECT_TRUE(end.ok()) << end.error_message();
}

TEST_F(StreamTest, EveryCallIsCountedUnderItsMethod) {
  absl::Mutex mu;
  std::vector<std::pair<std::string, int>> recorded;
  // No call is in flight yet.
  service_->SetCallRecorder(
      [&](const std::string& method, int code, absl::Duration) {
        absl::MutexLock lock(&mu);
        recorded.push_back({method, code});
      });
  grpc::ClientContext ctx;
  auto s = OpenStream(&ctx);
  v1::SequenceCallBatch batch;
  *batch.add_calls() = OpenCall(1, OpenReq());
  *batch.add_calls() = GetCall(2, "x");
  ASSERT_TRUE(s->Write(batch));
  ReadReplies(s.get(), 2);
  s->WritesDone();
  ASSERT_TRUE(s->Finish().ok());
  absl::MutexLock lock(&mu);
  EXPECT_THAT(recorded,
              ::testing::UnorderedElementsAre(
                  std::pair<std::string, int>{"SequenceCalls.OpenSequence", 0},
                  std::pair<std::string, int>{"SequenceCalls.GetSequence",
                                              grpc::StatusCode::NOT_FOUND}));
}

TEST_F(StreamTest, ACallWithNothingSetEndsTheStreamAndStartsNothing) {
  const std::string before = StateSnapshot();
  grpc::ClientContext ctx;
  auto s = OpenStream(&ctx);
  v1::SequenceCallBatch batch;
  *batch.add_calls() = OpenCall(1, OpenReq());
  batch.add_calls()->set_call_id(2);  // no call
  ASSERT_TRUE(s->Write(batch));
  v1::SequenceReplyBatch replies;
  EXPECT_FALSE(s->Read(&replies));
  const grpc::Status end = s->Finish();
  EXPECT_EQ(end.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(end.error_message(), HasSubstr("calls[1] (call_id 2)"));
  EXPECT_THAT(end.error_message(), HasSubstr("no call set"));
  EXPECT_EQ(StateSnapshot(), before);  // the batch's Open did not run
}

TEST_F(StreamTest, ACallIdInFlightEndsTheStream) {
  grpc::ClientContext ctx;
  auto s = OpenStream(&ctx);
  v1::SequenceCallBatch batch;
  *batch.add_calls() = GetCall(5, "a");
  *batch.add_calls() = GetCall(5, "b");
  ASSERT_TRUE(s->Write(batch));
  v1::SequenceReplyBatch replies;
  EXPECT_FALSE(s->Read(&replies));
  const grpc::Status end = s->Finish();
  EXPECT_EQ(end.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(end.error_message(),
              HasSubstr("calls[1]: call_id 5 is already in flight"));
  // A stream of its own is unaffected; ids may be reused once answered.
  grpc::ClientContext ctx2;
  auto s2 = OpenStream(&ctx2);
  for (int round = 0; round < 2; ++round) {
    batch.Clear();
    *batch.add_calls() = GetCall(5, "a");
    ASSERT_TRUE(s2->Write(batch));
    auto r = ReadReplies(s2.get(), 1);
    EXPECT_EQ(r[5].code(), grpc::StatusCode::NOT_FOUND);
  }
  s2->WritesDone();
  EXPECT_TRUE(s2->Finish().ok());
}

TEST_F(StreamTest, ClosingWithCallsInFlightAnswersThemAll) {
  grpc::ClientContext ctx;
  auto s = OpenStream(&ctx);
  v1::SequenceCallBatch batch;
  for (uint64_t id = 1; id <= 20; ++id)
    *batch.add_calls() = OpenCall(id, OpenReq());
  ASSERT_TRUE(s->Write(batch));
  s->WritesDone();  // before any reply
  auto r = ReadReplies(s.get(), 20);
  std::set<std::string> ids;
  for (auto& [id, reply] : r) {
    EXPECT_EQ(reply.code(), 0) << reply.message();
    ids.insert(reply.open().sequence().sequence_id());
  }
  EXPECT_EQ(ids.size(), 20u);
  EXPECT_TRUE(s->Finish().ok());
}

TEST_F(StreamTest, ACancelledStreamLeavesTheServiceWorking) {
  for (int i = 0; i < 5; ++i) {
    grpc::ClientContext ctx;
    auto s = OpenStream(&ctx);
    v1::SequenceCallBatch batch;
    for (uint64_t id = 1; id <= 10; ++id)
      *batch.add_calls() = OpenCall(id, OpenReq());
    ASSERT_TRUE(s->Write(batch));
    ctx.TryCancel();
    s->Finish();
  }
  // Whatever the cancelled streams' calls did is consistent: the unary RPCs
  // answer, and every open sequence can be closed.
  v1::ListSequencesRequest ls;
  ls.set_tenant_id("acme");
  v1::ListSequencesResponse ls_resp;
  ASSERT_TRUE(Call(&v1::Manager::Stub::ListSequences, ls, &ls_resp).ok());
  for (const auto& seq : ls_resp.sequences()) {
    v1::CloseSequenceRequest close;
    close.set_tenant_id("acme");
    close.set_sequence_id(seq.sequence_id());
    v1::CloseSequenceResponse resp;
    EXPECT_TRUE(Call(&v1::Manager::Stub::CloseSequence, close, &resp).ok());
  }
  EXPECT_FALSE(Open().empty());
}

class StreamLimitsTest : public StreamTest {
 protected:
  ServiceLimits Limits() const override {
    ServiceLimits l;
    l.max_call_streams = 2;
    l.max_stream_calls = 3;
    return l;
  }
};

TEST_F(StreamLimitsTest, ABatchLargerThanTheLimitEndsTheStream) {
  const std::string before = StateSnapshot();
  grpc::ClientContext ctx;
  auto s = OpenStream(&ctx);
  v1::SequenceCallBatch batch;
  for (uint64_t id = 1; id <= 4; ++id)
    *batch.add_calls() = OpenCall(id, OpenReq());
  ASSERT_TRUE(s->Write(batch));
  v1::SequenceReplyBatch replies;
  EXPECT_FALSE(s->Read(&replies));
  const grpc::Status end = s->Finish();
  EXPECT_EQ(end.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(end.error_message(), HasSubstr("calls has 4 calls"));
  EXPECT_THAT(end.error_message(), HasSubstr("max_stream_calls = 3"));
  EXPECT_EQ(StateSnapshot(), before);  // none of them ran
}

TEST_F(StreamLimitsTest, CallsBeyondTheRoomLeftAreRefusedOneByOne) {
  // Batches of 3 written back to back: a batch read while earlier calls
  // are still in flight (not yet written) has less room; each call past
  // it is answered RESOURCE_EXHAUSTED naming itself and the limit, the
  // others are served. Either way every call gets exactly one reply.
  grpc::ClientContext ctx;
  auto s = OpenStream(&ctx);
  uint64_t id = 0;
  for (int b = 0; b < 20; ++b) {
    v1::SequenceCallBatch batch;
    for (int i = 0; i < 3; ++i) *batch.add_calls() = GetCall(++id, "x");
    ASSERT_TRUE(s->Write(batch));
  }
  s->WritesDone();
  auto r = ReadReplies(s.get(), id);
  for (auto& [call, reply] : r) {
    if (reply.code() == grpc::StatusCode::NOT_FOUND) continue;
    EXPECT_EQ(reply.code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << reply.message();
    EXPECT_THAT(reply.message(), HasSubstr("max_stream_calls = 3"));
    EXPECT_THAT(reply.message(),
                HasSubstr(absl::StrCat("(call_id ", call, ")")));
  }
  EXPECT_TRUE(s->Finish().ok());
}

TEST_F(StreamLimitsTest, AClientThatDoesNotReadStopsTheStreamBeingRead) {
  // A sequence of 60 blocks: its GetSequence reply is a few KiB.
  v1::OpenSequenceRequest open = OpenReq();
  open.mutable_spans(0)->set_num_tokens(960 - 12);
  v1::OpenSequenceResponse opened;
  ASSERT_TRUE(Call(&v1::Manager::Stub::OpenSequence, open, &opened).ok());
  const std::string seq = opened.sequence().sequence_id();
  std::atomic<int> served{0};
  service_->SetCallRecorder(  // no call is in flight yet
      [&](const std::string&, int, absl::Duration) { ++served; });
  // A client whose receive window stays at 64 KiB (no BDP growth), so the
  // replies it does not read fill it quickly.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 10);
  auto stub = v1::Manager::NewStub(
      grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port_),
                                grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto s = stub->SequenceCalls(&ctx);
  constexpr int kBatches = 1000;  // 3,000 replies of ~3 KiB: ~9 MiB
  std::thread writer([&] {
    uint64_t id = 0;
    for (int b = 0; b < kBatches; ++b) {
      v1::SequenceCallBatch batch;
      for (int i = 0; i < 3; ++i) *batch.add_calls() = GetCall(++id, seq);
      if (!s->Write(batch)) break;
    }
    s->WritesDone();
  });
  // While the client reads nothing, the manager stops reading its calls
  // once max_stream_calls replies wait to be written: far fewer than all
  // are served.
  absl::SleepFor(absl::Seconds(2));
  const int while_not_reading = served.load();
  EXPECT_LT(while_not_reading, kBatches * 3 / 2);
  EXPECT_GT(while_not_reading, 0);
  // Reading, everything is answered.
  auto r = ReadReplies(s.get(), 3 * kBatches);
  writer.join();
  int ok = 0;
  for (auto& [call, reply] : r) {
    if (reply.code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      // A batch read with less room than its size (back-to-back writes).
      EXPECT_THAT(reply.message(), HasSubstr("max_stream_calls = 3"));
      continue;
    }
    ++ok;
    EXPECT_EQ(reply.code(), 0) << call << ": " << reply.message();
    EXPECT_EQ(reply.get().sequence().blocks_size(),
              opened.sequence().blocks_size());
  }
  EXPECT_GT(ok, kBatches);  // a batch's first call always has room
  EXPECT_TRUE(s->Finish().ok());
  EXPECT_EQ(served.load(), 3 * kBatches);
  std::printf("served while the client did not read: %d of %d\n",
              while_not_reading, 3 * kBatches);
}

TEST_F(StreamLimitsTest, StreamsPastTheLimitAreRefused) {
  grpc::ClientContext c1, c2, c3;
  auto s1 = OpenStream(&c1);
  auto s2 = OpenStream(&c2);
  // Both open: a call on each is answered.
  for (Stream* s : {s1.get(), s2.get()}) {
    v1::SequenceCallBatch batch;
    *batch.add_calls() = GetCall(1, "x");
    ASSERT_TRUE(s->Write(batch));
    ReadReplies(s, 1);
  }
  auto s3 = OpenStream(&c3);
  v1::SequenceReplyBatch replies;
  EXPECT_FALSE(s3->Read(&replies));
  const grpc::Status end = s3->Finish();
  EXPECT_EQ(end.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(end.error_message(), HasSubstr("max_call_streams = 2"));
  // A place is given back when a stream ends (once the manager is done
  // with it, just after the client sees its end).
  s1->WritesDone();
  EXPECT_TRUE(s1->Finish().ok());
  bool served = false;
  for (int attempt = 0; attempt < 250 && !served; ++attempt) {
    grpc::ClientContext c4;
    auto s4 = OpenStream(&c4);
    v1::SequenceCallBatch batch;
    *batch.add_calls() = GetCall(1, "x");
    s4->Write(batch);
    s4->WritesDone();
    v1::SequenceReplyBatch got;
    if (s4->Read(&got)) {
      ASSERT_EQ(got.replies_size(), 1);
      EXPECT_EQ(got.replies(0).code(), grpc::StatusCode::NOT_FOUND);
      served = true;
      while (s4->Read(&got)) {
      }
      EXPECT_TRUE(s4->Finish().ok());
    } else {
      EXPECT_EQ(s4->Finish().error_code(),
                grpc::StatusCode::RESOURCE_EXHAUSTED);
      absl::SleepFor(absl::Milliseconds(20));
    }
  }
  EXPECT_TRUE(served);
  s2->WritesDone();
  EXPECT_TRUE(s2->Finish().ok());
}

// The client library's multiplexer: many threads on one stream, each gets
// its own reply.
TEST_F(StreamTest, SequenceCallStreamServesManyThreads) {
  client::SequenceCallStream calls(stub_.get(), "");
  constexpr int kThreads = 16, kSessions = 20;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kSessions; ++i) {
        v1::SequenceCall open;
        v1::OpenSequenceRequest req = OpenReq();
        req.set_request_id(absl::StrCat("t", t, "-", i));
        *open.mutable_open() = req;
        v1::SequenceReply reply;
        grpc::Status s = calls.Call(
            open, std::chrono::system_clock::now() + std::chrono::seconds(10),
            &reply);
        if (!s.ok() || reply.reply_case() != v1::SequenceReply::kOpen) {
          ++failures;
          continue;
        }
        const std::string seq = reply.open().sequence().sequence_id();
        // The same sequence back from Get: the reply is this call's.
        v1::SequenceCall get;
        get.mutable_get()->set_tenant_id("acme");
        get.mutable_get()->set_sequence_id(seq);
        s = calls.Call(
            get, std::chrono::system_clock::now() + std::chrono::seconds(10),
            &reply);
        if (!s.ok() || reply.get().sequence().sequence_id() != seq) ++failures;
        v1::SequenceCall close;
        close.mutable_close()->set_tenant_id("acme");
        close.mutable_close()->set_sequence_id(seq);
        s = calls.Call(
            close, std::chrono::system_clock::now() + std::chrono::seconds(10),
            &reply);
        if (!s.ok()) ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(calls.streams_opened(), 1u);
  // A call's own error comes back as its status.
  v1::SequenceCall get;
  get.mutable_get()->set_tenant_id("acme");
  get.mutable_get()->set_sequence_id("gone");
  v1::SequenceReply reply;
  const grpc::Status s = calls.Call(
      get, std::chrono::system_clock::now() + std::chrono::seconds(10), &reply);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("gone"));
}

// Frontends come and go: a SequenceCallStream on a channel of its own,
// made, used and dropped again and again. The stream (whose ClientContext
// holds the channel) must not be released on a gRPC thread, where the
// channel's last release would tear down gRPC's callback queue under the
// thread running it (a double free in grpc_cq_internal_unref, seen in
// manager_bench before the fix).
TEST_F(StreamTest, SequenceCallStreamsOnShortLivedChannels) {
  for (int i = 0; i < 40; ++i) {
    auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_),
                                       grpc::InsecureChannelCredentials());
    auto stub = v1::Manager::NewStub(channel);
    auto calls = std::make_unique<client::SequenceCallStream>(stub.get(), "");
    v1::SequenceCall get;
    get.mutable_get()->set_tenant_id("acme");
    get.mutable_get()->set_sequence_id("x");
    v1::SequenceReply reply;
    const grpc::Status s = calls->Call(
        get, std::chrono::system_clock::now() + std::chrono::seconds(10),
        &reply);
    ASSERT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
    calls.reset();
    stub.reset();
    channel.reset();
  }
}

TEST_F(StreamTest, SequenceCallStreamPastItsDeadline) {
  client::SequenceCallStream calls(stub_.get(), "");
  v1::SequenceCall get;
  get.mutable_get()->set_tenant_id("acme");
  get.mutable_get()->set_sequence_id("x");
  v1::SequenceReply reply;
  const grpc::Status s = calls.Call(
      get, std::chrono::system_clock::now() - std::chrono::milliseconds(1),
      &reply);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // The stream stays usable.
  EXPECT_EQ(
      calls
          .Call(get,
                std::chrono::system_clock::now() + std::chrono::seconds(10),
                &reply)
          .error_code(),
      grpc::StatusCode::NOT_FOUND);
}

TEST_F(StreamLimitsTest, SequenceCallStreamReportsTheStreamsEnd) {
  // Both places taken by raw streams: the library's stream is refused, and
  // its call gets that status; once a place is free, the next call opens a
  // new stream and works.
  grpc::ClientContext c1, c2;
  auto s1 = OpenStream(&c1);
  auto s2 = OpenStream(&c2);
  for (Stream* s : {s1.get(), s2.get()}) {
    v1::SequenceCallBatch batch;
    *batch.add_calls() = GetCall(1, "x");
    ASSERT_TRUE(s->Write(batch));
    ReadReplies(s, 1);
  }
  client::SequenceCallStream calls(stub_.get(), "");
  v1::SequenceCall get;
  get.mutable_get()->set_tenant_id("acme");
  get.mutable_get()->set_sequence_id("x");
  v1::SequenceReply reply;
  const auto later = [] {
    return std::chrono::system_clock::now() + std::chrono::seconds(10);
  };
  grpc::Status s = calls.Call(get, later(), &reply);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("max_call_streams = 2"));
  s1->WritesDone();
  EXPECT_TRUE(s1->Finish().ok());
  // The place comes back once the manager is done with s1.
  for (int attempt = 0; attempt < 250; ++attempt) {
    s = calls.Call(get, later(), &reply);
    if (s.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  EXPECT_GE(calls.streams_opened(), 2u);  // a new stream after each end
  s2->WritesDone();
  EXPECT_TRUE(s2->Finish().ok());
}

}  // namespace
}  // namespace triax::manager
