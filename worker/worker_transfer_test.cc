// ImportSequence / ExportPages over loopback gRPC between two in-process
// workers (each a WorkerService over its own core, store and pool): the
// happy path with re-encoding, idempotency, errors of the source named as
// such, bad request fields, ALREADY_EXISTS, an unreachable source,
// follow_writes, batching and the corruption hook.
#include <thread>

#include "absl/synchronization/notification.h"
#include "worker/checksum.h"
#include "worker/transfer_test_node.h"
#include "worker/worker_service_test_util.h"

namespace triax::worker {
namespace {

using kernels::Format;

constexpr uint32_t kTokens = 40;

class TransferServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    a_ = std::make_unique<Node>();
    b_ = std::make_unique<Node>();
    k_ = Random(size_t{kTokens} * 64, 1);
    v_ = Random(size_t{kTokens} * 64, 2);
  }
  // "s" on A: 40 int4 tokens, every layer written.
  void WriteSource(Node* node, uint32_t written = kTokens) {
    grpc::ClientContext ctx;
    v1::AllocatePagesResponse resp;
    ASSERT_TRUE(
        node->stub->AllocatePages(&ctx, AllocRequest("s", kTokens), &resp)
            .ok());
    for (uint32_t l = 0; l < 2 && written > 0; ++l) {
      ASSERT_TRUE(node->Write("s", F32Chunk(l, 0, written, k_, v_)).ok());
    }
  }
  v1::ImportSequenceRequest ImportRequestFor(
      const Node& source, v1::Format format = v1::FORMAT_INT4) {
    return ImportRequestFrom(source.address, kTokens, format);
  }
  grpc::Status Import(const v1::ImportSequenceRequest& r,
                      v1::ImportSequenceResponse* resp = nullptr) {
    grpc::ClientContext ctx;
    v1::ImportSequenceResponse local;
    return b_->stub->ImportSequence(&ctx, r, resp ? resp : &local);
  }
  // B holds no sequence and no page.
  void ExpectEmpty(const Node& node) {
    const InventorySnapshot inv = node.store->Inventory();
    EXPECT_THAT(inv.sequence_ids, ::testing::IsEmpty());
    EXPECT_EQ(inv.used_bytes, 0u);
  }
  void ExpectSameReads(const std::string& a_seq, const std::string& b_seq) {
    for (uint32_t l = 0; l < 2; ++l) {
      auto ra = a_->store->Read(kTenant, a_seq, l, 0, 0);
      auto rb = b_->store->Read(kTenant, b_seq, l, 0, 0);
      ASSERT_TRUE(ra.ok()) << ra.status();
      ASSERT_TRUE(rb.ok()) << rb.status();
      EXPECT_EQ(ra->num_tokens, rb->num_tokens);
      EXPECT_EQ(ra->k, rb->k);
      EXPECT_EQ(ra->v, rb->v);
    }
  }

  std::unique_ptr<Node> a_, b_;
  std::vector<float> k_, v_;
};

// A prefix hit: B holds "p" with the same first two blocks (lineage ids
// and values); the import shares them and pulls only block 2 from A.
TEST_F(TransferServiceTest, APrefixHitPullsOnlyTheOtherBlocks) {
  WriteSource(a_.get());
  {
    grpc::ClientContext ctx;
    v1::AllocatePagesResponse resp;
    ASSERT_TRUE(
        b_->stub->AllocatePages(&ctx, AllocRequest("p", kTokens), &resp).ok());
    for (uint32_t l = 0; l < 2; ++l) {
      ASSERT_TRUE(b_->Write("p", F32Chunk(l, 0, kTokens, k_, v_)).ok());
    }
  }
  const uint64_t used_before = b_->store->Inventory().used_bytes;
  v1::ImportSequenceRequest r = ImportRequestFor(*a_);
  r.set_prefix_sequence_id("p");
  r.set_prefix_blocks(3);  // block 2 of "p" is partial
  grpc::Status bad = Import(r);
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(bad.error_message(),
              ::testing::HasSubstr("block 2 (lineage_id=1002) holds 8 of 16"));
  r.set_prefix_blocks(2);
  r.mutable_blocks(1)->set_lineage_id(77);
  bad = Import(r);
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(bad.error_message(),
              ::testing::HasSubstr("block 1 mismatches: the plan's "
                                   "lineage_id=77"));
  EXPECT_EQ(b_->store->Inventory().used_bytes, used_before);
  r.mutable_blocks(1)->set_lineage_id(1001);
  v1::ImportSequenceResponse resp;
  const grpc::Status ok = Import(r, &resp);
  ASSERT_TRUE(ok.ok()) << ok.error_message();
  const kernels::PageShape shape = PageShapeOf(FromProto(Model()), 16);
  // Only block 2 (in the window: BF16 pages) travelled, on both layers.
  EXPECT_EQ(resp.pages(), 2u);
  EXPECT_EQ(resp.wire_bytes(), 2 * kernels::PageBytes(Format::kBF16, shape));
  EXPECT_EQ(resp.data_path(), "stream");
  ExpectSameReads("s", "s");
  // Every block shared and none pulled: no call to the source at all.
  v1::ImportSequenceRequest all = ImportRequestFrom("127.0.0.1:1", 32);
  all.set_request_id("imp-2");
  all.set_sequence_id("s2");
  all.set_prefix_sequence_id("p");
  all.set_prefix_blocks(2);
  ASSERT_TRUE(Import(all, &resp).ok());
  EXPECT_EQ(resp.pages(), 0u);
  EXPECT_EQ(resp.data_path(), "none");
  auto r2 = b_->store->Read(kTenant, "s2", 0, 0, 0);
  ASSERT_TRUE(r2.ok()) << r2.status();
  EXPECT_EQ(r2->num_tokens, 32u);
}

