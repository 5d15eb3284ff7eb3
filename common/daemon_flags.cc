#include "common/daemon_flags.h"

#include <string>

#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "common/version.h"

namespace triax {

void InitDaemonFlags(absl::string_view main_file, const char* usage) {
  absl::FlagsUsageConfig config;
  const std::string file(main_file);
  // Abseil's default filter looks for "<program>.cc" and matches none of
  // the mains (kvworker is worker/main.cc), so --help listed no flags.
  config.contains_help_flags = [file](absl::string_view f) {
    return absl::EndsWith(f, file);
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
}

void DisableMutexDeadlockDetectionInRelease() {
#ifdef NDEBUG
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
}

}  // namespace triax
