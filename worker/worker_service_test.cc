// WorkerService RPCs end to end over gRPC: AllocatePages, WriteKV, ReadKV,
// Attend (single and batched), Demote, Fork, FreePages; bad input on each,
// idempotency by request id, device errors.

#include "worker/worker_service.h"

#include "worker/worker_service_test_util.h"

namespace triax::worker {
namespace {

TEST_F(ServiceTest, AllocatePagesRejectsBadInputWithoutStateChange) {
  ASSERT_TRUE(Allocate(AllocRequest("s", 20)).ok());
  const std::string before = Inventory();

  auto r = AllocRequest("t", 20);
  r.set_tenant_id("");
  EXPECT_CODE(Allocate(r), grpc::StatusCode::INVALID_ARGUMENT, "tenant_id");
  r = AllocRequest("t", 20);
  r.set_sequence_id("bad id");
  EXPECT_CODE(Allocate(r), grpc::StatusCode::INVALID_ARGUMENT, "sequence_id");
  r = AllocRequest("t", 20, v1::FORMAT_INT4, "bad request id");
  EXPECT_CODE(Allocate(r), grpc::StatusCode::INVALID_ARGUMENT, "request_id");
  r = AllocRequest("t", 20);
  r.mutable_model()->set_n_layers(0);
  EXPECT_CODE(Allocate(r), grpc::StatusCode::INVALID_ARGUMENT,
              "model.n_layers=0");
  r = AllocRequest("t", 20);
  r.mutable_model()->set_head_dim(0);
  EXPECT_CODE(Allocate(r), grpc::StatusCode::INVALID_ARGUMENT,
              "model.head_dim=0");
  r = AllocRequest("t", 20);
  r.set_block_tokens(0);
  EXPECT_CODE(Allocate(r), grpc::StatusCode::INVALID_ARGUMENT,
              "block_tokens=0");
  r = AllocRequest("t", 20);
  r.mutable_blocks(1)->set_num_tokens(0);
  EXPECT_CODE(Allocate(r), grpc::StatusCode::INVALID_ARGUMENT,
              "blocks[1].num_tokens=0");
  r = AllocRequest("t", 20, v1::FORMAT_UNSPECIFIED);
  EXPECT_CODE(Allocate(r), grpc::StatusCode::INVALID_ARGUMENT,
              "blocks[0].format=0");
  r = AllocRequest("t", 20);
  r.mutable_blocks(1)->set_first_token(15);
  EXPECT_CODE(Allocate(r), grpc::StatusCode::INVALID_ARGUMENT,
              "blocks[1].first_token=15");
  // The 4 MiB arena cannot hold 12800 bf16 tokens x 2 layers (6.25 MiB).
  r = AllocRequest("t", 12800, v1::FORMAT_BF16);
  EXPECT_CODE(Allocate(r), grpc::StatusCode::RESOURCE_EXHAUSTED, "bytes free");
  // Existing sequence: other tenant, other lineage.
  r = AllocRequest("s", 20);
  r.set_tenant_id("tenant-b");
  EXPECT_CODE(Allocate(r), grpc::StatusCode::PERMISSION_DENIED, "tenant_id");
  r = AllocRequest("s", 20);
  r.mutable_blocks(0)->set_lineage_id(7);
  EXPECT_CODE(Allocate(r), grpc::StatusCode::FAILED_PRECONDITION,
              "lineage_id=7");
  EXPECT_EQ(Inventory(), before);
}

TEST_F(ServiceTest, AllocatePagesIsIdempotentByRequestId) {
  v1::AllocatePagesResponse first, second, third;
  ASSERT_TRUE(
      Allocate(AllocRequest("s", 20, v1::FORMAT_INT4, "req-1"), &first).ok());
  EXPECT_EQ(first.pages_allocated(), 4u);  // 2 blocks x 2 layers
  EXPECT_GT(first.bytes_allocated(), 0u);
  const std::string after_first = Inventory();
  ASSERT_TRUE(
      Allocate(AllocRequest("s", 20, v1::FORMAT_INT4, "req-1"), &second).ok());
  EXPECT_EQ(second.SerializeAsString(), first.SerializeAsString());
  EXPECT_EQ(Inventory(), after_first);
  // Same id with another plan: refused, nothing applied.
  EXPECT_CODE(Allocate(AllocRequest("s", 40, v1::FORMAT_INT4, "req-1"), &third),
              grpc::StatusCode::FAILED_PRECONDITION,
              "request_id=\"req-1\" was used for a different AllocatePages "
              "request");
  EXPECT_EQ(Inventory(), after_first);
}

// New encodings travel through the proto: format_v, group_size, scale_dtype;
// window_tokens per sequence; Demote with idempotency and error mapping.
TEST_F(ServiceTest, EncodingsWindowTokensAndDemote) {
  auto r = AllocRequest("s", 32, v1::FORMAT_TQ3);
  r.mutable_blocks(1)->set_format(v1::FORMAT_INT4);
  r.mutable_blocks(1)->set_format_v(v1::FORMAT_INT2);
  r.mutable_blocks(1)->set_group_size(64);
  r.mutable_blocks(1)->set_scale_dtype(v1::SCALE_DTYPE_FP8_E4M3);
  r.set_window_tokens(0);
  ASSERT_TRUE(Allocate(r).ok());
  // A different window for the installed sequence is refused.
  auto again = AllocRequest("s", 32, v1::FORMAT_TQ3);
  again.set_window_tokens(4);
  EXPECT_CODE(Allocate(again), grpc::StatusCode::FAILED_PRECONDITION,
              "window_tokens=4");
  // TQ on head_dim 48 is not valid.
  auto tq = AllocRequest("t", 16, v1::FORMAT_TQ2);
  tq.mutable_model()->set_head_dim(48);
  EXPECT_CODE(Allocate(tq), grpc::StatusCode::INVALID_ARGUMENT,
              "blocks[0]: encoding tq2");

  const std::vector<float> k = Random(size_t{32} * 64, 3),
                           v = Random(size_t{32} * 64, 4);
  for (uint32_t l = 0; l < 2; ++l) {
    ASSERT_TRUE(Write({WriteMsg("s", F32Chunk(l, 0, 32, k, v))}).ok());
  }
  // window_tokens 0: both blocks sealed; the inventory reports by K format.
  {
    grpc::ClientContext ctx;
    v1::Inventory inv;
    ASSERT_TRUE(stub_->GetInventory(&ctx, {}, &inv).ok());
    EXPECT_EQ(inv.window_bytes(), 0u);
    ASSERT_EQ(inv.formats_size(), 2);
    EXPECT_EQ(inv.formats(0).format(), v1::FORMAT_INT4);
    EXPECT_EQ(inv.formats(1).format(), v1::FORMAT_TQ3);
    EXPECT_EQ(inv.formats(1).pages_used(), 2u);
  }

  auto demote = [&](const v1::DemoteRequest& req, v1::DemoteResponse* resp) {
    grpc::ClientContext ctx;
    return stub_->Demote(&ctx, req, resp);
  };
  v1::DemoteRequest d;
  d.set_request_id("dem-1");
  d.set_tenant_id(kTenant);
  d.set_sequence_id("s");
  v1::BlockPlan* b = d.add_blocks();
  b->set_index(0);
  b->set_lineage_id(1000);
  b->set_format(v1::FORMAT_TQ2);
  const std::string before = Inventory();
  v1::DemoteResponse first, second;
  ASSERT_TRUE(demote(d, &first).ok());
  EXPECT_EQ(first.pages_reencoded(), 2u);
  EXPECT_LT(first.bytes_delta(), 0);
  const std::string after = Inventory();
  EXPECT_NE(after, before);
  // The same request again: the first reply, nothing applied.
  ASSERT_TRUE(demote(d, &second).ok());
  EXPECT_EQ(second.SerializeAsString(), first.SerializeAsString());
  EXPECT_EQ(Inventory(), after);
  // Same request id naming another encoding: refused, nothing applied.
  d.mutable_blocks(0)->set_format(v1::FORMAT_BF16);
  v1::DemoteResponse third;
  EXPECT_CODE(demote(d, &third), grpc::StatusCode::FAILED_PRECONDITION,
              "was used for a different Demote request");
  EXPECT_EQ(Inventory(), after);
  d.mutable_blocks(0)->set_format(v1::FORMAT_TQ2);

  // Errors map to canonical codes and change nothing.
  d.set_request_id("dem-2");
  d.mutable_blocks(0)->set_lineage_id(77);
  v1::DemoteResponse unused;
  EXPECT_CODE(demote(d, &unused), grpc::StatusCode::FAILED_PRECONDITION,
              "lineage_id=77");
  d.mutable_blocks(0)->set_lineage_id(1000);
  d.mutable_blocks(0)->set_index(5);
  EXPECT_CODE(demote(d, &unused), grpc::StatusCode::NOT_FOUND,
              "blocks[0].index=5");
  d.mutable_blocks(0)->set_index(0);
  d.set_tenant_id("tenant-b");
  EXPECT_CODE(demote(d, &unused), grpc::StatusCode::PERMISSION_DENIED,
              "tenant_id");
  d.set_tenant_id(kTenant);
  d.set_sequence_id("nope");
  EXPECT_CODE(demote(d, &unused), grpc::StatusCode::NOT_FOUND,
              "sequence_id=\"nope\"");
  d.set_sequence_id("s");
  d.mutable_blocks(0)->set_group_size(7);
  EXPECT_CODE(demote(d, &unused), grpc::StatusCode::INVALID_ARGUMENT,
              "blocks[0].group_size=7");
  d.set_request_id("bad id");
  EXPECT_CODE(demote(d, &unused), grpc::StatusCode::INVALID_ARGUMENT,
              "request_id");
  EXPECT_EQ(Inventory(), after);

  // Attention still runs over the demoted pages.
  v1::AttendRequest ar;
  ar.set_tenant_id(kTenant);
  v1::AttendItem* item = ar.add_items();
  item->set_sequence_id("s");
  item->set_layer(1);
  item->set_num_queries(1);
  const std::vector<float> q = Random(size_t{4} * 32, 9);
  item->set_queries(F32Bytes(q.data(), q.size()));
  grpc::ClientContext ctx;
  v1::AttendResponse resp;
  ASSERT_TRUE(stub_->Attend(&ctx, ar, &resp).ok());
  ASSERT_EQ(resp.results_size(), 1);
  EXPECT_EQ(resp.results(0).status().code(), 0)
      << resp.results(0).status().message();
  EXPECT_EQ(resp.results(0).output().size(), q.size() * 4);
}

TEST_F(ServiceTest, WriteKVRejectsBadInputWithoutStateChange) {
  std::vector<float> k, v;
  MakeWritten(5, &k, &v);
  const std::string before = Inventory();
  std::vector<v1::KvChunk> read_before;
  v1::ReadKVRequest rr;
  rr.set_tenant_id(kTenant);
  rr.set_sequence_id("s");
  rr.set_dtype(v1::KV_DTYPE_F32);
  ASSERT_TRUE(Read(rr, &read_before).ok());

  EXPECT_CODE(Write({WriteMsg("nope", F32Chunk(0, 5, 2, k, v))}),
              grpc::StatusCode::NOT_FOUND, "sequence_id=\"nope\"");
  EXPECT_CODE(Write({WriteMsg("s", F32Chunk(0, 5, 2, k, v), "", "tenant-b")}),
              grpc::StatusCode::PERMISSION_DENIED, "tenant_id=\"tenant-b\"");
  EXPECT_CODE(Write({WriteMsg("s", F32Chunk(0, 7, 2, k, v))}),
              grpc::StatusCode::FAILED_PRECONDITION, "first_token=7");
  EXPECT_CODE(Write({WriteMsg("s", F32Chunk(0, 5, 36, k, v))}),
              grpc::StatusCode::OUT_OF_RANGE, "planned total of 40");
  auto c = F32Chunk(0, 5, 2, k, v);
  c.set_layer(2);
  EXPECT_CODE(Write({WriteMsg("s", c)}), grpc::StatusCode::INVALID_ARGUMENT,
              "layer=2");
  c = F32Chunk(0, 5, 2, k, v);
  c.mutable_v()->pop_back();
  EXPECT_CODE(Write({WriteMsg("s", c)}), grpc::StatusCode::INVALID_ARGUMENT,
              "v has 511 bytes");
  c = F32Chunk(0, 5, 2, k, v);
  c.set_num_tokens(0);
  EXPECT_CODE(Write({WriteMsg("s", c)}), grpc::StatusCode::INVALID_ARGUMENT,
              "num_tokens=0");
  c = F32Chunk(0, 5, 2, k, v);
  c.set_dtype(v1::KV_DTYPE_UNSPECIFIED);
  EXPECT_CODE(Write({WriteMsg("s", c)}), grpc::StatusCode::INVALID_ARGUMENT,
              "dtype=0");
  c = F32Chunk(0, 5, 2, k, v);
  c.set_dtype(v1::KV_DTYPE_BF16);  // f32-sized bytes for bf16
  EXPECT_CODE(Write({WriteMsg("s", c)}), grpc::StatusCode::INVALID_ARGUMENT,
              "k has 512 bytes; expected 256");
  v1::WriteKVRequest empty;
  empty.set_tenant_id(kTenant);
  empty.set_sequence_id("s");
  EXPECT_CODE(Write({empty}), grpc::StatusCode::INVALID_ARGUMENT,
              "chunk is missing");

  EXPECT_EQ(Inventory(), before);
  std::vector<v1::KvChunk> read_after;
  ASSERT_TRUE(Read(rr, &read_after).ok());
  ASSERT_EQ(read_after.size(), 1u);
  EXPECT_EQ(read_after[0].SerializeAsString(),
            read_before[0].SerializeAsString());
}

TEST_F(ServiceTest, WriteKVIsIdempotentPerStream) {
  ASSERT_TRUE(Allocate(AllocRequest("s", 40)).ok());
  auto k = Random(size_t{40} * 64, 3), v = Random(size_t{40} * 64, 4);
  std::vector<v1::WriteKVRequest> msgs = {
      WriteMsg("s", F32Chunk(0, 0, 10, k, v), "w-1"),
      WriteMsg("s", F32Chunk(0, 10, 10, k, v))};
  v1::WriteKVResponse first, second;
  ASSERT_TRUE(Write(msgs, &first).ok());
  EXPECT_EQ(first.tokens_written(), 20u);
  EXPECT_EQ(first.bytes_received(), 2u * 20 * 64 * 4);
  // A retry of the same stream is not applied again (it would otherwise be
  // an out-of-order write).
  ASSERT_TRUE(Write(msgs, &second).ok());
  EXPECT_EQ(second.SerializeAsString(), first.SerializeAsString());
  auto d = store_->Describe("s");
  EXPECT_EQ(d->written[0], 20u);
  // The id reused for the next tokens: refused, nothing written.
  std::vector<v1::WriteKVRequest> next = {
      WriteMsg("s", F32Chunk(0, 20, 10, k, v), "w-1")};
  v1::WriteKVResponse third;
  EXPECT_CODE(Write(next, &third), grpc::StatusCode::FAILED_PRECONDITION,
              "request_id=\"w-1\" was used for a different WriteKV request");
  EXPECT_EQ(store_->Describe("s")->written[0], 20u);
}

TEST_F(ServiceTest, StreamedWriteAttendReadRoundTrip) {
  // 300 bf16 tokens: ReadKV must split into chunks of <= 256 tokens.
  auto req = AllocRequest("s", 300, v1::FORMAT_BF16);
  ASSERT_TRUE(Allocate(req).ok());
  auto k = Random(size_t{300} * 64, 5), v = Random(size_t{300} * 64, 6);
  std::vector<v1::WriteKVRequest> msgs;
  for (uint32_t l = 0; l < 2; ++l) {
    for (uint32_t t = 0; t < 299; t += 23) {
      msgs.push_back(
          WriteMsg("s", F32Chunk(l, t, std::min(23u, 299 - t), k, v)));
    }
  }
  v1::WriteKVResponse wr;
  ASSERT_TRUE(Write(msgs, &wr).ok());
  EXPECT_EQ(wr.tokens_written(), 2u * 299);

  // Decode step for layer 1: append token 299 and attend in one RPC, plus a
  // second item on layer 0 at position 100 and a bad third item.
  const size_t per_q = size_t{4} * 32;
  auto q = Random(2 * per_q, 7);
  v1::AttendRequest ar;
  ar.set_tenant_id(kTenant);
  v1::AttendItem* a = ar.add_items();
  a->set_sequence_id("s");
  a->set_layer(1);
  a->set_num_queries(1);
  a->set_queries(F32Bytes(q.data(), per_q));
  *a->mutable_append() = F32Chunk(1, 299, 1, k, v);
  v1::AttendItem* b = ar.add_items();
  b->set_sequence_id("s");
  b->set_layer(0);
  b->set_num_queries(2);
  b->add_positions(100);
  b->add_positions(0);
  b->set_queries(F32Bytes(q.data(), 2 * per_q));
  b->set_scale(0.5f);
  v1::AttendItem* bad = ar.add_items();
  bad->set_sequence_id("s");
  bad->set_layer(0);
  bad->set_num_queries(1);
  bad->set_queries("abc");
  v1::AttendResponse resp;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->Attend(&ctx, ar, &resp).ok());
  }
  ASSERT_EQ(resp.results_size(), 3);
  ASSERT_EQ(resp.results(0).status().code(), 0)
      << resp.results(0).status().message();
  ASSERT_EQ(resp.results(1).status().code(), 0)
      << resp.results(1).status().message();
  EXPECT_EQ(resp.results(2).status().code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(resp.results(2).status().message(),
              HasSubstr("items[2]: queries has 3 bytes"));
  ASSERT_EQ(resp.results(0).output().size(), per_q * 4);
  ASSERT_EQ(resp.results(1).output().size(), 2 * per_q * 4);
  // Query at position 0 attends to token 0 only: output = V[0] per KV head.
  std::vector<float> out(2 * per_q);
  std::memcpy(out.data(), resp.results(1).output().data(), out.size() * 4);
  for (uint32_t h = 0; h < 4; ++h) {
    for (uint32_t d = 0; d < 32; ++d) {
      const float want =
          kernels::Bf16ToFloat(kernels::FloatToBf16(v[(h / 2) * 32 + d]));
      EXPECT_NEAR(out[per_q + static_cast<size_t>(h) * 32 + d], want, 1e-6);
    }
  }
  // And the layer-1 item equals the store's own answer after the append.
  std::vector<float> out0(per_q);
  std::memcpy(out0.data(), resp.results(0).output().data(), per_q * 4);
  double norm = 0;
  for (float x : out0) norm += x * x;
  EXPECT_GT(norm, 0.0);
  EXPECT_EQ(store_->Describe("s")->written[1], 300u);

  // Read back all 300 tokens of layer 1 as BF16: chunks of 256 + 44.
  v1::ReadKVRequest rr;
  rr.set_tenant_id(kTenant);
  rr.set_sequence_id("s");
  rr.set_layer(1);
  rr.set_dtype(v1::KV_DTYPE_BF16);
  std::vector<v1::KvChunk> chunks;
  ASSERT_TRUE(Read(rr, &chunks).ok());
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[0].num_tokens(), 256u);
  EXPECT_EQ(chunks[1].first_token(), 256u);
  EXPECT_EQ(chunks[1].num_tokens(), 44u);
  for (const auto& c : chunks) {
    ASSERT_EQ(c.k().size(), c.num_tokens() * 64 * 2u);
    for (size_t i = 0; i < size_t{c.num_tokens()} * 64; ++i) {
      uint16_t kb, vb;
      std::memcpy(&kb, c.k().data() + 2 * i, 2);
      std::memcpy(&vb, c.v().data() + 2 * i, 2);
      const size_t at = c.first_token() * 64 + i;
      ASSERT_EQ(kb, kernels::FloatToBf16(k[at])) << at;
      ASSERT_EQ(vb, kernels::FloatToBf16(v[at])) << at;
    }
  }
  // F32 of a sub-range.
  rr.set_dtype(v1::KV_DTYPE_F32);
  rr.set_first_token(10);
  rr.set_num_tokens(5);
  chunks.clear();
  ASSERT_TRUE(Read(rr, &chunks).ok());
  ASSERT_EQ(chunks.size(), 1u);
  ASSERT_EQ(chunks[0].k().size(), 5 * 64 * 4u);
  float first;
  std::memcpy(&first, chunks[0].k().data(), 4);
  EXPECT_EQ(first,
            kernels::Bf16ToFloat(kernels::FloatToBf16(k[size_t{10} * 64])));
}

