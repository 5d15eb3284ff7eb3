// kvctl plan: the capacity planner (PlanCapacity; docs/capacity.md) from the
// command line. Its flags are defined in kvctl_plan.cc (docs/flags.md,
// "kvctl plan").
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "triax/v1/manager.grpc.pb.h"

namespace triax::kvctl {

// The usage lines of `kvctl plan`, for kvctl's usage text.
extern const char kPlanUsage[];

// "80GiB", "45 GiB", "80GB" (10^9), "512MiB", "1024" (bytes), "-1GiB" (kept
// negative for the manager to refuse, naming the field). INVALID_ARGUMENT
// naming `flag` and the text otherwise.
absl::StatusOr<int64_t> ParseSize(absl::string_view flag,
                                  absl::string_view text);

// The request from kvctl's flags; INVALID_ARGUMENT naming the flag for text
// that does not parse (ranges are the manager's to check).
absl::StatusOr<v1::PlanCapacityRequest> PlanRequestFromFlags();

// The plan as text: the set-up, one row per policy (idealized and pages
// columns, sessions per context length), the tags of mixed rows, the
// tenants' shares and the what-ifs against the base plan.
std::string PlanTable(const v1::PlanCapacityResponse& r);

// A plain SVG document: a bar chart of live tokens per policy (idealized
// and pages) and, when the plan has context lengths, the sessions of the
// first one against KV memory per GPU.
std::string PlanSvg(const v1::PlanCapacityResponse& r);

// Runs the command: exit code 0, 1 (an error, printed "kvctl: CODE: ...")
// or 2 (bad flags, printed with the usage).
int RunPlan(v1::Manager::Stub* stub, int64_t timeout_ms);

}  // namespace triax::kvctl
