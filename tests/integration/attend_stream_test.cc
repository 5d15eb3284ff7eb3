// Worker.AttendStream against real kvmanager and kvworker processes: its
// answers equal unary Attend's byte for byte (both wires, appends
// included), items fail one by one with Attend's statuses, what fails a
// whole Attend ends the stream naming the message, and a client that
// cancels mid-stream ends it while the worker serves on.
#include "client/attend_stream.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "client/kv_client.h"
#include "common/grpc_status.h"
#include "common/status_matchers.h"
#include "tests/integration/cluster.h"
#include "tests/integration/reference.h"

namespace triax::testing {
namespace {

namespace v1 = triax::v1;
using absl::StatusCode;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using triax::v1::ROLE_SYSTEM;
using triax::v1::ROLE_USER;

constexpr uint32_t kWritten = 30;  // tokens written of kPlanned
constexpr uint32_t kPlanned = 48;

std::chrono::system_clock::time_point In(int seconds) {
  return std::chrono::system_clock::now() + std::chrono::seconds(seconds);
}

bool SameBytes(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class AttendStreamTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto c = Cluster::Start(ClusterOptions{});
    ASSERT_THAT(c, IsOk());
    cluster_ = c->release();
    ASSERT_THAT(cluster_->CreateTenant("acme"), IsOk());
    auto a = cluster_->NewClient("acme");
    ASSERT_THAT(a, IsOk());
    acme_ = a->release();
  }
  static void TearDownTestSuite() {
    delete acme_;
    delete cluster_;
  }
  void SetUp() override {
    if (cluster_ == nullptr || acme_ == nullptr) GTEST_SKIP() << "no cluster";
  }

  size_t KvElems() const {
    return size_t{model_.n_kv_heads()} * model_.head_dim();
  }
  size_t QElems() const {
    return size_t{model_.n_q_heads()} * model_.head_dim();
  }

  // A sequence planned for `planned` tokens in `policy`, kWritten of them
  // written on every layer with K/V from `seed` (twins: the same seed).
  client::SequenceHandle OpenWritten(const std::string& policy, uint32_t seed,
                                     uint32_t planned = kPlanned) {
    auto h = acme_->Open(
        model_, {MakeSpan(ROLE_SYSTEM, 16), MakeSpan(ROLE_USER, planned - 16)},
        policy, 16);
    EXPECT_THAT(h, IsOk());
    if (!h.ok()) return {};
    std::mt19937 rng(seed);
    for (uint32_t l = 0; l < model_.n_layers(); ++l) {
      auto k = RandomVector(kWritten * KvElems(), &rng);
      auto v = RandomVector(kWritten * KvElems(), &rng);
      EXPECT_THAT(acme_->WriteKV(*h, l, 0, kWritten, k.data(), v.data()),
                  IsOk());
    }
    return *h;
  }

  std::unique_ptr<v1::Worker::Stub> Stub(const client::SequenceHandle& h) {
    return v1::Worker::NewStub(grpc::CreateChannel(
        h.worker_address, grpc::InsecureChannelCredentials()));
  }

  // A read-only item over all written tokens of `layer`, queries from rng.
  v1::AttendItem Item(const client::SequenceHandle& h, uint32_t layer,
                      std::mt19937* rng) {
    v1::AttendItem item;
    item.set_sequence_id(h.sequence_id);
    item.set_layer(layer);
    item.set_num_queries(1);
    const std::vector<float> q = RandomVector(QElems(), rng);
    item.set_queries(q.data(), q.size() * sizeof(float));
    return item;
  }

  // Tokens written on `layer` (ReadKV to the end).
  uint64_t WrittenTokens(const client::SequenceHandle& h, uint32_t layer) {
    std::vector<float> k, v;
    EXPECT_THAT(acme_->ReadKV(h, layer, 0, 0, &k, &v), IsOk());
    return k.size() / KvElems();
  }