TEST_F(ServiceTest, ReadKVRejectsBadInput) {
  std::vector<float> k, v;
  MakeWritten(5, &k, &v);
  auto base = [] {
    v1::ReadKVRequest r;
    r.set_tenant_id(kTenant);
    r.set_sequence_id("s");
    r.set_dtype(v1::KV_DTYPE_F32);
    return r;
  };
  std::vector<v1::KvChunk> out;
  auto r = base();
  r.set_dtype(v1::KV_DTYPE_UNSPECIFIED);
  EXPECT_CODE(Read(r, &out), grpc::StatusCode::INVALID_ARGUMENT, "dtype=0");
  r = base();
  r.set_sequence_id("nope");
  EXPECT_CODE(Read(r, &out), grpc::StatusCode::NOT_FOUND, "sequence_id");
  r = base();
  r.set_tenant_id("tenant-b");
  EXPECT_CODE(Read(r, &out), grpc::StatusCode::PERMISSION_DENIED, "tenant_id");
  r = base();
  r.set_layer(5);
  EXPECT_CODE(Read(r, &out), grpc::StatusCode::INVALID_ARGUMENT, "layer=5");
  r = base();
  r.set_first_token(3);
  r.set_num_tokens(3);
  EXPECT_CODE(Read(r, &out), grpc::StatusCode::OUT_OF_RANGE,
              "first_token=3 num_tokens=3");
  EXPECT_TRUE(out.empty());
}

