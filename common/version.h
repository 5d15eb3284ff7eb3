// The build's version, printed by --version of kvmanager, kvworker and
// kvctl: CMake's project version and the git commit of the source tree when
// the binary was built.
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace triax {

// CMake's project version, e.g. "0.1.0".
absl::string_view ProjectVersion();
// The short (12 hex digits) commit of the tree at build time; "unknown"
// when it was not built from a git checkout.
absl::string_view GitCommit();
// What --version prints: "triaxkv 0.1.0 (git 1a2b3c4d5e6f)\n".
std::string VersionLine();

}  // namespace triax
