// event_log_bench: the EventLog alone, appended as manager_bench's sessions
// append (kvmanager/event_log.h), without gRPC, the core or the journal.
//
// Each session: an Open (41 BLOCK_CREATED events with their details and a
// SEQUENCE_OPENED, one batch), then a Close (BLOCK_RELEASED and BLOCK_FREED
// per block, the blocks' last plans, a SEQUENCE_CLOSED). Sessions run in
// order, lineage ids dense and increasing as the manager hands them out;
// --retention events are kept (the manager's default: 10^6), so the log
// wraps after ~7,300 sessions. Prints the nanoseconds per appended event
// and the process's user and system CPU per event, for --sessions sessions
// after --warmup (filling the rings once: their page faults happen then).
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "kvmanager/event_log.h"

ABSL_FLAG(int, sessions, 20000, "sessions timed");
ABSL_FLAG(int, warmup, 8000, "sessions before the timing");
ABSL_FLAG(uint64_t, retention, 1000000, "events kept");

namespace {

using triax::manager::EventBatch;
using triax::manager::EventKind;
using triax::manager::EventLog;

constexpr int kBlocks = 41;

double CpuSeconds(bool user) {
  rusage u;
  getrusage(RUSAGE_SELF, &u);
  const timeval& t = user ? u.ru_utime : u.ru_stime;
  return t.tv_sec + t.tv_usec * 1e-6;
}

// One session's events; returns how many.
int Session(EventLog* log, EventBatch* batch, int n, uint64_t* lineage) {
  const std::string seq = absl::StrCat("seq-", n);
  const std::string tenant = absl::StrCat("bench-t", n % 4);
  const std::string worker = "bench-worker";
  const triax::Tag tag{triax::Temporal::kRecentTurns, triax::Modality::kText,
                       triax::Role::kUser};
  for (int b = 0; b < kBlocks; ++b) {
    batch->Begin(n, EventKind::kBlockCreated, seq, tenant, worker, *lineage + b,
                 tag, triax::kernels::Format::kINT4);
    batch->Detail("index=", b, " first_token=", 16 * b,
                  " num_tokens=16 bytes=1048576 encoding=int4");
  }
  batch->Begin(n, EventKind::kSequenceOpened, seq, tenant, worker);
  batch->Detail("blocks=41 tokens=600 bytes=42991616 policy=triaxial-static");
  log->Append(batch);
  std::vector<EventLog::LastPlan> forgotten(kBlocks);
  for (int b = 0; b < kBlocks; ++b) {
    batch->Begin(n, EventKind::kBlockReleased, seq, tenant, worker,
                 *lineage + b, tag, triax::kernels::Format::kINT4);
    batch->Begin(n, EventKind::kBlockFreed, seq, tenant, worker, *lineage + b,
                 tag, triax::kernels::Format::kINT4);
    batch->Detail("bytes=1048576");
    forgotten[b].plan.lineage_id = *lineage + b;
    forgotten[b].creator = seq;
  }
  batch->Begin(n, EventKind::kSequenceClosed, seq, tenant, worker);
  batch->Detail("blocks=41 freed=41");
  log->Append(batch, &forgotten);
  *lineage += kBlocks;
  return 3 * kBlocks + 2;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  EventLog log({absl::GetFlag(FLAGS_retention), 65536, 0});
  EventBatch batch;
  uint64_t lineage = 1;
  int n = 0;
  for (; n < absl::GetFlag(FLAGS_warmup); ++n) {
    Session(&log, &batch, n, &lineage);
  }
  const double user0 = CpuSeconds(true), sys0 = CpuSeconds(false);
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t events = 0;
  const int end = n + absl::GetFlag(FLAGS_sessions);
  for (; n < end; ++n) events += Session(&log, &batch, n, &lineage);
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  std::printf(
      "%llu events (%d sessions, %zu retained): %.1f ns per event, user "
      "%.1f ns, system %.1f ns\n",
      static_cast<unsigned long long>(events), absl::GetFlag(FLAGS_sessions),
      log.retained(), wall * 1e9 / events,
      (CpuSeconds(true) - user0) * 1e9 / events,
      (CpuSeconds(false) - sys0) * 1e9 / events);
  return 0;
}