  static Cluster* cluster_;
  static client::Client* acme_;
  v1::ModelShape model_ = SmallModel();
};

Cluster* AttendStreamTest::cluster_ = nullptr;
client::Client* AttendStreamTest::acme_ = nullptr;

// Twin sequences (the same plan and K/V) take the same steps, one twin
// through unary Attends (Client::AttendBatch), the other on one stream:
// every output equals its twin's bit for bit, on both wires, with appends
// and without.
TEST_F(AttendStreamTest, AnswersEqualUnaryAttendsByteForByte) {
  const std::vector<std::string> policies = {"bf16", "int4", "triaxial-static"};
  std::vector<client::SequenceHandle> unary, streamed;
  for (size_t i = 0; i < policies.size(); ++i) {
    unary.push_back(OpenWritten(policies[i], 100 + i));
    streamed.push_back(OpenWritten(policies[i], 100 + i));
  }
  std::vector<const client::SequenceHandle*> streamed_ptrs;
  streamed_ptrs.reserve(streamed.size());
  for (const auto& h : streamed) streamed_ptrs.push_back(&h);
  std::mt19937 rng(7);
  uint64_t written = kWritten;
  for (client::AttendWire wire :
       {client::AttendWire::kF32, client::AttendWire::kBF16}) {
    client::AttendStreamOptions o;
    o.wire = wire;
    auto stream = client::AttendStream::Open(acme_, streamed[0].worker_address,
                                             streamed_ptrs, o);
    ASSERT_THAT(stream, IsOk());
    for (int step = 0; step < 3; ++step) {
      const bool append = step != 1;  // a read-only step between two
      for (uint32_t layer = 0; layer < model_.n_layers(); ++layer) {
        const size_t n = policies.size();
        std::vector<float> q = RandomVector(n * QElems(), &rng);
        std::vector<float> k = RandomVector(n * KvElems(), &rng);
        std::vector<float> v = RandomVector(n * KvElems(), &rng);
        std::vector<float> out_unary(q.size(), -1.f), out_stream(q.size());
        std::vector<client::Client::BatchItem> a(n), b(n);
        for (size_t i = 0; i < n; ++i) {
          for (auto* items : {&a, &b}) {
            client::Client::AttendArgs& args = (*items)[i].args;
            args.layer = layer;
            args.q = q.data() + i * QElems();
            if (append) {
              args.append_k = k.data() + i * KvElems();
              args.append_v = v.data() + i * KvElems();
              args.append_first = written;
              args.append_tokens = 1;
            }
          }
          a[i].seq = &unary[i];
          a[i].args.out = out_unary.data() + i * QElems();
          b[i].seq = &streamed[i];
          b[i].args.out = out_stream.data() + i * QElems();
        }
        auto ra = acme_->AttendBatch(a, wire);
        auto rb = (*stream)->Attend(b);
        ASSERT_THAT(ra, IsOk());
        ASSERT_THAT(rb, IsOk());
        for (size_t i = 0; i < n; ++i) {
          EXPECT_THAT((*ra)[i], IsOk());
          EXPECT_THAT((*rb)[i], IsOk());
        }
        EXPECT_TRUE(SameBytes(out_unary, out_stream))
            << "wire " << static_cast<int>(wire) << " step " << step
            << " layer " << layer;
      }
      if (append) ++written;
    }
    EXPECT_EQ((*stream)->messages(), 3 * model_.n_layers());
    EXPECT_THAT((*stream)->Finish(), IsOk());
  }
  for (size_t i = 0; i < policies.size(); ++i) {
    EXPECT_EQ(WrittenTokens(streamed[i], 0), written);
    EXPECT_EQ(WrittenTokens(unary[i], 1), written);
  }
}

// BF16 on the wire: queries rounded to BF16 give, on the F32 wire, an
// output whose BF16 rounding is exactly the BF16 wire's output.
TEST_F(AttendStreamTest, Bf16WireIsTheF32AnswerRounded) {
  const client::SequenceHandle h = OpenWritten("int4", 5);
  std::mt19937 rng(9);
  const std::vector<float> q = RoundToBf16(RandomVector(QElems(), &rng));
  std::vector<float> f32(q.size()), bf16(q.size());
  std::vector<client::Client::BatchItem> items(1);
  items[0].seq = &h;
  items[0].args.layer = 1;
  items[0].args.q = q.data();
  items[0].args.out = f32.data();
  auto r = acme_->AttendBatch(items, client::AttendWire::kF32);
  ASSERT_THAT(r, IsOk());
  ASSERT_THAT((*r)[0], IsOk());
  items[0].args.out = bf16.data();
  client::AttendStreamOptions o;
  o.wire = client::AttendWire::kBF16;
  auto stream = client::AttendStream::Open(acme_, h.worker_address, {&h}, o);
  ASSERT_THAT(stream, IsOk());
  r = (*stream)->Attend(items);
  ASSERT_THAT(r, IsOk());
  ASSERT_THAT((*r)[0], IsOk());
  EXPECT_TRUE(SameBytes(bf16, RoundToBf16(f32)));
  EXPECT_THAT((*stream)->Finish(), IsOk());
}

// A message whose items are bad in every way an item can be: each item's
// status is the one unary Attend gives for the same request, and the
// stream goes on to answer the next message.
TEST_F(AttendStreamTest, ItemErrorsAreUnaryAttendsAndTheStreamGoesOn) {
  const client::SequenceHandle h = OpenWritten("bf16", 11);
  auto stub = Stub(h);
  std::mt19937 rng(3);
  v1::AttendRequest good;
  good.set_tenant_id("acme");
  *good.add_items() = Item(h, 0, &rng);
  v1::AttendRequest bad;
  bad.set_tenant_id("acme");
  *bad.add_items() = Item(h, 1, &rng);  // fine
  v1::AttendItem* unknown = bad.add_items();
  *unknown = Item(h, 0, &rng);
  unknown->set_sequence_id("nope");
  v1::AttendItem* layer = bad.add_items();
  *layer = Item(h, 0, &rng);
  layer->set_layer(99);
  v1::AttendItem* short_q = bad.add_items();
  *short_q = Item(h, 0, &rng);
  short_q->set_queries("abc");
  v1::AttendItem* dtype = bad.add_items();
  *dtype = Item(h, 0, &rng);
  dtype->set_dtype(static_cast<v1::KvDtype>(7));
  v1::AttendItem* bf16_size = bad.add_items();
  *bf16_size = Item(h, 0, &rng);  // float32 bytes, BF16 said
  bf16_size->set_dtype(v1::KV_DTYPE_BF16);
  v1::AttendItem* position = bad.add_items();
  *position = Item(h, 0, &rng);
  position->add_positions(kWritten);
  v1::AttendItem* append = bad.add_items();
  *append = Item(h, 0, &rng);
  append->mutable_append()->set_layer(1);

  v1::AttendResponse unary;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10));
    ASSERT_TRUE(stub->Attend(&ctx, bad, &unary).ok());
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(In(10));
  auto stream = stub->AttendStream(&ctx);
  v1::AttendResponse first, second, third;
  ASSERT_TRUE(stream->Write(good));
  ASSERT_TRUE(stream->Read(&first));
  ASSERT_TRUE(stream->Write(bad));
  ASSERT_TRUE(stream->Read(&second));
  ASSERT_TRUE(stream->Write(good));
  ASSERT_TRUE(stream->Read(&third));
  ASSERT_TRUE(stream->WritesDone());
  EXPECT_TRUE(stream->Finish().ok());

  EXPECT_EQ(second.SerializeAsString(), unary.SerializeAsString());
  ASSERT_EQ(second.results_size(), bad.items_size());
  auto code = [&](int i) {
    return static_cast<StatusCode>(second.results(i).status().code());
  };
  auto message = [&](int i) { return second.results(i).status().message(); };
  EXPECT_EQ(code(0), StatusCode::kOk);
  EXPECT_EQ(code(1), StatusCode::kNotFound);
  EXPECT_THAT(message(1), StartsWith("items[1]: "));
  EXPECT_EQ(code(2), StatusCode::kInvalidArgument);
  EXPECT_THAT(message(2), HasSubstr("layer=99"));
  EXPECT_EQ(code(3), StatusCode::kInvalidArgument);
  EXPECT_THAT(message(3), HasSubstr("queries has 3 bytes"));
  EXPECT_EQ(code(4), StatusCode::kInvalidArgument);
  EXPECT_THAT(message(4), HasSubstr("dtype=7 is not F32 (1) or BF16 (2)"));
  EXPECT_EQ(code(5), StatusCode::kInvalidArgument);
  EXPECT_THAT(message(5), HasSubstr("x 2 bytes bf16"));
  EXPECT_EQ(code(6), StatusCode::kOutOfRange);
  EXPECT_THAT(message(6), HasSubstr("positions[0]=30"));
  EXPECT_EQ(code(7), StatusCode::kInvalidArgument);
  EXPECT_THAT(message(7), HasSubstr("append.layer=1 differs from layer=0"));
  // The good messages before and after: answered, equal (read-only).
  EXPECT_EQ(first.SerializeAsString(), third.SerializeAsString());
  EXPECT_EQ(first.results(0).status().code(), 0);
}