TEST_F(ServiceTest, AttendReportsPerItemErrorsWithoutStateChange) {
  std::vector<float> k, v;
  MakeWritten(5, &k, &v);
  const std::string before = Inventory();
  const size_t per_q = size_t{4} * 32;
  auto q = Random(per_q, 9);
  auto item = [&](v1::AttendRequest* r) {
    v1::AttendItem* i = r->add_items();
    i->set_sequence_id("s");
    i->set_num_queries(1);
    i->set_queries(F32Bytes(q.data(), per_q));
    return i;
  };
  v1::AttendRequest r;
  r.set_tenant_id(kTenant);
  item(&r)->set_sequence_id("nope");
  item(&r)->set_layer(2);
  item(&r)->add_positions(5);
  item(&r)->set_num_queries(0);
  item(&r)->set_queries(std::string(per_q * 4 - 4, '\0'));
  *item(&r)->mutable_append() = F32Chunk(0, 6, 1, k, v);  // out of order
  auto* zero = item(&r);
  *zero->mutable_append() = F32Chunk(0, 5, 1, k, v);
  zero->mutable_append()->set_num_tokens(0);
  item(&r);  // a good one
  v1::AttendResponse resp;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->Attend(&ctx, r, &resp).ok());
  }
  ASSERT_EQ(resp.results_size(), 8);
  const std::vector<std::pair<grpc::StatusCode, std::string>> want = {
      {grpc::StatusCode::NOT_FOUND, "items[0]: sequence_id=\"nope\""},
      {grpc::StatusCode::INVALID_ARGUMENT, "items[1]: layer=2"},
      {grpc::StatusCode::OUT_OF_RANGE, "items[2]: positions[0]=5"},
      {grpc::StatusCode::INVALID_ARGUMENT, "items[3]: num_queries=0"},
      {grpc::StatusCode::INVALID_ARGUMENT, "items[4]: queries has 508 bytes"},
      {grpc::StatusCode::FAILED_PRECONDITION, "items[5]: append.first_token=6"},
      {grpc::StatusCode::INVALID_ARGUMENT, "items[6]: append.num_tokens=0"},
  };
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(resp.results(i).status().code(), want[i].first) << i;
    EXPECT_THAT(resp.results(i).status().message(), HasSubstr(want[i].second));
    EXPECT_TRUE(resp.results(i).output().empty());
  }
  EXPECT_EQ(resp.results(7).status().code(), 0);
  EXPECT_EQ(Inventory(), before);
  EXPECT_EQ(store_->Describe("s")->written[0], 5u);
  // Other tenant and a malformed tenant id.
  r.set_tenant_id("tenant-b");
  resp.Clear();
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->Attend(&ctx, r, &resp).ok());
  }
  EXPECT_EQ(resp.results(7).status().code(),
            grpc::StatusCode::PERMISSION_DENIED);
  r.set_tenant_id("");
  {
    grpc::ClientContext ctx;
    EXPECT_CODE(stub_->Attend(&ctx, r, &resp),
                grpc::StatusCode::INVALID_ARGUMENT, "tenant_id");
  }
}

