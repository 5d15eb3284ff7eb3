#include "client/calibrate/calibration_rpc.h"

#include <chrono>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "google/protobuf/util/message_differencer.h"

namespace triax::calibrate {
namespace {

void SetDeadline(client::Client* c, grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(c->options().rpc_timeout_ms));
}

absl::Status Prefix(const char* what, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

}  // namespace

absl::Status PutAndVerify(client::Client* client,
                          const triax::v1::CalibrationTable& table) {
  triax::v1::PutCalibrationRequest put;
  put.set_request_id(client->NewRequestId());
  *put.mutable_table() = table;
  triax::v1::PutCalibrationResponse put_reply;
  {
    grpc::ClientContext ctx;
    SetDeadline(client, &ctx);
    const grpc::Status s =
        client->manager()->PutCalibration(&ctx, put, &put_reply);
    if (!s.ok()) return Prefix("PutCalibration", FromGrpcStatus(s));
  }
  if (put_reply.entries() != static_cast<uint32_t>(table.entries_size())) {
    return absl::DataLossError(
        absl::StrCat("PutCalibration stored ", put_reply.entries(),
                     " entries; the table has ", table.entries_size()));
  }
  triax::v1::GetCalibrationRequest get;
  get.set_model(table.model());
  triax::v1::GetCalibrationResponse got;
  {
    grpc::ClientContext ctx;
    SetDeadline(client, &ctx);
    const grpc::Status s = client->manager()->GetCalibration(&ctx, get, &got);
    if (!s.ok()) return Prefix("GetCalibration", FromGrpcStatus(s));
  }
  google::protobuf::util::MessageDifferencer diff;
  std::string report;
  diff.ReportDifferencesToString(&report);
  if (!diff.Compare(table, got.table())) {
    if (report.size() > 600) report.resize(600);
    return absl::DataLossError(
        absl::StrCat("GetCalibration(\"", table.model(),
                     "\") returned a different table: ", report));
  }
  return absl::OkStatus();
}

}  // namespace triax::calibrate