// What fails a whole Attend ends the stream, with Attend's status and
// message behind "messages[<n>]: ".
TEST_F(AttendStreamTest, WholeMessageErrorsEndTheStreamNamingTheMessage) {
  const client::SequenceHandle h = OpenWritten("bf16", 13);
  auto stub = Stub(h);
  std::mt19937 rng(4);
  v1::AttendRequest good;
  good.set_tenant_id("acme");
  *good.add_items() = Item(h, 0, &rng);
  v1::AttendRequest bad_tenant = good;
  bad_tenant.set_tenant_id("no tenant!");
  v1::AttendResponse resp;
  grpc::Status unary;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10));
    unary = stub->Attend(&ctx, bad_tenant, &resp);
  }
  ASSERT_EQ(unary.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(unary.error_message(), HasSubstr("tenant_id"));
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10));
    auto stream = stub->AttendStream(&ctx);
    ASSERT_TRUE(stream->Write(good));
    ASSERT_TRUE(stream->Read(&resp));
    stream->Write(bad_tenant);
    EXPECT_FALSE(stream->Read(&resp));
    const grpc::Status s = stream->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(s.error_message(), "messages[1]: " + unary.error_message());
  }
  // A message protobuf cannot parse (a tenant_id that is not UTF-8; the
  // C++ stub only logs it): INVALID_ARGUMENT naming the field.
  {
    v1::AttendRequest not_utf8 = good;
    not_utf8.set_tenant_id("acme\xff");
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10));
    auto stream = stub->AttendStream(&ctx);
    ASSERT_TRUE(stream->Write(good));
    ASSERT_TRUE(stream->Read(&resp));
    stream->Write(not_utf8);
    EXPECT_FALSE(stream->Read(&resp));
    const grpc::Status s = stream->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(),
                HasSubstr("triax.v1.AttendRequest.tenant_id"));
  }
  // Through the client library: the stream is done, every later call says
  // so, and locally bad items send nothing.
  auto stream = client::AttendStream::Open(stub.get(), "no tenant!", {});
  ASSERT_THAT(stream, IsOk());
  std::vector<float> q(QElems(), 0.5f), out(QElems());
  std::vector<client::Client::BatchItem> items(1);
  items[0].seq = &h;
  items[0].args.q = q.data();
  items[0].args.out = out.data();
  std::vector<client::Client::BatchItem> null_seq(1);
  EXPECT_THAT((*stream)->Attend(null_seq),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("AttendStream: items[0]: seq is null")));
  EXPECT_THAT((*stream)->Attend(items),
              StatusIs(StatusCode::kInvalidArgument,
                       AllOf(StartsWith("AttendStream: messages[0]: "),
                             HasSubstr("tenant_id"))));
  EXPECT_THAT((*stream)->Attend(items), StatusIs(StatusCode::kInvalidArgument,
                                                 HasSubstr("messages[0]: ")));
  EXPECT_THAT((*stream)->Finish(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("tenant_id")));
}

