// Start-up of the daemons' flags (kvmanager, kvworker): --help lists the
// flags defined in the daemon's main.cc under a usage message that says what
// the program is, how it is run and what its exit statuses mean.
#pragma once

#include "absl/strings/string_view.h"

namespace triax {

// Call before absl::ParseCommandLine. `main_file` is the path suffix of the
// file defining the flags ("worker/main.cc"); `usage` the text --help prints
// before them.
void InitDaemonFlags(absl::string_view main_file, const char* usage);

}  // namespace triax
