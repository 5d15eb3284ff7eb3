#include "common/version.h"

#include "absl/strings/str_cat.h"
#include "common/git_commit.h"  // generated: cmake/git_commit.cmake

namespace triax {

absl::string_view ProjectVersion() { return TRIAX_VERSION; }

absl::string_view GitCommit() { return TRIAX_GIT_COMMIT; }

std::string VersionLine() {
  return absl::StrCat("triaxkv ", ProjectVersion(), " (git ", GitCommit(),
                      ")\n");
}

}  // namespace triax