// A client that cancels between messages: its next Attend returns
// CANCELLED, the stream stays ended, exactly the answered messages'
// appends are written, and the worker serves a new stream and unary
// Attends on the same sequence.
TEST_F(AttendStreamTest, ClientCancellingMidStreamEndsItAndTheWorkerServesOn) {
  const client::SequenceHandle h = OpenWritten("int4", 17);
  auto stream = client::AttendStream::Open(acme_, h.worker_address, {&h});
  ASSERT_THAT(stream, IsOk());
  std::mt19937 rng(5);
  const std::vector<float> q = RandomVector(QElems(), &rng);
  const std::vector<float> kv = RandomVector(KvElems(), &rng);
  std::vector<float> out(QElems());
  std::vector<client::Client::BatchItem> items(1);
  items[0].seq = &h;
  items[0].args.q = q.data();
  items[0].args.out = out.data();
  items[0].args.append_k = kv.data();
  items[0].args.append_v = kv.data();
  items[0].args.append_tokens = 1;
  for (uint64_t pos = kWritten; pos < kWritten + 2; ++pos) {
    items[0].args.append_first = pos;
    auto r = (*stream)->Attend(items);
    ASSERT_THAT(r, IsOk());
    EXPECT_THAT((*r)[0], IsOk());
  }
  (*stream)->Cancel();
  items[0].args.append_first = kWritten + 2;
  EXPECT_THAT((*stream)->Attend(items),
              StatusIs(StatusCode::kCancelled, HasSubstr("AttendStream")));
  EXPECT_THAT((*stream)->Attend(items),
              StatusIs(StatusCode::kCancelled, ::testing::_));
  EXPECT_THAT((*stream)->Finish(),
              StatusIs(StatusCode::kCancelled, ::testing::_));
  EXPECT_EQ(WrittenTokens(h, 0), kWritten + 2);
  auto again = client::AttendStream::Open(acme_, h.worker_address, {&h});
  ASSERT_THAT(again, IsOk());
  auto r = (*again)->Attend(items);
  ASSERT_THAT(r, IsOk());
  EXPECT_THAT((*r)[0], IsOk());
  EXPECT_EQ(WrittenTokens(h, 0), kWritten + 3);
  EXPECT_THAT((*again)->Finish(), IsOk());
}

