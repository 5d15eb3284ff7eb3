// Spill, Restore and Evict over gRPC against real host and disk tiers:
// round trips, idempotency and bad input.

#include "worker/worker_service.h"
#include "worker/worker_service_test_util.h"

namespace triax::worker {
namespace {

class TierServiceTest : public ServiceTest {
 protected:
  StoreOptions Options() override {
    const char* base = std::getenv("TEST_TMPDIR");
    std::string tmpl =
        std::string(base != nullptr && *base ? base : "/tmp") + "/svc.XXXXXX";
    char* made = ::mkdtemp(tmpl.data());
    EXPECT_NE(made, nullptr);
    dir_ = made != nullptr ? made : "";
    TierStoreOptions to;
    to.host_capacity_bytes = 256 << 10;
    to.disk_dir = dir_;
    to.disk_capacity_bytes = 1 << 20;
    to.owner = "svc";
    auto t = TierStore::Create(&device_, to);
    EXPECT_TRUE(t.ok()) << t.status();
    if (t.ok()) tiers_ = *std::move(t);
    StoreOptions o;
    o.window_tokens = 4;
    o.tiers = tiers_.get();
    o.restore_on_attend = false;
    o.retry_after_ms = 35;
    o.prefetch_thread = false;
    return o;
  }
  void TearDown() override {
    ServiceTest::TearDown();
    tiers_.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  grpc::Status Spill(const std::string& seq, const std::vector<uint64_t>& ids,
                     v1::Tier tier, const std::string& request_id = "",
                     const std::string& tenant = kTenant,
                     v1::SpillResponse* resp = nullptr) {
    v1::SpillRequest r;
    r.set_request_id(request_id);
    r.set_tenant_id(tenant);
    r.set_sequence_id(seq);
    for (uint64_t id : ids) r.add_lineage_ids(id);
    r.set_tier(tier);
    grpc::ClientContext ctx;
    v1::SpillResponse local;
    return stub_->Spill(&ctx, r, resp ? resp : &local);
  }
  grpc::Status Restore(const std::string& seq, const std::vector<uint64_t>& ids,
                       bool background, const std::string& request_id = "",
                       const std::string& tenant = kTenant,
                       v1::RestoreResponse* resp = nullptr) {
    v1::RestoreRequest r;
    r.set_request_id(request_id);
    r.set_tenant_id(tenant);
    r.set_sequence_id(seq);
    for (uint64_t id : ids) r.add_lineage_ids(id);
    r.set_background(background);
    grpc::ClientContext ctx;
    v1::RestoreResponse local;
    return stub_->Restore(&ctx, r, resp ? resp : &local);
  }
  grpc::Status Evict(const std::string& seq, const std::vector<uint64_t>& ids,
                     const std::string& request_id = "",
                     const std::string& tenant = kTenant,
                     v1::EvictResponse* resp = nullptr) {
    v1::EvictRequest r;
    r.set_request_id(request_id);
    r.set_tenant_id(tenant);
    r.set_sequence_id(seq);
    for (uint64_t id : ids) r.add_lineage_ids(id);
    grpc::ClientContext ctx;
    v1::EvictResponse local;
    return stub_->Evict(&ctx, r, resp ? resp : &local);
  }
  v1::AttendResponse AttendAt(uint64_t position) {
    v1::AttendRequest req;
    req.set_tenant_id(kTenant);
    v1::AttendItem* item = req.add_items();
    item->set_sequence_id("s");
    item->set_layer(1);
    item->set_num_queries(1);
    item->add_positions(position);
    const std::vector<float> q = Random(size_t{4} * 32, 9);
    item->set_queries(F32Bytes(q.data(), q.size()));
    grpc::ClientContext ctx;
    v1::AttendResponse resp;
    EXPECT_TRUE(stub_->Attend(&ctx, req, &resp).ok());
    return resp;
  }
  v1::Inventory Inv() {
    grpc::ClientContext ctx;
    v1::Inventory inv;
    EXPECT_TRUE(
        stub_->GetInventory(&ctx, v1::GetInventoryRequest(), &inv).ok());
    return inv;
  }

  std::string dir_;
  std::unique_ptr<TierStore> tiers_;
};

TEST_F(TierServiceTest, SpillRestoreEvictRoundTripAndIdempotency) {
  std::vector<float> k, v;
  MakeWritten(40, &k, &v);  // blocks 1000 (0-15), 1001 (16-31), 1002; window 4
  const v1::AttendResponse before = AttendAt(30);
  ASSERT_EQ(before.results(0).status().code(), 0);

  v1::SpillResponse a, b;
  ASSERT_TRUE(
      Spill("s", {1000, 1001}, v1::TIER_DISK, "sp-1", kTenant, &a).ok());
  EXPECT_EQ(a.pages_moved(), 4u);
  EXPECT_GT(a.bytes_moved(), 0u);
  EXPECT_EQ(a.device_bytes_freed(), a.bytes_moved());
  // The same request id answers the first reply and does nothing more.
  ASSERT_TRUE(
      Spill("s", {1000, 1001}, v1::TIER_DISK, "sp-1", kTenant, &b).ok());
  EXPECT_EQ(b.SerializeAsString(), a.SerializeAsString());
  v1::Inventory inv = Inv();
  EXPECT_EQ(inv.spills(), 2u);
  ASSERT_EQ(inv.tiers_size(), 2);
  EXPECT_EQ(inv.tiers(1).tier(), v1::TIER_DISK);
  EXPECT_EQ(inv.tiers(1).capacity_bytes(), 1u << 20);
  EXPECT_EQ(inv.tiers(1).used_bytes(), a.bytes_moved());
  EXPECT_EQ(inv.tiers(1).blocks(), 2u);
  EXPECT_EQ(inv.tiers(1).free_bytes(), (1u << 20) - a.bytes_moved());
  EXPECT_EQ(inv.tiers(0).capacity_bytes(), 256u << 10);
  EXPECT_EQ(inv.tiers(0).free_bytes(), 256u << 10);  // nothing on the host
  EXPECT_EQ(inv.tiers(0).free_runs(), 1u);

  // Restore on attend is off: UNAVAILABLE with retry_after_ms, then served
  // once the background restore ran.
  const v1::AttendResponse refused = AttendAt(30);
  EXPECT_EQ(refused.results(0).status().code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(refused.results(0).status().message(),
              HasSubstr("lineage_id=1001"));
  EXPECT_EQ(refused.results(0).retry_after_ms(), 35u);
  EXPECT_EQ(store_->ServePrefetchQueue(), 1u);
  const v1::AttendResponse served = AttendAt(30);
  ASSERT_EQ(served.results(0).status().code(), 0);
  EXPECT_EQ(served.results(0).retry_after_ms(), 0u);
  EXPECT_EQ(served.results(0).output(), before.results(0).output());

  // Restore: explicit, idempotent; background answers blocks_queued.
  ASSERT_TRUE(Spill("s", {1000}, v1::TIER_HOST, "sp-2").ok());
  v1::RestoreResponse r1, r2;
  ASSERT_TRUE(Restore("s", {}, false, "rs-1", kTenant, &r1).ok());
  EXPECT_EQ(r1.pages_restored(), 2u);
  ASSERT_TRUE(Restore("s", {}, false, "rs-1", kTenant, &r2).ok());
  EXPECT_EQ(r2.SerializeAsString(), r1.SerializeAsString());
  ASSERT_TRUE(Spill("s", {1000}, v1::TIER_HOST, "sp-3").ok());
  v1::RestoreResponse q;
  ASSERT_TRUE(Restore("s", {1000}, true, "rs-2", kTenant, &q).ok());
  EXPECT_EQ(q.blocks_queued(), 1u);
  EXPECT_EQ(q.pages_restored(), 0u);
  store_->ServePrefetchQueue();
  EXPECT_EQ(Inv().restores(), 4u);

  // Evict: idempotent; the block's tokens are skipped from then on.
  v1::EvictResponse e1, e2;
  ASSERT_TRUE(Evict("s", {1001}, "ev-1", kTenant, &e1).ok());
  EXPECT_EQ(e1.pages_freed(), 2u);
  ASSERT_TRUE(Evict("s", {1001}, "ev-1", kTenant, &e2).ok());
  EXPECT_EQ(e2.SerializeAsString(), e1.SerializeAsString());
  EXPECT_EQ(Inv().evictions(), 1u);
  const v1::AttendResponse skipped = AttendAt(30);
  ASSERT_EQ(skipped.results(0).status().code(), 0);
  EXPECT_NE(skipped.results(0).output(), before.results(0).output());
  std::vector<v1::KvChunk> chunks;
  v1::ReadKVRequest read;
  read.set_tenant_id(kTenant);
  read.set_sequence_id("s");
  read.set_layer(0);
  read.set_first_token(16);
  read.set_num_tokens(4);
  read.set_dtype(v1::KV_DTYPE_F32);
  EXPECT_CODE(Read(read, &chunks), grpc::StatusCode::FAILED_PRECONDITION,
              "lineage_id=1001");
}

TEST_F(TierServiceTest, BadInputsAreRefusedWithoutStateChange) {
  std::vector<float> k, v;
  MakeWritten(40, &k, &v);
  const std::string before = Inventory();
  EXPECT_CODE(Spill("s", {1000}, v1::TIER_DEVICE),
              grpc::StatusCode::INVALID_ARGUMENT, "tier=1");
  EXPECT_CODE(Spill("s", {1000}, v1::TIER_UNSPECIFIED),
              grpc::StatusCode::INVALID_ARGUMENT, "tier=0");
  EXPECT_CODE(Spill("s", {}, v1::TIER_HOST), grpc::StatusCode::INVALID_ARGUMENT,
              "lineage_ids");
  EXPECT_CODE(Evict("s", {}), grpc::StatusCode::INVALID_ARGUMENT,
              "lineage_ids");
  EXPECT_CODE(Spill("s", {1000, 4242}, v1::TIER_HOST),
              grpc::StatusCode::NOT_FOUND, "4242");
  EXPECT_CODE(Restore("s", {4242}, false), grpc::StatusCode::NOT_FOUND, "4242");
  EXPECT_CODE(Evict("s", {4242}), grpc::StatusCode::NOT_FOUND, "4242");
  EXPECT_CODE(Spill("s", {1000}, v1::TIER_HOST, "", "tenant-b"),
              grpc::StatusCode::PERMISSION_DENIED, "tenant_id");
  EXPECT_CODE(Restore("s", {}, false, "", "tenant-b"),
              grpc::StatusCode::PERMISSION_DENIED, "tenant_id");
  EXPECT_CODE(Evict("s", {1000}, "", "tenant-b"),
              grpc::StatusCode::PERMISSION_DENIED, "tenant_id");
  EXPECT_CODE(Spill("nope", {1000}, v1::TIER_HOST), grpc::StatusCode::NOT_FOUND,
              "sequence_id");
  EXPECT_CODE(Spill("s", {1000}, v1::TIER_HOST, "bad id"),
              grpc::StatusCode::INVALID_ARGUMENT, "request_id");
  // Block 1002 is still in the window.
  EXPECT_CODE(Spill("s", {1002}, v1::TIER_HOST),
              grpc::StatusCode::FAILED_PRECONDITION, "not sealed");
  EXPECT_CODE(Evict("s", {1002}), grpc::StatusCode::FAILED_PRECONDITION,
              "not sealed");
  EXPECT_EQ(Inventory(), before);
  // A failed request is not remembered: the same id runs once fixed.
  EXPECT_CODE(Spill("s", {1002}, v1::TIER_HOST, "sp-x"),
              grpc::StatusCode::FAILED_PRECONDITION, "not sealed");
  EXPECT_TRUE(Spill("s", {1000}, v1::TIER_HOST, "sp-x").ok());
}

}  // namespace
}  // namespace triax::worker
