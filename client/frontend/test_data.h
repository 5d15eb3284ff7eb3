// Test helper: the data directory, or a skip.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "client/frontend/data_dir.h"

namespace triax::frontend {

inline std::string TestDataDir() { return ResolveDataDir(""); }

#define TRIAX_REQUIRE_DATA_DIR(dir)                                      \
  do {                                                                   \
    if (!::triax::frontend::DataDirComplete(dir)) {                      \
      GTEST_SKIP() << "data directory '" << (dir)                        \
                   << "' is absent or incomplete (set TRIAX_DATA_DIR); " \
                      "skipping a test that needs the real models/data"; \
    }                                                                    \
  } while (0)

}  // namespace triax::frontend