TEST_F(TransferServiceTest, ImportsASequenceFromTheSource) {
  WriteSource(a_.get());
  v1::ImportSequenceResponse resp;
  ASSERT_TRUE(Import(ImportRequestFor(*a_), &resp).ok());
  const kernels::PageShape shape = PageShapeOf(FromProto(Model()), 16);
  const size_t int4 = kernels::PageBytes(Format::kINT4, shape);
  const size_t bf16 = kernels::PageBytes(Format::kBF16, shape);
  // 3 blocks x 2 layers; window 4: blocks 0 and 1 sealed, block 2 (8 of 16
  // tokens) in the window.
  EXPECT_EQ(resp.pages(), 6u);
  EXPECT_EQ(resp.wire_bytes(), 2 * (2 * int4 + bf16));
  EXPECT_EQ(resp.bf16_bytes(), 6 * bf16);
  EXPECT_EQ(resp.page_bytes(), 2 * (3 * int4 + bf16));
  EXPECT_GT(resp.seconds(), 0.0);
  ASSERT_EQ(resp.layer_done_seconds_size(), 2);
  EXPECT_GT(resp.layer_done_seconds(0), 0.0);
  EXPECT_LE(resp.layer_done_seconds(0), resp.layer_done_seconds(1));
  ExpectSameReads("s", "s");
  // The source keeps its copy (it frees on the manager's word).
  EXPECT_THAT(a_->store->Inventory().sequence_ids, ::testing::ElementsAre("s"));

  // A repeat of the finished import answers its reply.
  v1::ImportSequenceResponse again;
  ASSERT_TRUE(Import(ImportRequestFor(*a_), &again).ok());
  EXPECT_EQ(again.SerializeAsString(), resp.SerializeAsString());
  // Another request id: the sequence is here now.
  v1::ImportSequenceRequest other = ImportRequestFor(*a_);
  other.set_request_id("imp-2");
  EXPECT_CODE(Import(other), grpc::StatusCode::ALREADY_EXISTS, "sequence_id");
}

TEST_F(TransferServiceTest, EncodesOnTheWayIntoTheDestinationsFormats) {
  WriteSource(a_.get());
  v1::ImportSequenceRequest r = ImportRequestFor(*a_, v1::FORMAT_INT2);
  v1::ImportSequenceResponse resp;
  ASSERT_TRUE(Import(r, &resp).ok());
  // Sealed blocks travel as INT2: fewer bytes than INT4 and BF16.
  const kernels::PageShape shape = PageShapeOf(FromProto(Model()), 16);
  const size_t int2 = kernels::PageBytes(Format::kINT2, shape);
  const size_t bf16 = kernels::PageBytes(Format::kBF16, shape);
  EXPECT_EQ(resp.wire_bytes(), 2 * (2 * int2 + bf16));
  auto d = b_->store->Describe("s");
  ASSERT_TRUE(d.ok());
  for (const BlockSpec& b : d->blocks) EXPECT_EQ(b.encoding.k, Format::kINT2);
  // What a Demote to INT2 on the source gives, read for read.
  v1::DemoteRequest demote;
  demote.set_tenant_id(kTenant);
  demote.set_sequence_id("s");
  *demote.mutable_blocks() = r.blocks();
  grpc::ClientContext ctx;
  v1::DemoteResponse dr;
  ASSERT_TRUE(a_->stub->Demote(&ctx, demote, &dr).ok());
  ExpectSameReads("s", "s");
}

