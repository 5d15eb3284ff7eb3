// Worker-to-worker transfer between two real kvworker processes on
// loopback (standalone, no manager), on each data path: a sequence written
// on worker A is imported by worker B (ImportSequence pulling A's
// ExportPages stream, or mapping A's arena over SharePages), and B's ReadKV
// equals A's; A killed (SIGKILL) or stopped (SIGSTOP) mid-import ->
// B answers a definite error within the import's timeout and holds no page;
// A's --testing_corrupt_export_pages hook -> DATA_LOSS with nothing
// installed, and a retry from a worker without the hook succeeds. Waits on
// conditions (B's inventory), no fixed sleeps.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_matchers.h"
#include "tests/integration/process.h"
#include "triax/v1/worker.grpc.pb.h"

namespace triax::testing {
namespace {

using ::testing::HasSubstr;
namespace v1 = triax::v1;

constexpr char kTenant[] = "tenant-a";
constexpr uint32_t kLayers = 4, kKv = 2, kDim = 64, kBlock = 16;
constexpr size_t kPerToken = size_t{kKv} * kDim;

struct Worker {
  std::unique_ptr<Process> process;
  std::unique_ptr<v1::Worker::Stub> stub;
};

absl::StatusOr<Worker> StartWorker(const std::string& id,
                                   const std::string& dir,
                                   std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {
      "--listen=127.0.0.1:0", absl::StrCat("--worker_id=", id), "--pool_mb=64",
      "--window_tokens=8", "--host_tier_mb=8"};
  args.insert(args.end(), extra.begin(), extra.end());
  auto p = Process::Start(id, "kvworker", args, dir);
  if (!p.ok()) return p.status();
  Worker w;
  w.process = *std::move(p);
  w.stub = v1::Worker::NewStub(grpc::CreateChannel(
      w.process->address(), grpc::InsecureChannelCredentials()));
  return w;
}

std::chrono::system_clock::time_point In(int ms) {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(ms);
}

v1::ModelShape Model() {
  v1::ModelShape m;
  m.set_name("test");
  m.set_n_layers(kLayers);
  m.set_n_kv_heads(kKv);
  m.set_n_q_heads(2 * kKv);
  m.set_head_dim(kDim);
  return m;
}

google::protobuf::RepeatedPtrField<v1::BlockPlan> Plan(uint32_t tokens,
                                                       v1::Format format) {
  google::protobuf::RepeatedPtrField<v1::BlockPlan> plan;
  for (uint32_t first = 0, i = 0; first < tokens; first += kBlock, ++i) {
    v1::BlockPlan* b = plan.Add();
    b->set_index(i);
    b->set_lineage_id(500 + i);
    b->set_first_token(first);
    b->set_num_tokens(std::min(kBlock, tokens - first));
    b->set_capacity(kBlock);
    b->set_format(format);
  }
  return plan;
}

grpc::Status Allocate(Worker& w, const std::string& seq, uint32_t tokens,
                      v1::Format format) {
  v1::AllocatePagesRequest r;
  r.set_tenant_id(kTenant);
  r.set_sequence_id(seq);
  *r.mutable_model() = Model();
  r.set_block_tokens(kBlock);
  *r.mutable_blocks() = Plan(tokens, format);
  grpc::ClientContext ctx;
  ctx.set_deadline(In(5000));
  v1::AllocatePagesResponse resp;
  return w.stub->AllocatePages(&ctx, r, &resp);
}

grpc::Status WriteAll(Worker& w, const std::string& seq, uint32_t tokens) {
  grpc::ClientContext ctx;
  ctx.set_deadline(In(10000));
  v1::WriteKVResponse resp;
  auto writer = w.stub->WriteKV(&ctx, &resp);
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.f, 1.f);
  for (uint32_t l = 0; l < kLayers; ++l) {
    std::vector<float> k(tokens * kPerToken), v(tokens * kPerToken);
    for (float& x : k) x = dist(rng);
    for (float& x : v) x = dist(rng);
    v1::WriteKVRequest m;
    m.set_tenant_id(kTenant);
    m.set_sequence_id(seq);
    v1::KvChunk* c = m.mutable_chunk();
    c->set_layer(l);
    c->set_first_token(0);
    c->set_num_tokens(tokens);
    c->set_dtype(v1::KV_DTYPE_F32);
    c->set_k(
        std::string(reinterpret_cast<const char*>(k.data()), k.size() * 4));
    c->set_v(
        std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4));
    if (!writer->Write(m)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

// Every layer's K and V bytes as ReadKV gives them (F32).
absl::StatusOr<std::string> ReadAll(Worker& w, const std::string& seq) {
  std::string out;
  for (uint32_t l = 0; l < kLayers; ++l) {
    v1::ReadKVRequest r;
    r.set_tenant_id(kTenant);
    r.set_sequence_id(seq);
    r.set_layer(l);
    r.set_dtype(v1::KV_DTYPE_F32);
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10000));
    auto reader = w.stub->ReadKV(&ctx, r);
    v1::KvChunk c;
    while (reader->Read(&c)) absl::StrAppend(&out, c.k(), c.v());
    const grpc::Status s = reader->Finish();
    if (!s.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                          s.error_message());
    }
  }
  return out;
}