// Given three sequences (INT4, BF16, INT2) twice over with the same data,
// when one Attend request carries a decode-step batch of items (a bad one,
// the same sequence twice, appends) for the first copy and the same items go
// one request each to the second copy, then every item's status and output
// bytes agree, and the batch ran as few device batches as its appends allow.
TEST_F(ServiceTest, BatchedAttendMatchesItemByItem) {
  const v1::Format formats[3] = {v1::FORMAT_INT4, v1::FORMAT_BF16,
                                 v1::FORMAT_INT2};
  const uint32_t written[3] = {30, 20, 10};
  std::vector<std::vector<float>> k(3), v(3);
  for (int s = 0; s < 3; ++s) {
    k[s] = Random(size_t{40} * 64, 100 + s);
    v[s] = Random(size_t{40} * 64, 200 + s);
    for (const char* copy : {"a", "b"}) {
      const std::string id = absl::StrCat(copy, "-", s);
      ASSERT_TRUE(Allocate(AllocRequest(id, 40, formats[s])).ok());
      for (uint32_t l = 0; l < 2; ++l) {
        ASSERT_TRUE(
            Write({WriteMsg(id, F32Chunk(l, 0, written[s], k[s], v[s]))}).ok());
      }
    }
  }
  const size_t per_q = size_t{4} * 32;
  const std::vector<float> q = Random(size_t{8} * 2 * per_q, 7);
  struct Item {
    std::string seq;  // suffix after "<copy>-", or a missing id
    uint32_t layer;
    std::vector<uint64_t> positions;
    int append_at;  // token appended first, -1: none
  };
  const std::vector<Item> plan = {
      {"0", 0, {3, 29}, -1}, {"1", 1, {}, 20}, {"nope", 0, {}, -1},
      {"2", 0, {}, -1},      {"0", 0, {}, -1}, {"1", 1, {}, 21},
      {"1", 5, {}, -1},      {"2", 0, {}, 10},
  };
  auto add = [&](v1::AttendRequest* r, const std::string& copy, size_t i) {
    const Item& it = plan[i];
    v1::AttendItem* item = r->add_items();
    item->set_sequence_id(it.seq == "nope" ? "nope"
                                           : absl::StrCat(copy, "-", it.seq));
    item->set_layer(it.layer);
    const uint32_t nq = it.positions.empty() ? 1 : it.positions.size();
    item->set_num_queries(nq);
    for (uint64_t p : it.positions) item->add_positions(p);
    item->set_queries(F32Bytes(q.data() + i * 2 * per_q, nq * per_q));
    if (it.append_at >= 0) {
      const int s = it.seq[0] - '0';
      *item->mutable_append() = F32Chunk(it.layer, it.append_at, 1, k[s], v[s]);
    }
  };
  v1::AttendRequest batch;
  batch.set_tenant_id(kTenant);
  for (size_t i = 0; i < plan.size(); ++i) add(&batch, "a", i);
  v1::AttendResponse batched;
  device_.ClearRecord();
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->Attend(&ctx, batch, &batched).ok());
  }
  // Items 0, 1, 3, 4 (5 queries) run together; item 5 appends to "a-1",
  // which item 1 reads, so they run first; items 5 and 7 make the second.
  EXPECT_THAT(device_.attention_batches(), ::testing::ElementsAre(5, 2));
  ASSERT_EQ(batched.results_size(), static_cast<int>(plan.size()));
  for (size_t i = 0; i < plan.size(); ++i) {
    v1::AttendRequest one;
    one.set_tenant_id(kTenant);
    add(&one, "b", i);
    v1::AttendResponse alone;
    {
      grpc::ClientContext ctx;
      ASSERT_TRUE(stub_->Attend(&ctx, one, &alone).ok());
    }
    const v1::AttendResult& got = batched.results(i);
    const v1::AttendResult& want = alone.results(0);
    EXPECT_EQ(got.status().code(), want.status().code())
        << i << ": " << got.status().message();
    EXPECT_EQ(got.output(), want.output()) << "item " << i;
    if (want.status().code() != 0) {
      EXPECT_THAT(got.status().message(),
                  HasSubstr(absl::StrCat("items[", i, "]")));
    } else {
      const uint32_t nq =
          plan[i].positions.empty() ? 1 : plan[i].positions.size();
      EXPECT_EQ(got.output().size(), nq * per_q * 4) << i;
    }
  }
  EXPECT_EQ(batched.results(2).status().code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(batched.results(6).status().code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  // Both copies took the same appends.
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(store_->Describe(absl::StrCat("a-", s))->written,
              store_->Describe(absl::StrCat("b-", s))->written);
  }
  EXPECT_EQ(store_->Describe("a-1")->written[1], 22u);
  EXPECT_EQ(store_->Describe("a-2")->written[0], 11u);

  // Without repeats a request is exactly one device batch; the outputs
  // differ per sequence (not one result copied around).
  v1::AttendRequest step;
  step.set_tenant_id(kTenant);
  for (size_t i : {0, 1, 3}) add(&step, "a", i);
  for (v1::AttendItem& it : *step.mutable_items()) it.clear_append();
  device_.ClearRecord();
  v1::AttendResponse stepped;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->Attend(&ctx, step, &stepped).ok());
  }
  EXPECT_THAT(device_.attention_batches(), ::testing::ElementsAre(4));
  for (const v1::AttendResult& r : stepped.results()) {
    EXPECT_EQ(r.status().code(), 0) << r.status().message();
  }
  EXPECT_NE(stepped.results(1).output(), stepped.results(2).output());
}

