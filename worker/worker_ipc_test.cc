// The ipc data path between two in-process workers over loopback gRPC
// (CPU devices with shared-memory arenas, mapped through /proc/<pid>/fd
// like two processes would): ImportSequence over SharePages with the pages
// copied arena to arena, the fallback to the stream, refusals of a source
// that cannot share, the corruption hook, hostile acknowledgements, and a
// destination that goes away mid-stream (the source unpins everything).
#include <thread>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "worker/convert.h"
#include "worker/transfer_test_node.h"
#include "worker/worker_service_test_util.h"

namespace triax::worker {
namespace {

using kernels::Format;

constexpr uint32_t kTokens = 40;

class IpcTransferTest : public ::testing::Test {
 protected:
  void SetUp() override {
    k_ = Random(size_t{kTokens} * 64, 1);
    v_ = Random(size_t{kTokens} * 64, 2);
  }
  void Start(WorkerServiceOptions a, bool a_shares, WorkerServiceOptions b,
             bool b_shares) {
    a_ = std::make_unique<Node>(a, a_shares);
    b_ = std::make_unique<Node>(b, b_shares);
  }
  void WriteSource(const std::string& seq = "s") {
    grpc::ClientContext ctx;
    v1::AllocatePagesResponse resp;
    ASSERT_TRUE(
        a_->stub->AllocatePages(&ctx, AllocRequest(seq, kTokens), &resp).ok());
    for (uint32_t l = 0; l < 2; ++l) {
      ASSERT_TRUE(a_->Write(seq, F32Chunk(l, 0, kTokens, k_, v_)).ok());
    }
  }
  v1::ImportSequenceRequest ImportRequestFor(
      v1::Format format = v1::FORMAT_INT4) {
    return ImportRequestFrom(a_->address, kTokens, format);
  }
  grpc::Status Import(const v1::ImportSequenceRequest& r,
                      v1::ImportSequenceResponse* resp = nullptr) {
    grpc::ClientContext ctx;
    v1::ImportSequenceResponse local;
    return b_->stub->ImportSequence(&ctx, r, resp ? resp : &local);
  }
  void ExpectSameReads() {
    for (uint32_t l = 0; l < 2; ++l) {
      auto ra = a_->store->Read(kTenant, "s", l, 0, 0);
      auto rb = b_->store->Read(kTenant, "s", l, 0, 0);
      ASSERT_TRUE(ra.ok()) << ra.status();
      ASSERT_TRUE(rb.ok()) << rb.status();
      EXPECT_EQ(ra->num_tokens, rb->num_tokens);
      EXPECT_EQ(ra->k, rb->k);
      EXPECT_EQ(ra->v, rb->v);
    }
  }
  // Waits (up to 5 s) until A's pool is back to `bytes` used.
  void ExpectSourceUsedBytes(uint64_t bytes) {
    const absl::Time until = absl::Now() + absl::Seconds(5);
    while (a_->store->Inventory().used_bytes != bytes && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_EQ(a_->store->Inventory().used_bytes, bytes);
  }
  // A SharePages export request for "s" wanting `format`.
  v1::SharePagesRequest ShareRequest(v1::Format format,
                                     uint32_t max_batch_bytes = 0) {
    v1::SharePagesRequest m;
    v1::ExportPagesRequest* r = m.mutable_request();
    r->set_tenant_id(kTenant);
    r->set_sequence_id("s");
    *r->mutable_blocks() = AllocRequest("s", kTokens, format).blocks();
    r->set_max_batch_bytes(max_batch_bytes);
    m.set_share_domain(a_->device.ShareDomain());
    return m;
  }

  std::unique_ptr<Node> a_, b_;
  std::vector<float> k_, v_;
};

TEST_F(IpcTransferTest, ImportsThroughTheSourcesArena) {
  Start(Path(TransferPath::kIpc), true, Path(TransferPath::kIpc), true);
  WriteSource();
  const uint64_t source_used = a_->store->Inventory().used_bytes;
  // INT2 on the way: the source re-encodes into pinned scratch pages.
  v1::ImportSequenceResponse resp;
  grpc::Status s = Import(ImportRequestFor(v1::FORMAT_INT2), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.data_path(), "ipc");
  EXPECT_GT(resp.copy_seconds(), 0.0);  // the device copies, timed
  const kernels::PageShape shape = PageShapeOf(FromProto(Model()), 16);
  const size_t int2 = kernels::PageBytes(Format::kINT2, shape);
  const size_t bf16 = kernels::PageBytes(Format::kBF16, shape);
  EXPECT_EQ(resp.pages(), 6u);
  EXPECT_EQ(resp.wire_bytes(), 2 * (2 * int2 + bf16));
  // The pages came arena to arena, none over the stream.
  size_t copied = 0;
  for (size_t n : b_->device.checked_copies()) copied += n;
  EXPECT_EQ(copied, 6u);
  // What a Demote to INT2 on the source gives.
  v1::DemoteRequest demote;
  demote.set_tenant_id(kTenant);
  demote.set_sequence_id("s");
  *demote.mutable_blocks() = ImportRequestFor(v1::FORMAT_INT2).blocks();
  {
    grpc::ClientContext ctx;
    v1::DemoteResponse dr;
    ExpectSourceUsedBytes(source_used);  // scratch pages unpinned
    ASSERT_TRUE(a_->stub->Demote(&ctx, demote, &dr).ok());
  }
  ExpectSameReads();
}

// The source's device could share, but it runs with transfer_path=stream.
TEST_F(IpcTransferTest, AutoStreamsFromASourceThatCannotShare) {
  Start(Path(TransferPath::kStream), true, Path(TransferPath::kAuto), true);
  WriteSource();
  v1::ImportSequenceResponse resp;
  grpc::Status s = Import(ImportRequestFor(), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.data_path(), "stream");
  EXPECT_EQ(resp.copy_seconds(), 0.0);
  EXPECT_TRUE(b_->device.checked_copies().empty());
  ExpectSameReads();
}

// A source whose backend does not share, and one that runs with
// transfer_path=stream: the strict ipc destination fails naming why.
TEST_F(IpcTransferTest, IpcRefusesASourceThatCannotShare) {
  struct Case {
    WorkerServiceOptions source;
    bool shares;
    std::string why;
  };
  const Case cases[] = {
      {Path(TransferPath::kAuto), false,
       "this worker's backend does not share its arena"},
      {Path(TransferPath::kStream), true,
       "this worker runs with --transfer_path=stream and does not share"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.why);
    Start(c.source, c.shares, Path(TransferPath::kIpc), true);
    WriteSource();
    EXPECT_CODE(Import(ImportRequestFor()),
                grpc::StatusCode::FAILED_PRECONDITION,
                "transfer_path=ipc: source worker-a at " + a_->address +
                    " cannot share its pages with this worker: " + c.why);
    EXPECT_EQ(b_->store->Inventory().used_bytes, 0u);
  }
}

TEST_F(IpcTransferTest, SharePagesRefusesAnotherDomainAndBadFirstMessages) {
  Start(Path(TransferPath::kIpc), true, Path(TransferPath::kIpc), true);
  WriteSource();
  {
    grpc::ClientContext ctx;
    auto stream = a_->stub->SharePages(&ctx);
    v1::SharePagesRequest m = ShareRequest(v1::FORMAT_INT4);
    m.set_share_domain("cpu:another-host");
    stream->Write(m);
    stream->WritesDone();
    v1::PageBatch batch;
    EXPECT_FALSE(stream->Read(&batch));
    EXPECT_CODE(stream->Finish(), grpc::StatusCode::UNIMPLEMENTED,
                "share_domain=\"cpu:another-host\"");
  }
  {
    grpc::ClientContext ctx;
    auto stream = a_->stub->SharePages(&ctx);
    v1::SharePagesRequest m;
    m.set_installed_batches(1);
    stream->Write(m);
    stream->WritesDone();
    v1::PageBatch batch;
    EXPECT_FALSE(stream->Read(&batch));
    EXPECT_CODE(stream->Finish(), grpc::StatusCode::INVALID_ARGUMENT,
                "first message has no request");
  }
}

TEST_F(IpcTransferTest, ACorruptedChecksumIsDataLossAndNothingStays) {
  Start(Path(TransferPath::kIpc, /*corrupt=*/4), true, Path(TransferPath::kIpc),
        true);
  WriteSource();
  const uint64_t source_used = a_->store->Inventory().used_bytes;
  EXPECT_CODE(Import(ImportRequestFor(v1::FORMAT_INT2)),
              grpc::StatusCode::DATA_LOSS, "CRC32C of the copied page");
  EXPECT_EQ(b_->store->Inventory().used_bytes, 0u);
  EXPECT_THAT(b_->store->Inventory().sequence_ids, ::testing::IsEmpty());
  ExpectSourceUsedBytes(source_used);
}

// Acknowledgements of batches never sent, or going backwards, end the call
// INVALID_ARGUMENT; the pins go with it.
TEST_F(IpcTransferTest, HostileAcknowledgementsAreRefused) {
  Start(Path(TransferPath::kIpc), true, Path(TransferPath::kIpc), true);
  WriteSource();
  const uint64_t source_used = a_->store->Inventory().used_bytes;
  for (uint64_t bad : {uint64_t{7}, uint64_t{0}}) {
    SCOPED_TRACE(bad);
    grpc::ClientContext ctx;
    auto stream = a_->stub->SharePages(&ctx);
    // One page a batch, INT2 (scratch pages): six batches, four ahead.
    stream->Write(ShareRequest(v1::FORMAT_INT2, 1));
    v1::PageBatch batch;
    ASSERT_TRUE(stream->Read(&batch));
    EXPECT_TRUE(batch.has_arena());
    // The page travels packed, as a reference into the source's arena.
    EXPECT_EQ(batch.pages_size(), 0);
    ASSERT_EQ(batch.refs().layer_size(), 1);
    EXPECT_GT(batch.refs().bytes(0), 0u);
    ASSERT_EQ(batch.encodings_size(), 1);
    EXPECT_EQ(batch.encodings(0).format(), v1::FORMAT_INT2);
    v1::SharePagesRequest ack;
    if (bad == 0) {  // forward to 2, then back to 0
      ASSERT_TRUE(stream->Read(&batch));
      ack.set_installed_batches(2);
      stream->Write(ack);
    }
    ack.set_installed_batches(bad);
    stream->Write(ack);
    while (stream->Read(&batch)) {
    }
    EXPECT_CODE(stream->Finish(), grpc::StatusCode::INVALID_ARGUMENT,
                "installed_batches=" + std::to_string(bad));
    ExpectSourceUsedBytes(source_used);
  }
}

// A destination that reads one batch and goes away: the export stops and
// every pinned scratch page goes back to the source's pool.
TEST_F(IpcTransferTest, ADestinationThatGoesAwayReleasesThePins) {
  Start(Path(TransferPath::kIpc), true, Path(TransferPath::kIpc), true);
  WriteSource();
  const uint64_t source_used = a_->store->Inventory().used_bytes;
  grpc::ClientContext ctx;
  auto stream = a_->stub->SharePages(&ctx);
  stream->Write(ShareRequest(v1::FORMAT_INT2, 1));
  v1::PageBatch batch;
  ASSERT_TRUE(stream->Read(&batch));
  // Unacknowledged batches hold their scratch pages.
  EXPECT_GT(a_->store->Inventory().used_bytes, source_used);
  ctx.TryCancel();
  stream->Finish();
  ExpectSourceUsedBytes(source_used);
}

// follow_writes over the ipc path: each layer lands as it is written.
TEST_F(IpcTransferTest, FollowWritesOverIpc) {
  Start(Path(TransferPath::kIpc), true, Path(TransferPath::kIpc), true);
  grpc::ClientContext actx;
  v1::AllocatePagesResponse aresp;
  ASSERT_TRUE(
      a_->stub->AllocatePages(&actx, AllocRequest("s", kTokens), &aresp).ok());
  v1::ImportSequenceRequest r = ImportRequestFor();
  r.set_follow_writes(true);
  grpc::Status status;
  v1::ImportSequenceResponse resp;
  absl::Notification done;
  std::thread importer([&] {
    status = Import(r, &resp);
    done.Notify();
  });
  ASSERT_TRUE(a_->Write("s", F32Chunk(0, 0, kTokens, k_, v_)).ok());
  EXPECT_FALSE(done.HasBeenNotified());
  ASSERT_TRUE(a_->Write("s", F32Chunk(1, 0, kTokens, k_, v_)).ok());
  done.WaitForNotification();
  importer.join();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(resp.data_path(), "ipc");
  ExpectSameReads();
}

}  // namespace
// Packed page references: what AppendRefs writes PagesWithoutBytes reads
// back (encodings shared by index, pages of `pages` first), and malformed
// batches are refused naming the field.
TEST(PageRefsTest, RoundTripAndMalformedBatches) {
  std::vector<TransferPage> sent(3);
  const kernels::Encoding bf16{Format::kBF16, Format::kBF16};
  const kernels::Encoding int4{Format::kINT4, Format::kINT4};
  for (size_t i = 0; i < sent.size(); ++i) {
    sent[i].layer = static_cast<uint32_t>(i);
    sent[i].block_index = static_cast<uint32_t>(10 + i);
    sent[i].lineage_id = 100 + i;
    sent[i].encoding = i == 1 ? int4 : bf16;
    sent[i].num_tokens = 16;
    sent[i].sealed = i != 2;
    sent[i].crc32c = 0xabcd0000u + static_cast<uint32_t>(i);
    sent[i].shared = true;
    sent[i].arena_offset = 4096 * (i + 1);
    sent[i].shared_bytes = 1024 * (i + 1);
  }
  v1::PageBatch batch;
  AppendRefs(absl::MakeConstSpan(sent).subspan(0, 2), &batch);
  AppendRefs(absl::MakeConstSpan(sent).subspan(2), &batch);
  EXPECT_EQ(batch.encodings_size(), 2);  // bf16 once, int4 once
  v1::PagePayload* legacy = batch.add_pages();
  legacy->set_layer(7);
  legacy->set_shared(true);
  legacy->set_shared_bytes(64);
  std::vector<TransferPage> got;
  ASSERT_TRUE(PagesWithoutBytes(&batch, &got).ok());
  ASSERT_EQ(got.size(), 4u);
  EXPECT_EQ(got[0].layer, 7u);  // `pages` first
  EXPECT_EQ(got[0].shared_bytes, 64u);
  for (size_t i = 0; i < sent.size(); ++i) {
    const TransferPage& g = got[i + 1];
    SCOPED_TRACE(i);
    EXPECT_EQ(g.layer, sent[i].layer);
    EXPECT_EQ(g.block_index, sent[i].block_index);
    EXPECT_EQ(g.lineage_id, sent[i].lineage_id);
    EXPECT_TRUE(g.encoding == sent[i].encoding);
    EXPECT_EQ(g.num_tokens, sent[i].num_tokens);
    EXPECT_EQ(g.sealed, sent[i].sealed);
    EXPECT_EQ(g.crc32c, sent[i].crc32c);
    EXPECT_TRUE(g.shared);
    EXPECT_EQ(g.arena_offset, sent[i].arena_offset);
    EXPECT_EQ(g.shared_bytes, sent[i].shared_bytes);
  }

  v1::PageBatch short_crcs;
  AppendRefs(sent, &short_crcs);
  short_crcs.mutable_refs()->mutable_crc32c()->RemoveLast();
  got.clear();
  absl::Status s = PagesWithoutBytes(&short_crcs, &got);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      std::string(s.message()),
      ::testing::HasSubstr("refs.crc32c has 2 entries; refs.layer has 3"));

