// kvcalibrate: measures the per-tag, per-encoding distortion of kvproxy-18m
// on BFCL multi-turn conversations and emits a triax.v1.CalibrationTable.
// --metric=attention: the attention-output error (calibration.h);
// --metric=output: the KL / dNLL of the next-token distribution when the
// tag's sealed blocks alone take the encoding (output_calibration.h). The
// table is
// written to --out (text format for *.txtpb / *.textproto / *.pbtxt, binary
// otherwise) and, with --manager, stored by PutCalibration and read back
// with GetCalibration. Runs in process on the CPU kernels; no service is
// needed unless --manager is given. Exit codes: 0 ok, 1 runtime error,
// 2 bad flags (e.g. a held-out id in --ids).
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
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/calibrate/calibration.h"
#include "client/calibrate/calibration_proto.h"
#include "client/calibrate/calibration_rpc.h"
#include "client/calibrate/output_calibration.h"
#include "client/calibrate/sha256.h"
#include "client/frontend/bfcl.h"
#include "client/frontend/data_dir.h"
#include "client/frontend/forward.h"
#include "client/frontend/llama2c.h"
#include "client/kv_client.h"
#include "common/ids.h"
#include "common/status_macros.h"
#include "google/protobuf/text_format.h"

#ifndef KVCALIBRATE_VERSION
#define KVCALIBRATE_VERSION "unknown"
#endif

ABSL_FLAG(std::string, data_dir, "",
          "shared data directory (default $TRIAX_DATA_DIR, else "
          "../shared/data)");
ABSL_FLAG(std::string, model, "kvproxy-18m",
          "model to calibrate: DATA_DIR/models/<model>/model.bin (a "
          "byte-level llama2.c checkpoint); also the table's model id");
ABSL_FLAG(std::string, encodings, "",
          "encodings to measure, ';'-separated names (\"tq4;k=tq4,v=tq3\"); "
          "empty: the default 10 (bf16, fp8, int8, int4, int2, tq4, tq3, "
          "tq2, k=int4,v=int2, k=int8,v=int4)");
ABSL_FLAG(std::string, union_tables, "",
          "comma-separated tables of runs over the same conversations with "
          "different --encodings: write their union to --out / "
          "--markdown_out and measure nothing (calibration_proto.h "
          "UnionTables)");
ABSL_FLAG(std::string, ids,
          "multi_turn_base_1,multi_turn_base_25,multi_turn_base_33,"
          "multi_turn_base_67,multi_turn_base_71,multi_turn_base_102,"
          "multi_turn_base_114,multi_turn_base_142",
          "comma-separated BFCL multi_turn_base ids to calibrate on (default: "
          "8 non-held-out conversations of 4-5 short exchanges, so that "
          "OLDER tags occur within 2048 tokens); held-out ids (kvproxy-18m "
          "README) are refused");
ABSL_FLAG(int, max_tokens, 2048,
          "context per conversation in tokens, BOS included (2..2048); "
          "longer conversations are truncated like kvdemo's");
ABSL_FLAG(std::string, metric, "attention",
          "attention: attention-output error per tag share (one capture "
          "pass per conversation); output: next-token KL / dNLL per tag "
          "share, one forward pass per (tag, encoding) per conversation");
ABSL_FLAG(int, output_chunk, 64,
          "--metric=output: prefill chunk per turn in tokens (1..256), as "
          "policy_bench feeds the service");
ABSL_FLAG(std::string, sums_out, "",
          "--metric=output: write the accumulated sums here after every "
          "conversation (OutputCalibrator::SaveSums), to merge later");
ABSL_FLAG(std::string, merge_sums, "",
          "--metric=output: comma-separated sums files of earlier runs to add "
          "before measuring --ids (which may then be empty: --ids=)");
ABSL_FLAG(int, query_stride, 8,
          "--metric=attention: measure every N-th query position");
