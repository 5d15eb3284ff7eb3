// Block lifecycles as a Chrome trace (the Trace Event Format that Perfetto
// and chrome://tracing open): `kvctl trace --chrome_trace=FILE` and
// `kvctl events --chrome_trace=FILE`. Pure functions, thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "triax/v1/types.pb.h"

namespace triax::kvctl {

// The trace of `events` (in id order) as one JSON object
//   {"traceEvents": [...], "displayTimeUnit": "ms"}
// with timestamps in microseconds since the Unix epoch (event unix_ms *
// 1000). Tracks:
//   process  one per worker, "worker <id>" (pid 1, 2, ... by worker id),
//            and "manager" (the last pid) for events that name no worker
//            (TENANT_CHANGED);
//   thread   tid 1 "events" of each process: the sequence, worker and
//            transfer events as instants; then one thread per block and
//            tier it sat in on that worker, "<tier> L<lineage>" (tid 2 +
//            3 * block rank + tier index, tier index 0 device, 1 host,
//            2 disk; blocks ranked by lineage id), sorted tier first.
// On a block's thread:
//   ph "X"   a span for each stretch the block sat in one tier and encoding
//            on that worker, named by the encoding ("int4",
//            "k=fp8,v=int4"); it opens at BLOCK_CREATED, BLOCK_DEMOTED,
//            BLOCK_SPILLED, BLOCK_RESTORED or BLOCK_TRANSFERRED (on the
//            destination) and closes at the next of those or at
//            BLOCK_EVICTED, BLOCK_FREED, BLOCK_LOST; one still open at the
//            end closes at `end_unix_ms` (or the last event's time when
//            that is later) with args.open = true;
//   ph "i"   an instant (scope "t") per block event, named by its kind in
//            lower case ("created", "demoted", "spilled", ...), args: the
//            event id and detail.
// A BLOCK_TRANSFERRED adds a flow (ph "s" on the source's span 1 us before
// its end at the transfer, ph "f" with bp "e" on the destination's span at
// its start, cat "transfer", id = the event id). Metadata events (ph "M") name
// every process and thread and give their sort order.
std::string ChromeTraceJson(const std::vector<triax::v1::Event>& events,
                            int64_t end_unix_ms);

// A time for --since / --until: RFC 3339 ("2026-11-25T13:00:00Z", with
// fractions and offsets) or Unix seconds ("1764075600", "1764075600.25");
// in Unix milliseconds. INVALID_ARGUMENT naming `flag` and `text` otherwise.
absl::StatusOr<int64_t> ParseTimeFlag(absl::string_view flag,
                                      absl::string_view text);

}  // namespace triax::kvctl