v1::Inventory InventoryOf(Worker& w) {
  grpc::ClientContext ctx;
  ctx.set_deadline(In(5000));
  v1::Inventory inv;
  EXPECT_TRUE(w.stub->GetInventory(&ctx, v1::GetInventoryRequest(), &inv).ok());
  return inv;
}

v1::ImportSequenceRequest ImportFrom(const Worker& source,
                                     const std::string& seq, uint32_t tokens,
                                     v1::Format format) {
  v1::ImportSequenceRequest r;
  r.set_request_id(absl::StrCat("import-", seq));
  r.set_transfer_id(absl::StrCat("t-", seq));
  r.set_tenant_id(kTenant);
  r.set_sequence_id(seq);
  *r.mutable_model() = Model();
  r.set_block_tokens(kBlock);
  r.set_window_tokens(8);
  *r.mutable_blocks() = Plan(tokens, format);
  r.set_source_address(source.process->address());
  r.set_source_worker_id("worker-a");
  return r;
}

grpc::Status Import(Worker& w, const v1::ImportSequenceRequest& r,
                    v1::ImportSequenceResponse* resp) {
  grpc::ClientContext ctx;
  ctx.set_deadline(In(60000));
  return w.stub->ImportSequence(&ctx, r, resp);
}

// Waits (bounded) until B has reserved the import's pages: the export is
// then running on A.
void WaitForReservation(Worker& b) {
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (InventoryOf(b).used_bytes() == 0) {
    ASSERT_LT(absl::Now(), end) << "the import never reserved its pages";
    absl::SleepFor(absl::Milliseconds(5));
  }
}

void ExpectHoldsNothing(Worker& b) {
  const v1::Inventory inv = InventoryOf(b);
  EXPECT_EQ(inv.sequence_ids_size(), 0);
  EXPECT_EQ(inv.used_bytes(), 0u);
}

// Every case runs on each data path (--transfer_path): "stream" (the
// source's ExportPages), "ipc" (the source's arena mapped by the
// destination: shared memory between CPU workers, CUDA IPC between CUDA
// workers when the backend is cuda) and "link" (a TCP link between CPU
// workers; NCCL between CUDA workers, which on one GPU needs each worker
// to run with its own NCCL_HOSTID).
class TransferTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    auto d = TempDir::Create("transfer_test");
    ASSERT_THAT(d.status(), IsOk());
    dir_ = *std::move(d);
  }
  absl::StatusOr<Worker> Start(const std::string& id,
                               std::vector<std::string> extra = {}) {
    extra.push_back(absl::StrCat("--transfer_path=", GetParam()));
    return StartWorker(id, dir_->path(), extra);
  }
  std::unique_ptr<TempDir> dir_;
};