ABSL_FLAG(int, first_query, 64,
          "--metric=attention: first measured query position");
ABSL_FLAG(int, threads, 2,
          "threads for the forward pass and measurement (attention) or for "
          "the passes, run in parallel (output)");
ABSL_FLAG(int, chunk, 256, "--metric=attention: prefill chunk in tokens");
ABSL_FLAG(uint32_t, recent_turns, 2,
          "the manager's --recent_turns (turns before the current that are "
          "RECENT_TURNS)");
ABSL_FLAG(std::string, out, "",
          "write the CalibrationTable here (text proto for .txtpb/.textproto/"
          ".pbtxt, else binary)");
ABSL_FLAG(std::string, markdown_out, "", "also write the Markdown table here");
ABSL_FLAG(std::string, manager, "",
          "manager host:port: PutCalibration the table, then GetCalibration "
          "and check it round-trips");
ABSL_FLAG(std::string, tenant, "",
          "tenant id for the client (optional; calibration is not per "
          "tenant)");

namespace {

using namespace triax;            // NOLINT(build/namespaces)
using namespace triax::frontend;  // NOLINT(build/namespaces)
using triax::calibrate::Calibrator;

constexpr int kBadFlags = 2;

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
      .count();
}

absl::Status WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::NotFoundError(absl::StrCat("cannot write ", path));
  out << bytes;
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat("write error on ", path));
  return absl::OkStatus();
}

// Measures the output metric on `ids`, printing every pass; fills the table
// entries, the tokens measured and the predicted positions.
absl::Status MeasureOutput(
    const std::vector<std::string>& ids, const Model& model,
    const BfclData& data,
    std::vector<calibrate::CalibrationResultEntry>* entries,
    int64_t* total_tokens, int64_t* positions,
    std::vector<std::string>* measured_ids) {
  const ModelConfig& cfg = model.config;
  calibrate::OutputCalibratorOptions opt;
  opt.block_tokens = 16;
  opt.recent_turns = absl::GetFlag(FLAGS_recent_turns);
  opt.chunk = absl::GetFlag(FLAGS_output_chunk);
  TRIAX_ASSIGN_OR_RETURN(
      opt.encodings, calibrate::ParseEncodings(absl::GetFlag(FLAGS_encodings)));
  opt.threads = absl::GetFlag(FLAGS_threads);
  TRIAX_ASSIGN_OR_RETURN(calibrate::OutputCalibrator cal,
                         calibrate::OutputCalibrator::Create(cfg, opt));
  for (absl::string_view path : absl::StrSplit(absl::GetFlag(FLAGS_merge_sums),
                                               ',', absl::SkipWhitespace())) {
    std::ifstream in{std::string(path)};
    if (!in) {
      return absl::NotFoundError(
          absl::StrCat("--merge_sums: cannot open \"", path, "\""));
    }
    std::stringstream text;
    text << in.rdbuf();
    TRIAX_RETURN_IF_ERROR(cal.AddSums(text.str(), path));
    std::printf("merged %s: %zu conversations so far\n",
                std::string(path).c_str(), cal.conversation_ids().size());
  }
  if (!cal.conversation_ids().empty()) {
    // Sums files are input too: no held-out conversation may hide in them.
    TRIAX_RETURN_IF_ERROR(
        calibrate::CheckCalibrationIds(cal.conversation_ids()));
  }
  const std::string sums_out = absl::GetFlag(FLAGS_sums_out);
  auto save_sums = [&]() -> absl::Status {
    if (sums_out.empty()) return absl::OkStatus();
    const std::string tmp = sums_out + ".tmp";
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << cal.SaveSums();
      if (!out.flush()) {
        return absl::InternalError(absl::StrCat("cannot write \"", tmp, "\""));
      }
    }
    if (std::rename(tmp.c_str(), sums_out.c_str()) != 0) {
      return absl::InternalError(
          absl::StrCat("cannot rename \"", tmp, "\" to \"", sums_out, "\""));
    }
    return absl::OkStatus();
  };
  ByteTokenizer bt;
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    TRIAX_ASSIGN_OR_RETURN(
        RenderedConversation conv,
        data.Render(ids[i], absl::GetFlag(FLAGS_max_tokens) - 1));
    TRIAX_ASSIGN_OR_RETURN(calibrate::OutputConversation oc,
                           calibrate::PrepareOutputConversation(
                               conv, bt.Encode(conv.text, true), 1,
                               opt.block_tokens, opt.recent_turns, opt.chunk));
    std::printf(
        "[%zu/%zu] %s: %zu tokens, %d of %d exchanges, %zu blocks, %zu tags, "
        "%zu passes\n",
        i + 1, ids.size(), ids[i].c_str(), oc.tokens.size(), conv.turns_kept,
        conv.turns_total, oc.blocks.size(), oc.tags.size(),
        oc.tags.size() * (opt.encodings.size() - 1) + 1);
    std::fflush(stdout);
    TRIAX_RETURN_IF_ERROR(cal.AddConversation(
        model, oc,
        [](const std::string& id, const Tag& tag, const kernels::Encoding& e,
           double seconds, int done, int total) {
          if (done == 0) {
            std::printf("  %s reference pass (all BF16): %.2f s\n", id.c_str(),
                        seconds);
            std::fflush(stdout);
            return;
          }
          char buf[96];
          std::printf("  %s pass %d/%d: %s %s %.2f s\n", id.c_str(), done,
                      total, TagLabel(tag).c_str(),
                      kernels::EncodingName(e, buf, sizeof(buf)), seconds);
          std::fflush(stdout);
        }));
    TRIAX_RETURN_IF_ERROR(save_sums());
    std::printf("[%zu/%zu] %s done in %.1f s\n", i + 1, ids.size(),
                ids[i].c_str(), Since(t0));
    std::fflush(stdout);
  }
  TRIAX_RETURN_IF_ERROR(save_sums());
  if (cal.conversation_ids().empty()) {
    return absl::InvalidArgumentError(
        "nothing to calibrate: --ids is empty and --merge_sums added none");
  }
  *entries = cal.Entries();
  *positions = cal.positions();
  *total_tokens = cal.tokens();
  *measured_ids = cal.conversation_ids();
  return absl::OkStatus();
}

