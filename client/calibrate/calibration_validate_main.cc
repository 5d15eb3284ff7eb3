// calibration_validate: how well calibration tables predict the measured
// effect of whole KV allocations on kvproxy-18m (allocation_check.h). Runs
// in process on the CPU kernels. Exit codes: 0 ok, 1 runtime error, 2 bad
// flags.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/calibrate/allocation_check.h"
#include "client/calibrate/calibration.h"
#include "client/calibrate/calibration_proto.h"
#include "client/calibrate/output_calibration.h"
#include "client/frontend/bfcl.h"
#include "client/frontend/data_dir.h"
#include "client/frontend/forward.h"
#include "client/frontend/llama2c.h"
#include "common/ids.h"
#include "common/status_macros.h"
#include "google/protobuf/text_format.h"

ABSL_FLAG(std::string, data_dir, "",
          "shared data directory (default $TRIAX_DATA_DIR, else "
          "../shared/data)");
ABSL_FLAG(std::string, model, "kvproxy-18m",
          "model the tables are of: DATA_DIR/models/<model>/model.bin");
ABSL_FLAG(std::string, tables,
          "bench/results/calibration_kvproxy-18m.txtpb,"
          "bench/results/calibration_kvproxy-18m-output.txtpb",
          "comma-separated CalibrationTable files (text format for .txtpb/"
          ".textproto/.pbtxt, else binary) whose predictions are checked");
ABSL_FLAG(std::string, validate_ids,
          "multi_turn_base_3,multi_turn_base_8,multi_turn_base_15,"
          "multi_turn_base_17,multi_turn_base_42,multi_turn_base_46,"
          "multi_turn_base_50,multi_turn_base_59,multi_turn_base_121,"
          "multi_turn_base_177,multi_turn_base_181",
          "comma-separated BFCL multi_turn_base ids measured (default: the 11 "
          "held-out base conversations; evaluation data may be measured, "
          "never calibrated on)");
ABSL_FLAG(int, validate, 8,
          "random per-tag allocations measured besides the uniform ones");
ABSL_FLAG(uint64_t, seed, 1, "seed of the random allocations");
ABSL_FLAG(int, max_tokens, 2048, "context per conversation (2..2048)");
ABSL_FLAG(int, chunk, 64, "prefill chunk per turn in tokens (1..256)");
ABSL_FLAG(uint32_t, recent_turns, 2, "the manager's --recent_turns");
ABSL_FLAG(int, threads, 2, "passes run in parallel (1..64)");
ABSL_FLAG(std::string, markdown_out, "", "also write the report here");

