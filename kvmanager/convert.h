// proto <-> domain conversion for the manager service, in one place. Enum
// values are cast (both sides share numbers); range checks happen in the
// core, so an out-of-range wire value is rejected there with the field name.
#pragma once

#include "common/model_proto.h"
#include "kvmanager/manager_core.h"
#include "kvmanager/types.h"
#include "triax/v1/manager.pb.h"
#include "triax/v1/types.pb.h"
#include "triax/v1/worker.pb.h"

namespace triax::manager {

// The shared vocabulary's converters (ModelShape, Tag, BlockSpec, encodings).
using triax::FromProto;
using triax::ToProto;

// Requests.
RegisterWorkerRequest FromProto(const v1::RegisterWorkerRequest& p);
Inventory FromProto(const v1::Inventory& p);
CreateTenantRequest FromProto(const v1::CreateTenantRequest& p);
SetBudgetRequest FromProto(const v1::SetBudgetRequest& p);
OpenSequenceRequest FromProto(const v1::OpenSequenceRequest& p);
ExtendSequenceRequest FromProto(const v1::ExtendSequenceRequest& p);
ForkSequenceRequest FromProto(const v1::ForkSequenceRequest& p);
CloseSequenceRequest FromProto(const v1::CloseSequenceRequest& p);
TruncateSequenceRequest FromProto(const v1::TruncateSequenceRequest& p);
EventFilter FromProto(const v1::WatchEventsRequest& p);
Budget FromProto(const v1::Budget& p);
Span FromProto(const v1::Span& p);
RenderedText FromProto(const v1::RenderedText& p);
PutPolicyRequest FromProto(const v1::PutPolicyRequest& p);
PolicyInfo FromProto(const v1::Policy& p);
DemoteBlocksRequest FromProto(const v1::DemoteBlocksRequest& p);
PutCalibrationRequest FromProto(const v1::PutCalibrationRequest& p);
CalibrationTableInfo FromProto(const v1::CalibrationTable& p);
ReportAccessRequest FromProto(const v1::ReportAccessRequest& p);
TransferSequenceRequest FromProto(const v1::TransferSequenceRequest& p);
TransferImportFigures FromProto(const v1::ImportSequenceResponse& p);
// The paging fields every List request (and QueryTrace's) carries.
template <typename Req>
PageRequest PageOf(const Req& p) {
  return PageRequest{p.page_size(), p.page_token()};
}

// Replies and infos.
void ToProto(const BlockPlan& d, v1::BlockPlan* p);
void ToProto(const Budget& d, v1::Budget* p);
void ToProto(const TenantInfo& d, v1::TenantInfo* p);
void ToProto(const TokenRecord& d, v1::TokenInfo* p);
void ToProto(const Inventory& d, v1::Inventory* p);
void ToProto(const WorkerInfo& d, v1::WorkerInfo* p);
void ToProto(const SequenceInfo& d, v1::SequenceInfo* p);
void ToProto(const Event& d, v1::Event* p);
void ToProto(const RegisterWorkerResult& d, v1::RegisterWorkerResponse* p);
void ToProto(const HeartbeatResult& d, v1::HeartbeatResponse* p);
void ToProto(const ExtendSequenceResult& d, v1::ExtendSequenceResponse* p);
void ToProto(const CloseSequenceResult& d, v1::CloseSequenceResponse* p);
void ToProto(const TruncateSequenceResult& d, v1::TruncateSequenceResponse* p);
void ToProto(const TraceResult& d, v1::QueryTraceResponse* p);
void ToProto(const PolicyInfo& d, v1::Policy* p);
void ToProto(const DemoteBlocksResult& d, v1::DemoteBlocksResponse* p);
void ToProto(const CalibrationTableInfo& d, v1::CalibrationTable* p);
// The worker's DemoteRequest from a prepared demote.
void ToProto(const DemotePrepared& d, v1::DemoteRequest* p);
void ToProto(const PressureState& d, v1::GetPressureResponse* p);
void ToProto(const TransferSequenceResult& d, v1::TransferSequenceResponse* p);
// The destination's ImportSequenceRequest from a prepared transfer.
void ToProto(const TransferPrepared& d, v1::ImportSequenceRequest* p);

}  // namespace triax::manager