// A device that reports itself unhealthy (as a poisoned CUDA context does):
// the inventory carries its message, attention answers UNAVAILABLE for
// every item of the batch (Attend and AttendStream alike), and healing
// clears device_error.
TEST_F(ServiceTest, DeviceErrorReachesInventoryAndAttend) {
  std::vector<float> k, v;
  MakeWritten(5, &k, &v);
  {
    grpc::ClientContext ctx;
    v1::Inventory inv;
    ASSERT_TRUE(
        stub_->GetInventory(&ctx, v1::GetInventoryRequest(), &inv).ok());
    EXPECT_EQ(inv.device_error(), "");
  }
  device_.SetUnhealthy("cuda backend unhealthy (restart the worker) since: X");
  {
    grpc::ClientContext ctx;
    v1::Inventory inv;
    ASSERT_TRUE(
        stub_->GetInventory(&ctx, v1::GetInventoryRequest(), &inv).ok());
    EXPECT_EQ(inv.device_error(),
              "cuda backend unhealthy (restart the worker) since: X");
  }
  const std::vector<float> q = Random(size_t{4} * 32, 3);
  v1::AttendRequest r;
  r.set_tenant_id(kTenant);
  for (int i = 0; i < 2; ++i) {
    v1::AttendItem* item = r.add_items();
    item->set_sequence_id("s");
    item->set_layer(i);
    item->set_num_queries(1);
    item->set_queries(F32Bytes(q.data(), q.size()));
  }
  v1::AttendResponse resp;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->Attend(&ctx, r, &resp).ok());
  }
  ASSERT_EQ(resp.results_size(), 2);
  for (const v1::AttendResult& res : resp.results()) {
    EXPECT_EQ(res.status().code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_THAT(res.status().message(), HasSubstr("unhealthy"));
    EXPECT_TRUE(res.output().empty());
  }
  {
    // AttendStream answers the same message the same way, and goes on.
    grpc::ClientContext ctx;
    auto stream = stub_->AttendStream(&ctx);
    v1::AttendResponse streamed;
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE(stream->Write(r));
      ASSERT_TRUE(stream->Read(&streamed));
      EXPECT_EQ(streamed.SerializeAsString(), resp.SerializeAsString());
    }
    ASSERT_TRUE(stream->WritesDone());
    EXPECT_TRUE(stream->Finish().ok());
  }
  device_.SetUnhealthy("");
  v1::Inventory inv;
  ToProto(core_->Inventory(), &inv);
  EXPECT_EQ(inv.device_error(), "");
}