namespace {

using namespace triax;            // NOLINT(build/namespaces)
using namespace triax::frontend;  // NOLINT(build/namespaces)

constexpr int kBadFlags = 2;
constexpr int kBlockTokens = 16;

absl::Status Run(const std::vector<std::string>& table_paths,
                 const std::vector<std::string>& ids) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<calibrate::TablePredictor> tables;
  for (const std::string& path : table_paths) {
    TRIAX_ASSIGN_OR_RETURN(v1::CalibrationTable t,
                           calibrate::ReadTableFile(path));
    TRIAX_ASSIGN_OR_RETURN(
        calibrate::TablePredictor p,
        calibrate::TablePredictor::Create(t, path, kBlockTokens));
    tables.push_back(std::move(p));
  }
  const std::string data_dir = ResolveDataDir(absl::GetFlag(FLAGS_data_dir));
  TRIAX_ASSIGN_OR_RETURN(
      calibrate::CalibrationModel loaded,
      calibrate::LoadCalibrationModel(data_dir, absl::GetFlag(FLAGS_model),
                                      absl::GetFlag(FLAGS_max_tokens)));
  std::unique_ptr<Model> model = std::move(loaded.model);
  TRIAX_ASSIGN_OR_RETURN(BfclData data, BfclData::Load(data_dir));
  ByteTokenizer bt;
  std::vector<calibrate::OutputConversation> convs;
  std::map<Tag, int> tag_set;
  for (const std::string& id : ids) {
    TRIAX_ASSIGN_OR_RETURN(
        RenderedConversation conv,
        data.Render(id, absl::GetFlag(FLAGS_max_tokens) - 1));
    TRIAX_ASSIGN_OR_RETURN(
        calibrate::OutputConversation oc,
        calibrate::PrepareOutputConversation(
            conv, bt.Encode(conv.text, true), 1, kBlockTokens,
            absl::GetFlag(FLAGS_recent_turns), absl::GetFlag(FLAGS_chunk)));
    for (const Tag& t : oc.tags) tag_set[t] = 0;
    std::printf("%s: %zu tokens, %zu blocks, %zu tags\n", id.c_str(),
                oc.tokens.size(), oc.blocks.size(), oc.tags.size());
    convs.push_back(std::move(oc));
  }
  std::vector<Tag> tags;
  for (const auto& [t, unused] : tag_set) tags.push_back(t);
  const std::vector<calibrate::NamedAllocation> allocs =
      calibrate::CheckAllocations(tags, calibrate::DefaultEncodings(),
                                  absl::GetFlag(FLAGS_validate),
                                  absl::GetFlag(FLAGS_seed));
  std::printf("%zu allocations x %zu conversations, %d threads\n",
              allocs.size(), convs.size(), absl::GetFlag(FLAGS_threads));
  std::fflush(stdout);
  TRIAX_ASSIGN_OR_RETURN(
      std::vector<calibrate::EffectSums> measured,
      calibrate::MeasureAllocations(*model, convs, allocs,
                                    absl::GetFlag(FLAGS_threads),
                                    [](const std::string& line) {
                                      std::printf("%s\n", line.c_str());
                                      std::fflush(stdout);
                                    }));
  std::vector<std::vector<calibrate::EffectSums>> predicted(tables.size());
  for (size_t t = 0; t < tables.size(); ++t) {
    int64_t missing = 0;
    for (const calibrate::NamedAllocation& a : allocs) {
      calibrate::EffectSums s;
      for (const calibrate::OutputConversation& c : convs) {
        s.Add(tables[t].Predict(c, a.alloc, &missing));
      }
      predicted[t].push_back(s);
    }
    if (missing > 0) {
      std::printf(
          "%s: %lld (tag, encoding) lookups had no entry and counted 0\n",
          tables[t].name().c_str(), static_cast<long long>(missing));
    }
  }
  std::string md =
      calibrate::PredictionReport(allocs, measured, tables, predicted);
  absl::StrAppend(
      &md,
      "\nρ: Spearman rank correlation over the allocations; MAE and relative "
      "error compare a table's prediction with measured KL (nats per "
      "position), so they only mean something for output-kl tables; an "
      "attention table predicts attention error, and only its ρ is "
      "comparable.\n");
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  std::printf("\n%s\n%.1f s\n", md.c_str(), secs);
  if (!absl::GetFlag(FLAGS_markdown_out).empty()) {
    std::ofstream out(absl::GetFlag(FLAGS_markdown_out), std::ios::trunc);
    out << md;
    out.close();
    if (!out) {
      return absl::DataLossError(
          absl::StrCat("cannot write ", absl::GetFlag(FLAGS_markdown_out)));
    }
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "calibration_validate [--tables=a.txtpb,b.txtpb] [--validate=N] "
      "[--validate_ids=a,b]: measured vs predicted effect of whole KV "
      "allocations");
  absl::ParseCommandLine(argc, argv);
  auto bad = [](const std::string& msg) {
    std::fprintf(stderr, "calibration_validate: %s\n", msg.c_str());
    return kBadFlags;
  };
  const std::vector<std::string> tables =
      absl::StrSplit(absl::GetFlag(FLAGS_tables), ',', absl::SkipWhitespace());
  if (tables.empty()) return bad("--tables is empty");
  if (absl::Status s = triax::ValidateId("--model", absl::GetFlag(FLAGS_model));
      !s.ok()) {
    return bad(std::string(s.message()));
  }
  const std::vector<std::string> ids = absl::StrSplit(
      absl::GetFlag(FLAGS_validate_ids), ',', absl::SkipWhitespace());
  if (ids.empty()) return bad("--validate_ids is empty");
  if (absl::GetFlag(FLAGS_validate) < 0) {
    return bad(absl::StrCat("--validate ", absl::GetFlag(FLAGS_validate),
                            " must be >= 0"));
  }
  const int max_tokens = absl::GetFlag(FLAGS_max_tokens);
  if (max_tokens < 2 || max_tokens > 2048) {
    return bad(absl::StrCat("--max_tokens ", max_tokens,
                            " is outside 2..2048 (kvproxy-18m's context)"));
  }
  const int chunk = absl::GetFlag(FLAGS_chunk);
  if (chunk < 1 || chunk > 256) {
    return bad(absl::StrCat("--chunk ", chunk, " is outside 1..256"));
  }
  const int threads = absl::GetFlag(FLAGS_threads);
  if (threads < 1 || threads > 64) {
    return bad(absl::StrCat("--threads ", threads, " is outside 1..64"));
  }
  const absl::Status s = Run(tables, ids);
  if (!s.ok()) {
    std::fprintf(stderr, "calibration_validate: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
