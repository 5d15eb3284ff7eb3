#include "bench/quality/bench_service.h"

#include <chrono>

#include "common/grpc_status.h"
#include "common/status_macros.h"

namespace triax::bench {
namespace {

void SetDeadline(grpc::ClientContext* ctx, absl::Duration d) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    absl::ToChronoMilliseconds(d));
}

}  // namespace

testing::ClusterOptions OneWorkerOptions(int pool_mb) {
  testing::ClusterOptions o;
  o.num_workers = 1;
  o.pool_mb = pool_mb;
  o.window_tokens = 0;
  return o;
}

absl::StatusOr<BenchCluster> StartBenchCluster(
    const testing::ClusterOptions& options, const std::string& tenant) {
  BenchCluster b;
  TRIAX_ASSIGN_OR_RETURN(b.cluster, testing::Cluster::Start(options));
  TRIAX_RETURN_IF_ERROR(b.cluster->CreateTenant(tenant));
  TRIAX_ASSIGN_OR_RETURN(b.client, b.cluster->NewClient(tenant));
  return b;
}

absl::Status PutPolicy(client::Client* c, const v1::Policy& policy) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, absl::Seconds(30));
  v1::PutPolicyRequest req;
  req.set_request_id(c->NewRequestId());
  *req.mutable_policy() = policy;
  v1::PutPolicyResponse resp;
  return FromGrpcStatus(c->manager()->PutPolicy(&ctx, req, &resp));
}

absl::Status PutCalibration(client::Client* c,
                            const v1::CalibrationTable& table) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, absl::Seconds(30));
  v1::PutCalibrationRequest req;
  req.set_request_id(c->NewRequestId());
  *req.mutable_table() = table;
  v1::PutCalibrationResponse resp;
  return FromGrpcStatus(c->manager()->PutCalibration(&ctx, req, &resp));
}

absl::StatusOr<v1::Inventory> WorkerInventory(client::Client* c,
                                              const std::string& address,
                                              absl::Duration deadline) {
  TRIAX_ASSIGN_OR_RETURN(v1::Worker::Stub * w, c->worker(address));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, deadline);
  v1::Inventory inv;
  TRIAX_RETURN_IF_ERROR(
      FromGrpcStatus(w->GetInventory(&ctx, v1::GetInventoryRequest(), &inv)));
  return inv;
}

}  // namespace triax::bench