TEST_F(TransferServiceTest, SourceErrorsKeepTheirCodeAndNameTheSource) {
  v1::ImportSequenceResponse resp;
  // The source does not have the sequence.
  grpc::Status s = Import(ImportRequestFor(*a_), &resp);
  EXPECT_CODE(s, grpc::StatusCode::NOT_FOUND,
              "source worker-a at " + a_->address + ": ");
  EXPECT_THAT(s.error_message(), HasSubstr("sequence_id=\"s\""));
  ExpectEmpty(*b_);
  // Written only partly, without follow_writes.
  WriteSource(a_.get(), 20);
  EXPECT_CODE(Import(ImportRequestFor(*a_)),
              grpc::StatusCode::FAILED_PRECONDITION, "written tokens");
  ExpectEmpty(*b_);
  // Lineage mismatch.
  v1::ImportSequenceRequest r = ImportRequestFor(*a_);
  r.mutable_blocks(1)->set_lineage_id(77);
  EXPECT_CODE(Import(r), grpc::StatusCode::FAILED_PRECONDITION,
              "lineage_id=77");
  ExpectEmpty(*b_);
}

TEST_F(TransferServiceTest, BadRequestFieldsAreNamed) {
  WriteSource(a_.get());
  struct Case {
    std::function<void(v1::ImportSequenceRequest*)> mutate;
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](auto* r) { r->set_source_address(""); }, "source_address"},
      {[](auto* r) { r->set_timeout_ms(4000000000u); }, "timeout_ms"},
      {[](auto* r) { r->set_request_id("bad id"); }, "request_id"},
      {[](auto* r) { r->set_tenant_id(""); }, "tenant_id"},
      {[](auto* r) { r->set_sequence_id("a b"); }, "sequence_id"},
      {[](auto* r) { r->mutable_model()->set_head_dim(0); }, "head_dim"},
      {[](auto* r) { r->set_block_tokens(0); }, "block_tokens"},
      {[](auto* r) { r->clear_blocks(); }, "blocks"},
      {[](auto* r) { r->mutable_blocks(1)->set_first_token(3); },
       "blocks[1].first_token=3"},
      {[](auto* r) { r->mutable_blocks(0)->set_format(v1::Format(42)); },
       "blocks[0].format"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.field);
    v1::ImportSequenceRequest r = ImportRequestFor(*a_);
    c.mutate(&r);
    EXPECT_CODE(Import(r), grpc::StatusCode::INVALID_ARGUMENT, c.field);
    ExpectEmpty(*b_);
  }
}

TEST_F(TransferServiceTest, AnUnreachableSourceFailsFast) {
  // A port nothing listens on: a server started and stopped.
  std::string dead;
  {
    Node gone;
    dead = gone.address;
  }
  v1::ImportSequenceRequest r = ImportRequestFor(*a_);
  r.set_source_address(dead);
  r.set_timeout_ms(8000);
  const absl::Time start = absl::Now();
  EXPECT_CODE(Import(r), grpc::StatusCode::UNAVAILABLE,
              "source worker-a at " + dead);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  ExpectEmpty(*b_);
}

TEST_F(TransferServiceTest, FollowWritesFinishesAfterTheWrites) {
  grpc::ClientContext actx;
  v1::AllocatePagesResponse aresp;
  ASSERT_TRUE(
      a_->stub->AllocatePages(&actx, AllocRequest("s", kTokens), &aresp).ok());
  v1::ImportSequenceRequest r = ImportRequestFor(*a_);
  r.set_follow_writes(true);
  grpc::Status status;
  v1::ImportSequenceResponse resp;
  absl::Notification done;
  std::thread importer([&] {
    status = Import(r, &resp);
    done.Notify();
  });
  // Layer 0, then layer 1, while the import waits.
  ASSERT_TRUE(a_->Write("s", F32Chunk(0, 0, 24, k_, v_)).ok());
  ASSERT_TRUE(a_->Write("s", F32Chunk(0, 24, 16, k_, v_)).ok());
  EXPECT_FALSE(done.HasBeenNotified());
  ASSERT_TRUE(a_->Write("s", F32Chunk(1, 0, kTokens, k_, v_)).ok());
  done.WaitForNotification();
  importer.join();
  ASSERT_TRUE(status.ok()) << status.error_message();
  ExpectSameReads("s", "s");
  // Nothing written at all: the import ends DEADLINE_EXCEEDED at its
  // timeout, and B holds nothing.
  grpc::ClientContext a2;
  ASSERT_TRUE(
      a_->stub->AllocatePages(&a2, AllocRequest("u", kTokens), &aresp).ok());
  r.set_request_id("imp-u");
  r.set_sequence_id("u");
  r.set_timeout_ms(300);
  const absl::Time start = absl::Now();
  EXPECT_CODE(Import(r), grpc::StatusCode::DEADLINE_EXCEEDED,
              "source worker-a at " + a_->address);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(300));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_THAT(b_->store->Inventory().sequence_ids, ::testing::ElementsAre("s"));
}