// The gRPC health service follows the device: the server ("") and
// triax.v1.Worker are SERVING while it is healthy, NOT_SERVING while it
// reports an error (as a poisoned CUDA context does), SERVING again once it
// heals; a service the worker does not serve is NOT_FOUND.
TEST_F(ServiceTest, ForkAndFreeRejectBadInputAndAreIdempotent) {
  std::vector<float> k, v;
  MakeWritten(20, &k, &v);
  const std::string before = Inventory();
  auto fork = [&] {
    v1::WorkerForkRequest f;
    f.set_tenant_id(kTenant);
    f.set_parent_sequence_id("s");
    f.set_child_sequence_id("c");
    f.set_num_tokens(20);
    auto plan = AllocRequest("c", 24);
    *f.mutable_blocks() = plan.blocks();
    f.mutable_blocks(1)->set_lineage_id(77);  // the partial block is copied
    return f;
  };
  auto f = fork();
  f.set_parent_sequence_id("nope");
  EXPECT_CODE(Fork(f), grpc::StatusCode::NOT_FOUND, "parent_sequence_id");
  f = fork();
  f.set_tenant_id("tenant-b");
  EXPECT_CODE(Fork(f), grpc::StatusCode::PERMISSION_DENIED, "tenant_id");
  f = fork();
  f.set_num_tokens(0);
  EXPECT_CODE(Fork(f), grpc::StatusCode::INVALID_ARGUMENT, "num_tokens=0");
  f = fork();
  f.set_child_sequence_id("s");
  EXPECT_CODE(Fork(f), grpc::StatusCode::INVALID_ARGUMENT, "child_sequence_id");
  f = fork();
  f.mutable_blocks(0)->set_format(v1::FORMAT_UNSPECIFIED);
  EXPECT_CODE(Fork(f), grpc::StatusCode::INVALID_ARGUMENT,
              "blocks[0].format=0");
  f = fork();
  f.mutable_blocks(0)->set_lineage_id(1001);  // the parent's block 1
  EXPECT_CODE(Fork(f), grpc::StatusCode::FAILED_PRECONDITION, "blocks[0]");
  EXPECT_EQ(Inventory(), before);

  f = fork();
  f.set_request_id("fork-1");
  v1::WorkerForkResponse fr1, fr2;
  ASSERT_TRUE(Fork(f, &fr1).ok());
  EXPECT_EQ(fr1.pages_shared(), 2u);
  EXPECT_EQ(fr1.pages_copied(), 2u);
  ASSERT_TRUE(Fork(f, &fr2).ok());  // replay, not ALREADY_EXISTS
  EXPECT_EQ(fr2.SerializeAsString(), fr1.SerializeAsString());
  f.set_request_id("fork-2");
  EXPECT_CODE(Fork(f), grpc::StatusCode::ALREADY_EXISTS, "child_sequence_id");

  const std::string with_child = Inventory();
  EXPECT_CODE(Free("nope"), grpc::StatusCode::NOT_FOUND, "sequence_id");
  EXPECT_CODE(Free("c", "", "tenant-b"), grpc::StatusCode::PERMISSION_DENIED,
              "tenant_id");
  EXPECT_CODE(Free("c", "bad id"), grpc::StatusCode::INVALID_ARGUMENT,
              "request_id");
  EXPECT_EQ(Inventory(), with_child);
  v1::FreePagesResponse a, b;
  ASSERT_TRUE(Free("c", "free-1", kTenant, &a).ok());
  // The copied block's target and window pages on both layers; the shared
  // block's pages live on in the parent.
  EXPECT_EQ(a.pages_freed(), 4u);
  ASSERT_TRUE(Free("c", "free-1", kTenant, &b).ok());
  EXPECT_EQ(b.SerializeAsString(), a.SerializeAsString());
  EXPECT_EQ(Inventory(), before);
  ASSERT_TRUE(Free("s").ok());
  grpc::ClientContext ctx;
  v1::Inventory inv;
  ASSERT_TRUE(stub_->GetInventory(&ctx, v1::GetInventoryRequest(), &inv).ok());
  EXPECT_EQ(inv.used_bytes(), 0u);
  EXPECT_EQ(inv.capacity_bytes(), 4u << 20);
  EXPECT_EQ(inv.sequence_ids_size(), 0);
}

// A manager that answers the first heartbeat NOT_FOUND and fails the first
// two registrations UNAVAILABLE.

}  // namespace
}  // namespace triax::worker
