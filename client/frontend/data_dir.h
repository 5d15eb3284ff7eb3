// Where the shared test data lives (models, text, BFCL). Never copied into
// the repository.
#pragma once

#include <string>

namespace triax::frontend {

// `flag_value` when non-empty, else $TRIAX_DATA_DIR when set and non-empty,
// else "../shared/data" (relative to the working directory).
std::string ResolveDataDir(const std::string& flag_value);

// True when `dir` holds the files the frontend uses: stories260k (model,
// tokenizer, known answer) and the TinyStories text, and, when
// `need_kvproxy`, kvproxy-18m and the BFCL base file.
bool DataDirComplete(const std::string& dir, bool need_kvproxy = true);

}  // namespace triax::frontend