TEST_P(TransferTest, ImportedSequenceReadsAsOnTheSource) {
  auto a = Start("worker-a");
  ASSERT_THAT(a.status(), IsOk());
  auto b = Start("worker-b");
  ASSERT_THAT(b.status(), IsOk());
  constexpr uint32_t kTokens = 300;
  for (v1::Format f : {v1::FORMAT_BF16, v1::FORMAT_INT4}) {
    const std::string seq = absl::StrCat("s", static_cast<int>(f));
    ASSERT_TRUE(Allocate(*a, seq, kTokens, f).ok());
    ASSERT_TRUE(WriteAll(*a, seq, kTokens).ok());
    v1::ImportSequenceResponse resp;
    const grpc::Status s = Import(*b, ImportFrom(*a, seq, kTokens, f), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    if (std::string(GetParam()) == "link") {
      // TCP between CPU workers, NCCL between CUDA workers.
      EXPECT_THAT(resp.data_path(), ::testing::AnyOf("tcp", "nccl"));
    } else {
      EXPECT_EQ(resp.data_path(), GetParam());
    }
    EXPECT_EQ(resp.pages(), 19u * kLayers);
    auto ra = ReadAll(*a, seq);
    auto rb = ReadAll(*b, seq);
    ASSERT_THAT(ra.status(), IsOk());
    ASSERT_THAT(rb.status(), IsOk());
    EXPECT_EQ(*ra, *rb) << "format " << f;
    std::cout << "figure: " << resp.data_path() << " transfer " << kTokens
              << " tokens x " << kLayers << " layers, " << v1::Format_Name(f)
              << " -> same: wire_bytes=" << resp.wire_bytes()
              << " bf16_bytes=" << resp.bf16_bytes()
              << " ratio=" << double(resp.bf16_bytes()) / resp.wire_bytes()
              << " seconds=" << resp.seconds() << "\n";
  }
  // BF16 on A, INT4 / INT2 on B: encoded on the way, so the wire carries
  // the destination's bytes (INT4 pages here hold 2.9x fewer bytes than
  // BF16 ones, INT2 4.6x; the BF16 window pages travel as they are).
  struct Case {
    v1::Format format;
    double min_ratio;
  };
  for (const Case& c :
       {Case{v1::FORMAT_INT4, 2.5}, Case{v1::FORMAT_INT2, 3.5}}) {
    const std::string seq = absl::StrCat("bf16-to-", v1::Format_Name(c.format));
    ASSERT_TRUE(Allocate(*a, seq, kTokens, v1::FORMAT_BF16).ok());
    ASSERT_TRUE(WriteAll(*a, seq, kTokens).ok());
    v1::ImportSequenceResponse resp;
    const grpc::Status s =
        Import(*b, ImportFrom(*a, seq, kTokens, c.format), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    const double ratio = double(resp.bf16_bytes()) / resp.wire_bytes();
    EXPECT_GT(ratio, c.min_ratio);
    std::cout << "figure: transfer " << kTokens << " tokens x " << kLayers
              << " layers, BF16 -> " << v1::Format_Name(c.format)
              << " on the way: wire_bytes=" << resp.wire_bytes()
              << " bf16_bytes=" << resp.bf16_bytes() << " ratio=" << ratio
              << "\n";
    auto rb = ReadAll(*b, seq);
    ASSERT_THAT(rb.status(), IsOk());
  }
}

TEST_P(TransferTest, KilledSourceFailsTheImportAndBHoldsNothing) {
  auto a = Start("worker-a");
  ASSERT_THAT(a.status(), IsOk());
  auto b = Start("worker-b");
  ASSERT_THAT(b.status(), IsOk());
  ASSERT_TRUE(Allocate(*a, "s", 64, v1::FORMAT_INT4).ok());
  v1::ImportSequenceRequest r = ImportFrom(*a, "s", 64, v1::FORMAT_INT4);
  r.set_follow_writes(true);  // nothing is written: the export waits
  r.set_timeout_ms(10000);
  const absl::Time start = absl::Now();
  auto done = std::async(std::launch::async, [&] {
    v1::ImportSequenceResponse resp;
    return Import(*b, r, &resp);
  });
  WaitForReservation(*b);
  a->process->Kill();
  const grpc::Status s = done.get();
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("source worker-a at "));
  EXPECT_LT(took, absl::Seconds(5));
  std::cout << "figure: source killed mid-import: " << s.error_code()
            << " after " << absl::ToDoubleMilliseconds(took) << " ms\n";
  ExpectHoldsNothing(*b);
}

TEST_P(TransferTest, StoppedSourceIsDeadlineExceededAtTheTimeout) {
  auto a = Start("worker-a");
  ASSERT_THAT(a.status(), IsOk());
  auto b = Start("worker-b");
  ASSERT_THAT(b.status(), IsOk());
  ASSERT_TRUE(Allocate(*a, "s", 64, v1::FORMAT_INT4).ok());
  v1::ImportSequenceRequest r = ImportFrom(*a, "s", 64, v1::FORMAT_INT4);
  r.set_follow_writes(true);
  r.set_timeout_ms(1500);
  const absl::Time start = absl::Now();
  auto done = std::async(std::launch::async, [&] {
    v1::ImportSequenceResponse resp;
    return Import(*b, r, &resp);
  });
  WaitForReservation(*b);
  ASSERT_THAT(a->process->Pause(), IsOk());
  const grpc::Status s = done.get();
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("timeout_ms=1500"));
  EXPECT_GE(took, absl::Milliseconds(1500));
  EXPECT_LT(took, absl::Milliseconds(4000));
  std::cout << "figure: source stopped mid-import (timeout_ms=1500): "
            << s.error_code() << " after " << absl::ToDoubleMilliseconds(took)
            << " ms\n";
  ExpectHoldsNothing(*b);
  ASSERT_THAT(a->process->Resume(), IsOk());
  // Continued, the source finishes its writes and a retry succeeds.
  ASSERT_TRUE(WriteAll(*a, "s", 64).ok());
  r.set_timeout_ms(10000);
  v1::ImportSequenceResponse resp;
  const grpc::Status again = Import(*b, r, &resp);
  ASSERT_TRUE(again.ok()) << again.error_message();
  auto ra = ReadAll(*a, "s");
  auto rb = ReadAll(*b, "s");
  ASSERT_THAT(rb.status(), IsOk());
  EXPECT_EQ(*ra, *rb);
}

