// The port file a daemon writes once it listens, so that scripts and tests
// that started it with --port=0 learn the port the kernel picked.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace triax {

// Writes "<port>\n" to `path` atomically: to "<path>.tmp" first, then
// renamed over `path`, so a reader never sees a partial file. INTERNAL naming
// the path and the errno text when a step fails.
absl::Status WritePortFile(const std::string& path, int port);

}  // namespace triax
