// Start-up of the daemons' flags (kvmanager, kvworker): --help lists the
// flags defined in the daemon's main.cc under a usage message that says what
// the program is, how it is run and what its exit statuses mean; --version
// prints VersionLine() (common/version.h) and exits 0. Both take
// --log_format=logfmt|json (common/log.h), defined in daemon_flags.cc and
// listed by --help; another value exits 2 while the flags are parsed.
// gRPC's own log lines (gpr_log) are routed into the same records
// (component "grpc").
#pragma once

#include "absl/strings/string_view.h"

namespace triax {

// Call before absl::ParseCommandLine. `main_file` is the path suffix of the
// file defining the flags ("worker/main.cc"); `usage` the text --help prints
// before them.
void InitDaemonFlags(absl::string_view main_file, const char* usage);

// Turns Abseil's Mutex deadlock detection off in builds with NDEBUG.
// Debian's libabsl is built in its debug mode, where every lock and every
// Mutex's destruction consults one process-wide lock-order graph under a
// global lock: a lock pair costs about 3.5x as much, and every thread of a
// daemon serializes on that graph. Debug builds (and the unit tests, which
// do not call this) keep the detection.
void DisableMutexDeadlockDetectionInRelease();

}  // namespace triax