// Writes `table` to --out: text format for .txtpb / .textproto / .pbtxt,
// binary otherwise; nothing when --out is empty.
absl::Status WriteTableOut(const v1::CalibrationTable& table) {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (!out.empty()) {
    std::string bytes;
    if (absl::EndsWith(out, ".txtpb") || absl::EndsWith(out, ".textproto") ||
        absl::EndsWith(out, ".pbtxt")) {
      google::protobuf::TextFormat::PrintToString(table, &bytes);
    } else {
      table.SerializeToString(&bytes);
    }
    TRIAX_RETURN_IF_ERROR(WriteFile(out, bytes));
    std::printf("wrote %s (%zu bytes)\n", out.c_str(), bytes.size());
  }
  return absl::OkStatus();
}

// --union_tables: joins the tables, writes --out and --markdown_out.
absl::Status Union(const std::string& paths) {
  std::vector<v1::CalibrationTable> tables;
  for (absl::string_view path :
       absl::StrSplit(paths, ',', absl::SkipWhitespace())) {
    TRIAX_ASSIGN_OR_RETURN(v1::CalibrationTable t,
                           calibrate::ReadTableFile(std::string(path)));
    std::printf("%s: %d entries\n", std::string(path).c_str(),
                t.entries_size());
    tables.push_back(std::move(t));
  }
  TRIAX_ASSIGN_OR_RETURN(v1::CalibrationTable table,
                         calibrate::UnionTables(tables));
  std::printf("union: %d entries\n", table.entries_size());
  TRIAX_RETURN_IF_ERROR(WriteTableOut(table));
  if (!absl::GetFlag(FLAGS_markdown_out).empty()) {
    TRIAX_RETURN_IF_ERROR(WriteFile(absl::GetFlag(FLAGS_markdown_out),
                                    calibrate::MarkdownTable(table)));
  }
  return absl::OkStatus();
}