// Cancelled from another thread while messages flow (appends while the
// plan has room, then reads): the loop's Attend returns CANCELLED, every
// answered append is written and at most the one in flight besides, and a
// unary Attend then reads the sequence. A stream dropped without Finish is
// cancelled by its destructor.
TEST_F(AttendStreamTest, CancelFromAnotherThreadWhileMessagesFlow) {
  constexpr uint32_t kRoom = 256;  // tokens the loop may append
  const client::SequenceHandle h = OpenWritten("bf16", 19, kWritten + kRoom);
  auto stream = client::AttendStream::Open(acme_, h.worker_address, {&h});
  ASSERT_THAT(stream, IsOk());
  std::mt19937 rng(6);
  const std::vector<float> q = RandomVector(QElems(), &rng);
  const std::vector<float> kv = RandomVector(KvElems(), &rng);
  std::atomic<uint64_t> appended{0};
  absl::Notification three;
  absl::Status ended;
  std::thread loop([&] {
    std::vector<float> out(QElems());
    std::vector<client::Client::BatchItem> items(1);
    items[0].seq = &h;
    items[0].args.q = q.data();
    items[0].args.out = out.data();
    for (uint64_t n = 0;; ++n) {
      const bool append = n < kRoom;
      items[0].args.append_k = append ? kv.data() : nullptr;
      items[0].args.append_v = append ? kv.data() : nullptr;
      items[0].args.append_first = kWritten + n;
      items[0].args.append_tokens = append ? 1 : 0;
      auto r = (*stream)->Attend(items);
      if (!r.ok()) {
        ended = r.status();
        break;
      }
      EXPECT_THAT((*r)[0], IsOk());
      if (append) ++appended;
      if (n == 2) three.Notify();
    }
    if (!three.HasBeenNotified()) three.Notify();
  });
  ASSERT_TRUE(three.WaitForNotificationWithTimeout(absl::Seconds(30)));
  (*stream)->Cancel();
  loop.join();
  EXPECT_THAT(ended,
              StatusIs(StatusCode::kCancelled, HasSubstr("AttendStream")));
  const uint64_t answered = appended;
  const uint64_t written = WrittenTokens(h, 0);
  EXPECT_GE(written, kWritten + answered);
  EXPECT_LE(written,
            std::min<uint64_t>(kWritten + answered + 1, kWritten + kRoom));
  std::vector<float> out(QElems());
  std::vector<client::Client::BatchItem> read(1);
  read[0].seq = &h;
  read[0].args.q = q.data();
  read[0].args.out = out.data();
  {
    auto dropped = client::AttendStream::Open(acme_, h.worker_address, {&h});
    ASSERT_THAT(dropped, IsOk());
    auto r = (*dropped)->Attend(read);
    ASSERT_THAT(r, IsOk());
    EXPECT_THAT((*r)[0], IsOk());
  }
  auto r = acme_->AttendBatch(read);
  ASSERT_THAT(r, IsOk());
  EXPECT_THAT((*r)[0], IsOk());
}

}  // namespace
}  // namespace triax::testing