  v1::PageBatch bad_index;
  AppendRefs(sent, &bad_index);
  bad_index.mutable_refs()->set_encoding(1, 5);
  got.clear();
  s = PagesWithoutBytes(&bad_index, &got);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      std::string(s.message()),
      ::testing::HasSubstr("refs.encoding[1]=5 is not an index into 2"));
}

// Runs of shared pages: RunWriter joins pages of one layer, consecutive
// blocks and one encoding, sealed flag, num_tokens and length whose offsets
// step by one stride (not necessarily adjacent), and starts a run at any
// other page; SharedRunsOf reads back every page, and malformed runs are
// refused naming the field.
TEST(PageRunsTest, RoundTripAndMalformedBatches) {
  const kernels::Encoding bf16{Format::kBF16, Format::kBF16};
  const kernels::Encoding int4{Format::kINT4, Format::kINT4};
  std::vector<TransferPage> sent;
  auto add = [&](uint32_t layer, uint32_t block, const kernels::Encoding& e,
                 uint64_t offset, uint64_t bytes, uint32_t tokens = 16,
                 bool sealed = true) {
    TransferPage& p = sent.emplace_back();
    p.layer = layer;
    p.block_index = block;
    p.lineage_id = 1000 + 7 * sent.size();
    p.encoding = e;
    p.num_tokens = tokens;
    p.sealed = sealed;
    p.crc32c = 0xc0de0000u + static_cast<uint32_t>(sent.size());
    p.shared = true;
    p.arena_offset = offset;
    p.shared_bytes = bytes;
  };
  // Run 0: blocks 0..3 of layer 0, a stride of 8 pages (non-adjacent).
  for (uint32_t b = 0; b < 4; ++b) add(0, b, int4, 65536 + b * 8192, 1024);
  add(0, 4, int4, 65536 + 5 * 8192, 1024);     // off the stride: run 1
  add(0, 5, int4, 65536 + 6 * 8192, 1024);     // its stride is 8192: joins
  add(0, 6, int4, 65536 + 7 * 8192, 1024, 9);  // other num_tokens: run 2
  add(1, 7, int4, 65536 + 8 * 8192, 1024);     // next layer: run 3
  add(1, 8, bf16, 65536 + 9 * 8192, 1024);     // other encoding: run 4
  add(1, 9, bf16, 65536 + 10 * 8192, 1024, 16, false);   // window: run 5
  add(1, 11, bf16, 65536 + 11 * 8192, 1024, 16, false);  // skips a block: 6
  add(1, 12, bf16, 65536 + 11 * 8192 + 512, 1024, 16, false);  // overlaps: 7
  v1::PageBatch batch;
  RunWriter writer(&batch);
  for (const TransferPage& p : sent) writer.Add(p);
  writer.Finish();
  EXPECT_EQ(writer.pages(), sent.size());
  EXPECT_EQ(batch.encodings_size(), 2);
  std::vector<SharedRun> runs;
  ASSERT_TRUE(SharedRunsOf(batch, &runs).ok());
  std::vector<uint32_t> counts;
  counts.reserve(runs.size());
  for (const SharedRun& r : runs) counts.push_back(r.count);
  EXPECT_EQ(counts, (std::vector<uint32_t>{4, 2, 1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(runs[0].stride, 8192u);
  EXPECT_EQ(runs[1].stride, 8192u);
  size_t i = 0;
  for (const SharedRun& r : runs) {
    for (uint32_t k = 0; k < r.count; ++k, ++i) {
      SCOPED_TRACE(i);
      ASSERT_LT(i, sent.size());
      EXPECT_EQ(r.layer, sent[i].layer);
      EXPECT_EQ(r.first_block + k, sent[i].block_index);
      EXPECT_EQ(r.lineage_ids[k], sent[i].lineage_id);
      EXPECT_TRUE(r.encoding == sent[i].encoding);
      EXPECT_EQ(r.num_tokens, sent[i].num_tokens);
      EXPECT_EQ(r.sealed, sent[i].sealed);
      EXPECT_EQ(r.crc32cs[k], sent[i].crc32c);
      EXPECT_EQ(r.offset + k * r.stride, sent[i].arena_offset);
      EXPECT_EQ(r.bytes, sent[i].shared_bytes);
    }
  }
  EXPECT_EQ(i, sent.size());
  // Reset for the next batch: encodings start over with it.
  batch.Clear();
  writer.Reset();
  writer.Add(sent[8]);
  writer.Finish();
  EXPECT_EQ(batch.encodings_size(), 1);
  runs.clear();
  ASSERT_TRUE(SharedRunsOf(batch, &runs).ok());
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_TRUE(runs[0].encoding == bf16);

  auto refused = [](const v1::PageBatch& b) {
    std::vector<SharedRun> out;
    return SharedRunsOf(b, &out);
  };
  v1::PageBatch good;
  RunWriter w(&good);
  for (const TransferPage& p : sent) w.Add(p);
  w.Finish();
  v1::PageBatch bad = good;
  bad.mutable_runs()->mutable_stride()->RemoveLast();
  EXPECT_THAT(
      refused(bad).message(),
      ::testing::HasSubstr("runs.stride has 7 entries; runs.layer has 8"));
  bad = good;
  bad.mutable_runs()->mutable_crc32c()->RemoveLast();
  EXPECT_THAT(refused(bad).message(),
              ::testing::HasSubstr("runs' counts sum to 12"));
  bad = good;
  bad.mutable_runs()->set_count(0, 5);
  EXPECT_THAT(refused(bad).message(),
              ::testing::HasSubstr("runs' counts sum to 13"));
  bad = good;
  bad.mutable_runs()->set_encoding(2, 9);
  EXPECT_THAT(
      refused(bad).message(),
      ::testing::HasSubstr("runs.encoding[2]=9 is not an index into 2"));
  EXPECT_EQ(refused(bad).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace triax::worker