absl::Status Run(const std::vector<std::string>& ids) {
  const auto t_start = std::chrono::steady_clock::now();
  const std::string data_dir = ResolveDataDir(absl::GetFlag(FLAGS_data_dir));
  TRIAX_ASSIGN_OR_RETURN(
      calibrate::CalibrationModel loaded,
      calibrate::LoadCalibrationModel(data_dir, absl::GetFlag(FLAGS_model),
                                      absl::GetFlag(FLAGS_max_tokens)));
  const std::string& model_path = loaded.path;
  const std::string& model_name = loaded.name;
  std::unique_ptr<Model> model = std::move(loaded.model);
  TRIAX_ASSIGN_OR_RETURN(const std::string sha,
                         calibrate::Sha256File(model_path));
  TRIAX_ASSIGN_OR_RETURN(BfclData data, BfclData::Load(data_dir));
  const ModelConfig& cfg = model->config;
  const int max_tokens = absl::GetFlag(FLAGS_max_tokens);
  const int threads = absl::GetFlag(FLAGS_threads);
  const bool output = absl::GetFlag(FLAGS_metric) == "output";
  calibrate::CalibratorOptions opt;
  opt.block_tokens = 16;
  opt.recent_turns = absl::GetFlag(FLAGS_recent_turns);
  TRIAX_ASSIGN_OR_RETURN(
      opt.encodings, calibrate::ParseEncodings(absl::GetFlag(FLAGS_encodings)));
  opt.threads = threads;
  TRIAX_ASSIGN_OR_RETURN(Calibrator cal, Calibrator::Create(cfg, opt));
  if (output) {
    std::printf(
        "kvcalibrate %s: %s (sha256 %s), metric output, %zu "
        "conversations, context %d, chunk %d per turn, %d threads\n",
        KVCALIBRATE_VERSION, model_name.c_str(), sha.c_str(), ids.size(),
        max_tokens, absl::GetFlag(FLAGS_output_chunk), threads);
  } else {
    std::printf(
        "kvcalibrate %s: %s (sha256 %s), %zu conversations, "
        "context %d, queries every %d from %d, %d threads\n",
        KVCALIBRATE_VERSION, model_name.c_str(), sha.c_str(), ids.size(),
        max_tokens, absl::GetFlag(FLAGS_query_stride),
        absl::GetFlag(FLAGS_first_query), threads);
  }
  Transformer tf(model.get(), threads);
  ByteTokenizer bt;
  int64_t total_tokens = 0;
  std::vector<calibrate::CalibrationResultEntry> entries;
  int64_t measured = 0;
  std::vector<std::string> calibration_ids = ids;
  if (output) {
    TRIAX_RETURN_IF_ERROR(MeasureOutput(ids, *model, data, &entries,
                                        &total_tokens, &measured,
                                        &calibration_ids));
  }
  for (size_t i = 0; i < ids.size() && !output; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    TRIAX_ASSIGN_OR_RETURN(RenderedConversation conv,
                           data.Render(ids[i], max_tokens - 1));
    const std::vector<int> tokens = bt.Encode(conv.text, true);
    TRIAX_ASSIGN_OR_RETURN(std::vector<calibrate::CalBlock> blocks,
                           calibrate::PlanBlocks(conv, 1, opt.block_tokens));
    LocalKvStore local(cfg);
    calibrate::CaptureKvStore capture(&local, cfg,
                                      absl::GetFlag(FLAGS_first_query),
                                      absl::GetFlag(FLAGS_query_stride));
    std::vector<float> logits;
    TRIAX_RETURN_IF_ERROR(
        tf.Prefill(tokens, 0, absl::GetFlag(FLAGS_chunk), &capture, &logits));
    const double t_fwd = Since(t0);
    absl::Status s = cal.AddConversation(blocks, capture);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat(ids[i], ": ", s.message()));
    }
    total_tokens += static_cast<int64_t>(tokens.size());
    std::printf(
        "[%zu/%zu] %s: %zu tokens, %d of %d exchanges, %d of %d doc lines, "
        "%zu blocks, %zu queries; forward %.1f s, measure %.1f s\n",
        i + 1, ids.size(), ids[i].c_str(), tokens.size(), conv.turns_kept,
        conv.turns_total, conv.docs_kept, conv.docs_total, blocks.size(),
        capture.query_positions().size(), t_fwd, Since(t0) - t_fwd);
    std::fflush(stdout);
  }

  calibrate::TableMeta meta;
  meta.model = model_name;
  meta.shape.set_name(model_name);
  meta.shape.set_n_layers(cfg.n_layers);
  meta.shape.set_n_kv_heads(cfg.n_kv_heads);
  meta.shape.set_n_q_heads(cfg.n_heads);
  meta.shape.set_head_dim(cfg.head_dim());
  meta.block_tokens = opt.block_tokens;
  v1::CalibrationSource& src = meta.source;
  src.set_tool(absl::StrCat("kvcalibrate ", KVCALIBRATE_VERSION));
  src.set_model_file(absl::StrCat(model_path, " sha256:", sha));
  src.set_dataset(absl::StrCat(
      "BFCL v4 multi_turn_base (", data_dir,
      "/bfcl), rendered as ChatML like kvproxy-18m's training (byte tokens), "
      "truncated to ",
      max_tokens, " tokens with BOS"));
  for (const std::string& id : calibration_ids) src.add_calibration_ids(id);
  for (const std::string& id : calibrate::HeldOutIds()) {
    src.add_held_out_ids(id);
  }
  if (output) {
    src.set_metric(calibrate::OutputMetricDescription(
        absl::GetFlag(FLAGS_output_chunk), opt.recent_turns));
  } else {
    src.set_metric(calibrate::MetricDescription(
        absl::GetFlag(FLAGS_query_stride), absl::GetFlag(FLAGS_first_query),
        opt.recent_turns));
    entries = cal.Entries();
    measured = cal.measured_queries();
  }
  src.set_created_unix_ms(absl::ToUnixMillis(absl::Now()));
  TRIAX_ASSIGN_OR_RETURN(v1::CalibrationTable table,
                         calibrate::BuildTable(meta, entries));
  const std::string md = calibrate::MarkdownTable(table);
  std::printf(
      "\n%s\n%d entries from %lld tokens, %lld %s positions; "
      "%.1f s\n",
      md.c_str(), table.entries_size(), static_cast<long long>(total_tokens),
      static_cast<long long>(measured), output ? "predicted" : "query",
      Since(t_start));

  TRIAX_RETURN_IF_ERROR(WriteTableOut(table));
  if (!absl::GetFlag(FLAGS_markdown_out).empty()) {
    TRIAX_RETURN_IF_ERROR(WriteFile(absl::GetFlag(FLAGS_markdown_out), md));
  }
  if (!absl::GetFlag(FLAGS_manager).empty()) {
    client::ClientOptions co;
    co.manager_address = absl::GetFlag(FLAGS_manager);
    co.tenant_id = absl::GetFlag(FLAGS_tenant);
    TRIAX_ASSIGN_OR_RETURN(auto c, client::Client::Connect(co));
    TRIAX_RETURN_IF_ERROR(calibrate::PutAndVerify(c.get(), table));
    std::printf(
        "stored with %s: PutCalibration + GetCalibration round trip "
        "ok (%d entries)\n",
        co.manager_address.c_str(), table.entries_size());
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "kvcalibrate [--metric=attention|output] [--ids=a,b] "
      "[--out=table.txtpb] [--manager=host:port]: per-tag KV quantization "
      "distortion of kvproxy-18m on BFCL");
  absl::ParseCommandLine(argc, argv);
  if (const std::string u = absl::GetFlag(FLAGS_union_tables); !u.empty()) {
    if (absl::GetFlag(FLAGS_out).empty() &&
        absl::GetFlag(FLAGS_markdown_out).empty()) {
      std::fprintf(stderr,
                   "kvcalibrate: --union_tables needs --out or "
                   "--markdown_out\n");
      return kBadFlags;
    }
    const absl::Status s = Union(u);
    if (!s.ok()) {
      std::fprintf(stderr, "kvcalibrate: %s\n", s.ToString().c_str());
      return 1;
    }
    return 0;
  }
  std::vector<std::string> ids =
      absl::StrSplit(absl::GetFlag(FLAGS_ids), ',', absl::SkipWhitespace());
  auto bad = [](const std::string& msg) {
    std::fprintf(stderr, "kvcalibrate: %s\n", msg.c_str());
    return kBadFlags;
  };
  const std::string metric = absl::GetFlag(FLAGS_metric);
  if (metric != "attention" && metric != "output") {
    return bad(
        absl::StrCat("--metric \"", metric, "\" is not attention or output"));
  }
  if (absl::GetFlag(FLAGS_output_chunk) < 1 ||
      absl::GetFlag(FLAGS_output_chunk) > 256) {
    return bad(absl::StrCat("--output_chunk ",
                            absl::GetFlag(FLAGS_output_chunk),
                            " is outside 1..256"));
  }
  if (absl::Status s = triax::ValidateId("--model", absl::GetFlag(FLAGS_model));
      !s.ok()) {
    return bad(std::string(s.message()));
  }
  if (absl::Status s =
          triax::calibrate::ParseEncodings(absl::GetFlag(FLAGS_encodings))
              .status();
      !s.ok()) {
    return bad(std::string(s.message()));
  }
  const bool merging = !absl::GetFlag(FLAGS_merge_sums).empty();
  if (metric != "output" &&
      (merging || !absl::GetFlag(FLAGS_sums_out).empty())) {
    return bad("--sums_out and --merge_sums need --metric=output");
  }
  if (!(merging && ids.empty())) {
    if (absl::Status s = triax::calibrate::CheckCalibrationIds(ids); !s.ok()) {
      return bad(std::string(s.message()));
    }
  }
  const int max_tokens = absl::GetFlag(FLAGS_max_tokens);
  if (max_tokens < 2 || max_tokens > 2048) {
    return bad(absl::StrCat("--max_tokens ", max_tokens,
                            " is outside 2..2048 (kvproxy-18m's context)"));
  }
  if (absl::GetFlag(FLAGS_query_stride) < 1) {
    return bad(absl::StrCat(
        "--query_stride ", absl::GetFlag(FLAGS_query_stride), " must be >= 1"));
  }
  if (absl::GetFlag(FLAGS_first_query) < 0 ||
      absl::GetFlag(FLAGS_first_query) >= max_tokens) {
    return bad(absl::StrCat("--first_query ", absl::GetFlag(FLAGS_first_query),
                            " is outside 0..", max_tokens - 1));
  }
  if (absl::GetFlag(FLAGS_threads) < 1 || absl::GetFlag(FLAGS_threads) > 16) {
    return bad(absl::StrCat("--threads ", absl::GetFlag(FLAGS_threads),
                            " is outside 1..16"));
  }
  if (absl::GetFlag(FLAGS_chunk) < 1) {
    return bad(
        absl::StrCat("--chunk ", absl::GetFlag(FLAGS_chunk), " must be >= 1"));
  }
  const absl::Status s = Run(ids);
  if (!s.ok()) {
    std::fprintf(stderr, "kvcalibrate: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
