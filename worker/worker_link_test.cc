// The link data path between two in-process workers over loopback gRPC
// (CPU devices with TCP links): ImportSequence over OpenLink + LinkPages
// with the bytes on the link, the link kept and reused, the fallback to
// the stream and the strict path's refusal, the corruption hook (DATA_LOSS,
// the link dropped at both ends), and hostile OpenLink / LinkPages calls.
#include <thread>

#include "worker/link_tcp.h"
#include "worker/transfer_test_node.h"
#include "worker/worker_service_test_util.h"

namespace triax::worker {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kTokens = 40;

class LinkTransferTest : public ::testing::Test {
 protected:
  void SetUp() override {
    k_ = Random(size_t{kTokens} * 64, 1);
    v_ = Random(size_t{kTokens} * 64, 2);
  }
  void Start(WorkerServiceOptions a, bool a_links, WorkerServiceOptions b,
             bool b_links) {
    a_ = std::make_unique<Node>(a, false, a_links);
    b_ = std::make_unique<Node>(b, false, b_links);
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
  v1::ImportSequenceRequest ImportOf(const std::string& seq,
                                     v1::Format format = v1::FORMAT_INT4) {
    v1::ImportSequenceRequest r =
        ImportRequestFrom(a_->address, kTokens, format);
    r.set_sequence_id(seq);
    r.set_request_id("imp-" + seq);
    r.set_transfer_id("t-" + seq);
    return r;
  }
  grpc::Status Import(const v1::ImportSequenceRequest& r,
                      v1::ImportSequenceResponse* resp = nullptr) {
    grpc::ClientContext ctx;
    v1::ImportSequenceResponse local;
    return b_->stub->ImportSequence(&ctx, r, resp ? resp : &local);
  }
  void ExpectSameReads(const std::string& seq) {
    for (uint32_t l = 0; l < 2; ++l) {
      auto ra = a_->store->Read(kTenant, seq, l, 0, 0);
      auto rb = b_->store->Read(kTenant, seq, l, 0, 0);
      ASSERT_TRUE(ra.ok()) << ra.status();
      ASSERT_TRUE(rb.ok()) << rb.status();
      EXPECT_EQ(ra->k, rb->k);
      EXPECT_EQ(ra->v, rb->v);
    }
  }
  // Waits (up to 5 s) until A holds `n` links.
  void ExpectSourceLinks(size_t n) {
    const absl::Time until = absl::Now() + absl::Seconds(5);
    while (a_->service->links().size() != n && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_EQ(a_->service->links().size(), n);
  }

  std::unique_ptr<Node> a_, b_;
  std::vector<float> k_, v_;
};

TEST_F(LinkTransferTest, ImportsOverATcpLinkAndReusesIt) {
  Start(Path(TransferPath::kLink), true, Path(TransferPath::kLink), true);
  WriteSource("s");
  WriteSource("t");
  const uint64_t source_used = a_->store->Inventory().used_bytes;
  // INT2 on the way: the source re-encodes, gathers and sends.
  v1::ImportSequenceResponse resp;
  grpc::Status s = Import(ImportOf("s", v1::FORMAT_INT2), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.data_path(), "tcp");
  const kernels::PageShape shape = PageShapeOf(FromProto(Model()), 16);
  const size_t int2 = kernels::PageBytes(kernels::Format::kINT2, shape);
  const size_t bf16 = kernels::PageBytes(kernels::Format::kBF16, shape);
  EXPECT_EQ(resp.pages(), 6u);
  EXPECT_EQ(resp.wire_bytes(), 2 * (2 * int2 + bf16));
  // Installed from the staging slot with checked copies, one per batch.
  size_t copied = 0;
  for (size_t n : b_->device.checked_copies()) copied += n;
  EXPECT_EQ(copied, 6u);
  ExpectSourceLinks(1);
  // The second transfer reuses the link.
  s = Import(ImportOf("t"), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.data_path(), "tcp");
  ExpectSourceLinks(1);
  ExpectSameReads("t");
  // Every pin and scratch page of the exports is back.
  EXPECT_EQ(a_->store->Inventory().used_bytes, source_used);
}

// Batches of one BF16 page's bytes: the sequence moves in four batches,
// each received while the one before is installed, through both slots in
// turn.
TEST_F(LinkTransferTest, ManyBatchesArriveWholeAndInOrder) {
  WorkerServiceOptions b = Path(TransferPath::kLink);
  const kernels::PageShape shape = PageShapeOf(FromProto(Model()), 16);
  const size_t bf16 = kernels::PageBytes(kernels::Format::kBF16, shape);
  b.link_batch_bytes = bf16;
  Start(Path(TransferPath::kLink), true, b, true);
  WriteSource();
  v1::ImportSequenceResponse resp;
  const grpc::Status s = Import(ImportOf("s"), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.data_path(), "tcp");
  EXPECT_EQ(resp.pages(), 6u);
  // Per layer: the two INT4 pages fit one batch, the BF16 window page
  // takes the next.
  const std::vector<size_t> copies = b_->device.checked_copies();
  EXPECT_EQ(copies, (std::vector<size_t>{2, 1, 2, 1}));
  ExpectSameReads("s");
}

TEST_F(LinkTransferTest, AutoStreamsWhenTheSourceMakesNoLinks) {
  Start(Path(TransferPath::kStream), false, Path(TransferPath::kAuto), true);
  WriteSource();
  v1::ImportSequenceResponse resp;
  const grpc::Status s = Import(ImportOf("s"), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.data_path(), "stream");
  ExpectSameReads("s");
}

TEST_F(LinkTransferTest, StrictLinkFailsNamingWhy) {
  Start(Path(TransferPath::kAuto), false, Path(TransferPath::kLink), true);
  WriteSource();
  const grpc::Status s = Import(ImportOf("s"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(),
              HasSubstr("transfer_path=link: no tcp link to source worker-a "
                        "at " +
                        a_->address));
  EXPECT_THAT(s.error_message(), HasSubstr("has no links enabled"));
  EXPECT_EQ(b_->store->Inventory().used_bytes, 0u);
}

TEST_F(LinkTransferTest, CorruptedPageIsDataLossAndDropsTheLink) {
  Start(Path(TransferPath::kLink, /*corrupt=*/4), true,
        Path(TransferPath::kLink), true);
  WriteSource();
  const grpc::Status s = Import(ImportOf("s"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("CRC32C"));
  EXPECT_EQ(b_->store->Inventory().used_bytes, 0u);
  ExpectSourceLinks(0);  // neither end keeps a link after an error
}

TEST_F(LinkTransferTest, HostileOpenLinkAndLinkPagesCalls) {
  Start(Path(TransferPath::kLink), true, Path(TransferPath::kLink), true);
  WriteSource();
  auto open = [&](const v1::OpenLinkRequest& r) {
    grpc::ClientContext ctx;
    v1::OpenLinkResponse resp;
    return a_->stub->OpenLink(&ctx, r, &resp);
  };
  v1::OpenLinkRequest r;
  r.set_backend("tcp");
  r.set_link_key("k");
  r.set_owner("o");
  grpc::Status s = open(r);  // no link_id
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("link_id"));
  r.set_link_id("not an id");
  s = open(r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("\"not an id\""));
  r.set_backend("nccl");
  s = open(r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_THAT(s.error_message(), HasSubstr("backend=\"nccl\""));
  // A link that never answers: OpenLink ends at its timeout.
  r.set_backend("tcp");
  TcpLinkFactory stranger("127.0.0.1");
  auto id = stranger.NewLinkId();
  ASSERT_TRUE(id.ok());
  r.set_link_id(*id);
  r.set_timeout_ms(200);
  const absl::Time start = absl::Now();
  s = open(r);  // rank 1 connects (the backlog), rank 0 never answers
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("did not complete in time"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  EXPECT_EQ(a_->service->links().size(), 0u);

  auto pages = [&](const v1::LinkPagesRequest& m) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(5));
    auto stream = a_->stub->LinkPages(&ctx);
    stream->Write(m);
    stream->WritesDone();  // refused before the source reads again
    v1::PageBatch batch;
    while (stream->Read(&batch)) {
    }
    return stream->Finish();
  };
  v1::LinkPagesRequest m;
  s = pages(m);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("no request"));
  v1::ImportSequenceRequest imp = ImportOf("s");
  m.mutable_request()->set_tenant_id(kTenant);
  m.mutable_request()->set_sequence_id("s");
  *m.mutable_request()->mutable_blocks() = imp.blocks();
  s = pages(m);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("link_key"));
  m.set_link_key("nobody");
  s = pages(m);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("link_key=\"nobody\""));
  m.mutable_request()->set_max_batch_bytes(uint32_t{1} << 31);
  s = pages(m);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("max_batch_bytes=2147483648"));
  // The worker still serves a real import afterwards.
  v1::ImportSequenceResponse resp;
  s = Import(imp, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ExpectSameReads("s");
}

}  // namespace
}  // namespace triax::worker