TEST_F(TransferServiceTest, ExportPagesBatchesAndChecksumsEveryPage) {
  WriteSource(a_.get());
  v1::ExportPagesRequest r;
  r.set_tenant_id(kTenant);
  r.set_sequence_id("s");
  const v1::AllocatePagesRequest plan = AllocRequest("s", kTokens);
  *r.mutable_blocks() = plan.blocks();
  r.set_max_batch_bytes(3000);  // an int4 page is 1152 bytes, bf16 4096
  grpc::ClientContext ctx;
  auto reader = a_->stub->ExportPages(&ctx, r);
  v1::PageBatch batch;
  std::vector<std::pair<uint32_t, uint32_t>> order;  // (layer, block)
  int batches = 0;
  while (reader->Read(&batch)) {
    ++batches;
    size_t bytes = 0;
    for (const v1::PagePayload& p : batch.pages()) {
      bytes += p.data().size();
      EXPECT_EQ(p.crc32c(), Crc32c(p.data().data(), p.data().size()));
      order.emplace_back(p.layer(), p.block_index());
    }
    EXPECT_TRUE(bytes <= 3000 || batch.pages_size() == 1) << bytes;
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(order, (std::vector<std::pair<uint32_t, uint32_t>>{
                       {0, 0}, {0, 1}, {0, 2}, {1, 0}, {1, 1}, {1, 2}}));
  EXPECT_EQ(batches, 4);  // per layer: two int4 pages, then the bf16 one
}

TEST_F(TransferServiceTest, ACancelledExportStopsPromptly) {
  grpc::ClientContext actx;
  v1::AllocatePagesResponse aresp;
  ASSERT_TRUE(
      a_->stub->AllocatePages(&actx, AllocRequest("s", kTokens), &aresp).ok());
  ASSERT_TRUE(a_->Write("s", F32Chunk(0, 0, kTokens, k_, v_)).ok());
  const uint64_t used = a_->store->Inventory().used_bytes;
  v1::ExportPagesRequest r;
  r.set_tenant_id(kTenant);
  r.set_sequence_id("s");
  *r.mutable_blocks() = AllocRequest("s", kTokens).blocks();
  r.set_follow_writes(true);  // layer 1 is never written: the export waits
  grpc::ClientContext ctx;
  auto reader = a_->stub->ExportPages(&ctx, r);
  v1::PageBatch batch;
  int pages = 0;
  while (pages < 3 && reader->Read(&batch)) pages += batch.pages_size();
  ASSERT_EQ(pages, 3);  // layer 0
  const absl::Time start = absl::Now();
  ctx.TryCancel();
  while (reader->Read(&batch)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // The handler sees the cancellation at its next wake (<= 100 ms) and
  // returns: a server shutdown waiting for in-flight calls ends at once.
  a_->server->Shutdown(std::chrono::system_clock::now() +
                       std::chrono::seconds(10));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_EQ(a_->store->Inventory().used_bytes, used);
}

TEST(TransferHookTest, CorruptedPagesAreDataLossAndNothingIsInstalled) {
  WorkerServiceOptions o;
  o.testing_corrupt_export_pages = 4;
  Node a(o), b;
  std::vector<float> k = Random(size_t{kTokens} * 64, 1),
                     v = Random(size_t{kTokens} * 64, 2);
  grpc::ClientContext ctx;
  v1::AllocatePagesResponse resp;
  ASSERT_TRUE(
      a.stub->AllocatePages(&ctx, AllocRequest("s", kTokens), &resp).ok());
  for (uint32_t l = 0; l < 2; ++l) {
    ASSERT_TRUE(a.Write("s", F32Chunk(l, 0, kTokens, k, v)).ok());
  }
  const v1::AllocatePagesRequest plan = AllocRequest("s", kTokens);
  v1::ImportSequenceRequest r;
  r.set_tenant_id(kTenant);
  r.set_sequence_id("s");
  *r.mutable_model() = plan.model();
  r.set_block_tokens(16);
  r.set_window_tokens(4);
  *r.mutable_blocks() = plan.blocks();
  r.set_source_address(a.address);
  grpc::ClientContext ictx;
  v1::ImportSequenceResponse iresp;
  const grpc::Status s = b.stub->ImportSequence(&ictx, r, &iresp);
  // The 4th page: layer 1, block 0 (lineage 1000).
  EXPECT_CODE(
      s, grpc::StatusCode::DATA_LOSS,
      "block 0 (lineage_id=1000) layer 1 from source worker at " + a.address);
  EXPECT_THAT(s.error_message(), HasSubstr("sequence_id=\"s\""));
  EXPECT_THAT(b.store->Inventory().sequence_ids, ::testing::IsEmpty());
  EXPECT_EQ(b.store->Inventory().used_bytes, 0u);
}

}  // namespace
}  // namespace triax::worker
