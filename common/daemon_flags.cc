#include "common/daemon_flags.h"

#include <grpc/support/log.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "common/version.h"

// Both daemons take it: defined here, not in their main.cc, and applied as
// the command line is parsed, before the first record.
ABSL_FLAG(std::string, log_format, "logfmt",
          "log records on stderr: logfmt (ts=... level=... component=... "
          "msg=\"...\" key=value, one a line) or json (one object a line)")
    .OnUpdate([] {
      const std::string v = absl::GetFlag(FLAGS_log_format);
      if (v == "logfmt") {
        triax::SetLogFormat(triax::LogFormat::kLogfmt);
      } else if (v == "json") {
        triax::SetLogFormat(triax::LogFormat::kJson);
      } else {
        // A bad flag is a usage error (exit 2, as the daemons' other flag
        // checks), found while parsing: nothing has started yet.
        std::fprintf(stderr, "--log_format=\"%s\": want logfmt or json\n",
                     v.c_str());
        std::exit(2);
      }
    });

namespace triax {
namespace {

// gRPC's own lines (gpr_log: errors by default, more with GRPC_VERBOSITY)
// become records like the daemons' own, so that every line is logfmt (or
// JSON).
void GrpcLogToRecords(gpr_log_func_args* args) {
  LogLevel level = LogLevel::kInfo;
  if (args->severity == GPR_LOG_SEVERITY_DEBUG) level = LogLevel::kDebug;
  if (args->severity == GPR_LOG_SEVERITY_ERROR) level = LogLevel::kError;
  Log(level, "grpc", args->message == nullptr ? "" : args->message,
      absl::StrCat(Kv("file", args->file == nullptr ? "" : args->file), " ",
                   Kv("line", args->line)));
}

}  // namespace

void InitDaemonFlags(absl::string_view main_file, const char* usage) {
  absl::FlagsUsageConfig config;
  const std::string file(main_file);
  // Abseil's default filter looks for "<program>.cc" and matches none of
  // the mains (kvworker is worker/main.cc), so --help listed no flags.
  config.contains_help_flags = [file](absl::string_view f) {
    return absl::EndsWith(f, file) ||
           absl::EndsWith(f, "common/daemon_flags.cc");
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  // The compiler's path "../../worker/main.cc" reads as worker/main.cc.
  config.normalize_filename = [](absl::string_view f) {
    while (absl::ConsumePrefix(&f, "../") || absl::ConsumePrefix(&f, "./")) {
    }
    return std::string(f);
  };
  config.version_string = [] { return VersionLine(); };
  absl::SetFlagsUsageConfig(config);
  absl::SetProgramUsageMessage(usage);
  gpr_set_log_function(&GrpcLogToRecords);
}

void DisableMutexDeadlockDetectionInRelease() {
#ifdef NDEBUG
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
}

}  // namespace triax