TEST_P(TransferTest, CorruptedPagesAreDataLossAndARetrySucceeds) {
  auto bad = Start("worker-a", {"--testing_corrupt_export_pages=5"});
  ASSERT_THAT(bad.status(), IsOk());
  auto b = Start("worker-b");
  ASSERT_THAT(b.status(), IsOk());
  ASSERT_TRUE(Allocate(*bad, "s", 100, v1::FORMAT_INT4).ok());
  ASSERT_TRUE(WriteAll(*bad, "s", 100).ok());
  v1::ImportSequenceRequest r = ImportFrom(*bad, "s", 100, v1::FORMAT_INT4);
  v1::ImportSequenceResponse resp;
  const grpc::Status s = Import(*b, r, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("CRC32C"));
  EXPECT_THAT(s.error_message(), HasSubstr("sequence_id=\"s\""));
  EXPECT_THAT(s.error_message(), HasSubstr("from source worker-a at"));
  ExpectHoldsNothing(*b);
  // The same sequence on a worker without the hook; the same request id
  // runs again (a failed import is not remembered).
  auto good = Start("worker-a2");
  ASSERT_THAT(good.status(), IsOk());
  ASSERT_TRUE(Allocate(*good, "s", 100, v1::FORMAT_INT4).ok());
  ASSERT_TRUE(WriteAll(*good, "s", 100).ok());
  r.set_source_address(good->process->address());
  const grpc::Status again = Import(*b, r, &resp);
  ASSERT_TRUE(again.ok()) << again.error_message();
  auto ra = ReadAll(*good, "s");
  auto rb = ReadAll(*b, "s");
  ASSERT_THAT(rb.status(), IsOk());
  EXPECT_EQ(*ra, *rb);
}

INSTANTIATE_TEST_SUITE_P(DataPaths, TransferTest,
                         ::testing::Values("stream", "ipc", "link"));

}  // namespace
}  // namespace triax::testing
