// Client behaviour that needs no server: option checks, local argument
// checks, error prefixes, and UNAVAILABLE from an unreachable manager.
#include "client/kv_client.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>

#include "common/status_matchers.h"

namespace triax::client {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using triax::testing::IsOk;
using triax::testing::StatusIs;

ClientOptions Unreachable() {
  ClientOptions o;
  o.manager_address = "127.0.0.1:1";  // nothing listens on port 1
  o.tenant_id = "acme";
  o.rpc_timeout_ms = 2000;
  return o;
}

SequenceHandle Handle() {
  SequenceHandle h;
  h.sequence_id = "s1";
  h.worker_address = "127.0.0.1:1";
  h.model.set_n_layers(1);
  h.model.set_n_kv_heads(2);
  h.model.set_n_q_heads(4);
  h.model.set_head_dim(8);
  h.block_tokens = 16;
  return h;
}

TEST(Connect, ValidatesOptions) {
  ClientOptions o = Unreachable();
  o.manager_address = "";
  EXPECT_THAT(Client::Connect(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("manager_address")));
  o = Unreachable();
  o.tenant_id = "bad tenant";
  EXPECT_THAT(Client::Connect(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("tenant_id")));
  o = Unreachable();
  o.rpc_timeout_ms = 0;
  EXPECT_THAT(Client::Connect(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("rpc_timeout_ms=0")));
  EXPECT_THAT(Client::Connect(Unreachable()), IsOk());
}

TEST(Client, RequestIdsAreUniqueAndValid) {
  auto a = Client::Connect(Unreachable());
  auto b = Client::Connect(Unreachable());
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  std::set<std::string> ids;
  for (int i = 0; i < 100; ++i) {
    ids.insert((*a)->NewRequestId());
    ids.insert((*b)->NewRequestId());
  }
  EXPECT_EQ(ids.size(), 200u);
  for (const auto& id : ids) {
    EXPECT_LE(id.size(), 128u);
    EXPECT_EQ(id.find_first_not_of("abcdefABCDEF0123456789c-"),
              std::string::npos)
        << id;
  }
}

TEST(Client, UnreachableManagerIsUnavailableAndNamesTheCall) {
  auto c = Client::Connect(Unreachable());
  ASSERT_THAT(c, IsOk());
  triax::v1::Span span;
  span.set_role(triax::v1::ROLE_USER);
  span.set_num_tokens(4);
  EXPECT_THAT(
      (*c)->Open(Handle().model, {span}),
      StatusIs(absl::StatusCode::kUnavailable, StartsWith("OpenSequence: ")));
  EXPECT_THAT((*c)->GetSequence("s1"), StatusIs(absl::StatusCode::kUnavailable,
                                                StartsWith("GetSequence: ")));
  // Close tells the manager even though the worker is unreachable.
  EXPECT_THAT((*c)->Close(Handle()), StatusIs(absl::StatusCode::kUnavailable,
                                              StartsWith("CloseSequence: ")));
}

TEST(Client, LocalArgumentChecks) {
  auto c = Client::Connect(Unreachable());
  ASSERT_THAT(c, IsOk());
  const SequenceHandle h = Handle();
  std::vector<float> buf(1024);
  EXPECT_THAT(
      (*c)->WriteKV(h, 0, 0, 0, buf.data(), buf.data()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_tokens=0")));
  EXPECT_THAT(
      (*c)->WriteKV(h, 0, 0, 1, nullptr, buf.data()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("non-null")));
  SequenceHandle no_shape = h;
  no_shape.model.set_head_dim(0);
  EXPECT_THAT(
      (*c)->WriteKV(no_shape, 0, 0, 1, buf.data(), buf.data()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("head_dim=0")));
  Client::AttendArgs a;
  a.q = buf.data();
  a.out = buf.data();
  a.num_queries = 0;
  EXPECT_THAT((*c)->Attend(h, a), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("num_queries=0")));
  a.num_queries = 1;
  a.append_k = buf.data();
  EXPECT_THAT((*c)->Attend(h, a), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("append")));
  SequenceHandle no_worker = h;
  no_worker.worker_address = "";
  std::vector<float> k, v;
  EXPECT_THAT(
      (*c)->ReadKV(no_worker, 0, 0, 1, &k, &v),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("worker")));
  EXPECT_THAT((*c)->Extend(nullptr, {}, false, false),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("seq")));
}

TEST(Client, WorkerStubsAreCached) {
  auto c = Client::Connect(Unreachable());
  ASSERT_THAT(c, IsOk());
  auto a = (*c)->worker("127.0.0.1:5");
  auto b = (*c)->worker("127.0.0.1:5");
  auto d = (*c)->worker("127.0.0.1:6");
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  ASSERT_THAT(d, IsOk());
  EXPECT_EQ(*a, *b);
  EXPECT_NE(*a, *d);
}

}  // namespace
}  // namespace triax::client

namespace triax::client {
namespace {

TEST(PlanEncoding, VDefaultsToKAndKeepsGroupAndScale) {
  triax::v1::BlockPlan b;
  b.set_format(triax::v1::FORMAT_INT4);
  kernels::Encoding e = PlanEncoding(b);
  EXPECT_EQ(e.k, kernels::Format::kINT4);
  EXPECT_EQ(e.v, kernels::Format::kINT4);
  EXPECT_EQ(e.scale_dtype, kernels::ScaleDtype::kFP16);
  EXPECT_EQ(EncodingLabel(e), "int4");

  b.set_format_v(triax::v1::FORMAT_INT2);
  b.set_group_size(64);
  b.set_scale_dtype(triax::v1::SCALE_DTYPE_FP8_E4M3);
  e = PlanEncoding(b);
  EXPECT_EQ(e.k, kernels::Format::kINT4);
  EXPECT_EQ(e.v, kernels::Format::kINT2);
  EXPECT_EQ(e.group, 64);
  EXPECT_EQ(e.scale_dtype, kernels::ScaleDtype::kFP8);
  EXPECT_EQ(EncodingLabel(e), "k=int4,v=int2,g=64,scale=fp8");
}

}  // namespace
}  // namespace triax::client
