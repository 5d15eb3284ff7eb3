// kvctl's live views: `kvctl pressure --watch` and `kvctl top`, frames
// re-drawn every --interval seconds. The formatting here is pure (no I/O),
// thread-safe; kvctl.cc fetches the samples and prints the frames.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "triax/v1/manager.pb.h"

namespace triax::kvctl {

// What one refresh of `kvctl top` reads from the manager.
struct TopSample {
  int64_t unix_ms = 0;  // when it was read
  triax::v1::ListWorkersResponse workers;
  triax::v1::ListTenantsResponse tenants;
  triax::v1::GetPressureResponse pressure;
};

// One `kvctl top` frame: a header (time, rate window), then
//   WORKERS    WORKER STATE SEQS RESERVED USED CAPACITY USE HOST DISK
//              SPILLS/S RESTORES/S EVICTIONS/S
//   ENCODINGS  WORKER ENCODING PAGES BYTES (the worker's heartbeat
//              inventory; "window" is the BF16 recent-window staging)
//   TENANTS    TENANT SEQS DEVICE DEVICE_DELTA HOST DISK CEILING USE
//   PRESSURE   mode, ranked snapshot blocks, actions applied per second
//              (demote, spill, restore, evict) and prefix hits per second.
// Rates and deltas are over the time since `prev` (nullptr for the first
// frame: "-").
std::string TopFrame(const TopSample& now, const TopSample* prev);

// `kvctl pressure --watch`: a time line, then PressureReport.
std::string PressureFrame(int64_t unix_ms,
                          const triax::v1::GetPressureResponse& resp);

// A frame as printed: on a TTY the ANSI "cursor home, clear screen" codes
// and the body; otherwise the body, preceded from the second frame
// (index >= 1) on by the separator line "---", so that a reader of the
// output can split the frames.
std::string FrameText(absl::string_view body, int64_t index, bool tty);

// --interval: seconds, a decimal number in (0, 3600]; --count: frames, an
// integer >= 0 (0: until interrupted). INVALID_ARGUMENT naming the flag and
// the value otherwise.
absl::StatusOr<double> ParseInterval(absl::string_view text);
absl::StatusOr<int64_t> ParseCount(absl::string_view text);

}  // namespace triax::kvctl
