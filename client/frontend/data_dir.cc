#include "client/frontend/data_dir.h"

#include <cstdlib>
#include <fstream>

namespace triax::frontend {

std::string ResolveDataDir(const std::string& flag_value) {
  if (!flag_value.empty()) return flag_value;
  const char* env = std::getenv("TRIAX_DATA_DIR");
  if (env != nullptr && env[0] != '\0') return env;
  return "../shared/data";
}

bool DataDirComplete(const std::string& dir, bool need_kvproxy) {
  for (const char* f :
       {"/models/stories260k/model.bin", "/models/stories260k/tokenizer.bin",
        "/models/stories260k/expected_greedy_200.txt",
        "/text/tinystories_val.txt"}) {
    std::ifstream in(dir + f, std::ios::binary);
    if (!in) return false;
  }
  if (!need_kvproxy) return true;
  for (const char* f : {"/models/kvproxy-18m/model.bin",
                        "/bfcl/BFCL_v4_multi_turn_base.json"}) {
    std::ifstream in(dir + f, std::ios::binary);
    if (!in) return false;
  }
  return true;
}

}  // namespace triax::frontend
