// Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/;
// docs/fuzzing.md), which are committed; run it again after changing a
// target's input layout:
//   build/bin/make_fuzz_seeds tests/fuzz/corpus [TRIAX_DATA_DIR]
// Seeds of the request-driven targets are written as text-format requests
// here and serialized, so that each is a readable scenario that gets deep
// (opens, extends, forks, demotes, spills, transfers) before the mutations
// start. With the data directory, stories260k's tokenizer.bin is a seed of
// the llama2c target too.
#include <google/protobuf/text_format.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "tests/fuzz/fuzz_util.h"
#include "triax/v1/manager.pb.h"
#include "triax/v1/worker.pb.h"
#include "worker/checksum.h"
#include "worker/tier_store.h"

namespace {

namespace fs = std::filesystem;
using triax::fuzz::AppendRecord;

std::string Text(google::protobuf::Message* m, const std::string& text) {
  if (!google::protobuf::TextFormat::ParseFromString(text, m)) {
    std::fprintf(stderr, "make_fuzz_seeds: bad seed text: %s\n", text.c_str());
    std::exit(1);
  }
  return m->SerializeAsString();
}

template <typename Proto>
void Add(std::string* out, uint8_t op, const std::string& text) {
  Proto p;
  AppendRecord(out, op, Text(&p, text));
}

void Write(const fs::path& dir, const std::string& name,
           const std::string& bytes) {
  fs::create_directories(dir);
  std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out.good()) {
    std::fprintf(stderr, "make_fuzz_seeds: cannot write %s\n",
                 (dir / name).c_str());
    std::exit(1);
  }
}

std::string ReadAll(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)),
                     std::istreambuf_iterator<char>());
}

// --- manager_core (selectors: manager_core_fuzz.cc) -------------------------
const char kModel[] =
    "model { name: 'test' n_layers: 2 n_kv_heads: 2 n_q_heads: 4 head_dim: 64 "
    "}";

void ManagerSeeds(const fs::path& dir) {
  using namespace triax::v1;  // NOLINT(google-build-using-namespace)
  const std::string m = kModel;
  {
    std::string s;
    Add<OpenSequenceRequest>(&s, 0,
                             "request_id: 'o1' tenant_id: 'acme' " + m +
                                 " spans { role: ROLE_SYSTEM num_tokens: 20 }"
                                 " spans { role: ROLE_USER num_tokens: 40 }");
    Add<ExtendSequenceRequest>(
        &s, 1,
        "request_id: 'e1' tenant_id: 'acme' sequence_id: 'seq-1' new_turn: "
        "true spans { role: ROLE_ASSISTANT num_tokens: 30 } spans { role: "
        "ROLE_USER num_tokens: 10 }");
    Add<ForkSequenceRequest>(&s, 2,
                             "tenant_id: 'acme' parent_sequence_id: 'seq-1' "
                             "num_tokens: 50");
    Add<TruncateSequenceRequest>(
        &s, 4, "tenant_id: 'acme' sequence_id: 'seq-1' num_tokens: 70");
    Add<ReportAccessRequest>(&s, 8,
                             "tenant_id: 'acme' sequence_id: 'seq-1' "
                             "lineage_ids: [1, 2] weights: [0.5, 0.25] "
                             "active: true");
    Add<DemoteBlocksRequest>(&s, 7,
                             "tenant_id: 'acme' sequence_id: 'seq-1' blocks "
                             "{ lineage_id: 3 format: FORMAT_INT2 }");
    AppendRecord(&s, 14, "");
    Add<CloseSequenceRequest>(&s, 3, "tenant_id: 'acme' sequence_id: 'seq-2'");
    Add<CloseSequenceRequest>(&s, 3, "tenant_id: 'acme' sequence_id: 'seq-1'");
    Write(dir, "sequence_lifecycle", s);
  }
  {
    std::string s;
    Add<OpenSequenceRequest>(
        &s, 0,
        "tenant_id: 'acme' " + m +
            " rendered { chat_template: CHAT_TEMPLATE_CHATML text: "
            "'<|im_start|>system\\nBe brief.<|im_end|>\\n<|im_start|>user\\n"
            "Hi <image><|im_end|>\\n<|im_start|>assistant\\n<think>x</think>'"
            " bos_tokens: 1 }");
    Add<ExtendSequenceRequest>(
        &s, 1,
        "tenant_id: 'acme' sequence_id: 'seq-1' rendered { chat_template: "
        "CHAT_TEMPLATE_CHATML continues: ROLE_ASSISTANT text: 'ok<|im_end|>\\n"
        "<|im_start|>user\\nmore<|im_end|>\\n' }");
    Add<OpenSequenceRequest>(&s, 0,
                             "tenant_id: 'acme' " + m +
                                 " token_ids: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, "
                                 "11, 12, 13, 14, 15, 16, 17, 18] spans { "
                                 "role: ROLE_USER num_tokens: 18 }");
    Add<OpenSequenceRequest>(&s, 0,
                             "tenant_id: 'acme' " + m +
                                 " token_ids: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, "
                                 "11, 12, 13, 14, 15, 16, 17, 18, 19] spans { "
                                 "role: ROLE_USER num_tokens: 19 }");
    Write(dir, "rendered_and_prefix", s);
  }
  {
    std::string s;
    Add<PutPolicyRequest>(
        &s, 5,
        "policy { name: 'tight' rules { temporal: TEMPORAL_OLDER format: "
        "FORMAT_INT2 } rules { format: FORMAT_INT4 } }");
    Add<PutCalibrationRequest>(
        &s, 6,
        "table { model: 'test' shape { name: 'test' n_layers: 2 n_kv_heads: 2 "
        "n_q_heads: 4 head_dim: 64 } block_tokens: 16 "
        "entries { tag { temporal: TEMPORAL_SINK role: ROLE_SYSTEM } format: "
        "FORMAT_BF16 } entries { tag { temporal: TEMPORAL_CURRENT_TURN role: "
        "ROLE_USER } format: FORMAT_INT4 distortion: 0.01 tokens: 10 queries: "
        "1 } entries { tag { temporal: TEMPORAL_OLDER role: ROLE_USER } "
        "format: FORMAT_INT2 distortion: 0.2 tokens: 10 queries: 1 } }");
    Add<PutPolicyRequest>(&s, 5,
                          "policy { name: 'alloc' budget_bits: 4 "
                          "calibration_model: 'test' candidates { format: "
                          "FORMAT_INT4 } candidates { format: FORMAT_INT2 } }");
    Add<OpenSequenceRequest>(&s, 0,
                             "tenant_id: 'acme' policy: 'alloc' " + m +
                                 " spans { role: ROLE_SYSTEM num_tokens: 16 }"
                                 " spans { role: ROLE_USER num_tokens: 64 }");
    Add<ExtendSequenceRequest>(&s, 1,
                               "tenant_id: 'acme' sequence_id: 'seq-1' "
                               "new_turn: true spans { role: ROLE_USER "
                               "num_tokens: 64 }");
    Add<ExtendSequenceRequest>(&s, 1,
                               "tenant_id: 'acme' sequence_id: 'seq-1' "
                               "new_turn: true spans { role: ROLE_USER "
                               "num_tokens: 64 }");
    Add<OpenSequenceRequest>(&s, 0,
                             "tenant_id: 'acme' policy: 'tight' " + m +
                                 " spans { role: ROLE_USER num_tokens: 33 }");
    Write(dir, "policies_and_calibration", s);
  }
  {
    std::string s;
    Add<RegisterWorkerRequest>(
        &s, 12,
        "worker_id: 'w2' address: '127.0.0.1:9002' backend: 'cpu' "
        "capacity_bytes: 1048576 host_capacity_bytes: 65536 incarnation: 'b'");
    Add<OpenSequenceRequest>(&s, 0,
                             "tenant_id: 'acme' " + m +
                                 " worker_id: 'w1' spans { role: ROLE_USER "
                                 "num_tokens: 48 }");
    TransferSequenceRequest transfer;
    AppendRecord(
        &s, 15,
        std::string(1, '\0') + Text(&transfer,
                                    "tenant_id: 'acme' sequence_id: 'seq-1' "
                                    "destination_worker_id: 'w2'"));
    Add<HeartbeatRequest>(&s, 11,
                          "worker_id: 'w1' incarnation: 'fuzz-1' inventory { "
                          "capacity_bytes: 1073741824 sequence_ids: ['seq-1', "
                          "'seq-9'] restored_lineage_ids: [1] }");
    AppendRecord(&s, 13, std::string("\x05\x00", 2));
    AppendRecord(&s, 13, std::string("\x30\x00", 2));
    Add<RegisterWorkerRequest>(&s, 12,
                               "worker_id: 'w1' address: '127.0.0.1:9001' "
                               "backend: 'cpu' capacity_bytes: 1073741824 "
                               "incarnation: 'fuzz-1' inventory { "
                               "sequence_ids: ['seq-1'] }");
    Write(dir, "workers_and_transfer", s);
  }
  {
    std::string s;
    Add<CreateTenantRequest>(
        &s, 10,
        "request_id: 't' tenant_id: 'small' budgets { tier: TIER_DEVICE "
        "floor_bytes: 0 ceiling_bytes: 70000 } prefix_salt: 'shared'");
    Add<OpenSequenceRequest>(&s, 0,
                             "tenant_id: 'small' " + m +
                                 " spans { role: ROLE_USER num_tokens: 40 }");
    Add<OpenSequenceRequest>(&s, 0,
                             "tenant_id: 'small' " + m +
                                 " spans { role: ROLE_USER num_tokens: 40 }");
    Add<SetBudgetRequest>(&s, 9,
                          "tenant_id: 'small' budget { tier: TIER_DEVICE "
                          "ceiling_bytes: 20000 }");
    AppendRecord(&s, 14, "");
    Write(dir, "tenants_and_budgets", s);
  }
}

// --- worker_core (selectors: worker_core_fuzz.cc) ---------------------------
std::string Floats(size_t n, float base) {
  std::string out(n * 4, '\0');
  for (size_t i = 0; i < n; ++i) {
    const float f = base + static_cast<float>(i % 13) * 0.125f;
    std::memcpy(&out[i * 4], &f, 4);
  }
  return out;
}

void WorkerSeeds(const fs::path& dir) {
  using namespace triax::v1;  // NOLINT(google-build-using-namespace)
  const std::string shape =
      "model { name: 'test' n_layers: 2 n_kv_heads: 2 n_q_heads: 4 "
      "head_dim: 32 } block_tokens: 4 ";
  const std::string blocks =
      "blocks { index: 0 lineage_id: 100 first_token: 0 num_tokens: 4 "
      "format: FORMAT_INT4 } blocks { index: 1 lineage_id: 101 first_token: "
      "4 num_tokens: 4 format: FORMAT_INT4 } blocks { index: 2 lineage_id: "
      "102 first_token: 8 num_tokens: 4 format: FORMAT_BF16 }";
  std::string s;
  Add<AllocatePagesRequest>(
      &s, 0,
      "request_id: 'a' tenant_id: 't' sequence_id: 's' " + shape + blocks);
  for (int layer = 0; layer < 2; ++layer) {
    WriteKVRequest w;
    w.set_tenant_id("t");
    w.set_sequence_id("s");
    KvChunk* c = w.mutable_chunk();
    c->set_layer(layer);
    c->set_first_token(0);
    c->set_num_tokens(12);
    c->set_dtype(KV_DTYPE_F32);
    c->set_k(Floats(12 * 2 * 32, 0.5f * layer));
    c->set_v(Floats(12 * 2 * 32, -0.25f));
    AppendRecord(&s, 1, w.SerializeAsString());
  }
  {
    AttendRequest a;
    a.set_tenant_id("t");
    AttendItem* item = a.add_items();
    item->set_sequence_id("s");
    item->set_layer(0);
    item->set_num_queries(1);
    item->add_positions(12);
    item->set_queries(Floats(4 * 32, 0.1f));
    AppendRecord(&s, 2, a.SerializeAsString());
  }
  Add<ReadKVRequest>(&s, 3,
                     "tenant_id: 't' sequence_id: 's' layer: 1 first_token: 2 "
                     "num_tokens: 6 dtype: KV_DTYPE_BF16");
  Add<SpillRequest>(&s, 6,
                    "tenant_id: 't' sequence_id: 's' lineage_ids: [101] "
                    "tier: TIER_HOST");
  Add<RestoreRequest>(&s, 7,
                      "tenant_id: 't' sequence_id: 's' lineage_ids: [101]");
  Add<SpillRequest>(&s, 6,
                    "tenant_id: 't' sequence_id: 's' lineage_ids: [100, 101] "
                    "tier: TIER_DISK");
  Add<RestoreRequest>(&s, 7,
                      "tenant_id: 't' sequence_id: 's' background: true");
  Add<DemoteRequest>(&s, 5,
                     "tenant_id: 't' sequence_id: 's' blocks { index: 1 "
                     "lineage_id: 101 first_token: 4 num_tokens: 4 format: "
                     "FORMAT_INT2 }");
  Add<WorkerForkRequest>(
      &s, 4,
      "tenant_id: 't' parent_sequence_id: 's' child_sequence_id: 'c' "
      "num_tokens: 6 blocks { index: 0 lineage_id: 100 first_token: 0 "
      "num_tokens: 4 format: FORMAT_INT4 } blocks { index: 1 lineage_id: 200 "
      "first_token: 4 num_tokens: 2 format: FORMAT_INT4 }");
  Add<EvictRequest>(&s, 8,
                    "tenant_id: 't' sequence_id: 's' lineage_ids: [101]");
  Add<GetInventoryRequest>(&s, 10, "describe_sequence_ids: ['s', 'c']");
  Add<FreePagesRequest>(&s, 9, "tenant_id: 't' sequence_id: 'c'");
  Add<FreePagesRequest>(&s, 9, "tenant_id: 't' sequence_id: 's'");
  Write(dir, "store_lifecycle", s);
}

// --- tagger (layout: tagger_fuzz.cc) ----------------------------------------
void TaggerSeeds(const fs::path& dir) {
  const std::pair<const char*, std::pair<std::string, std::string>> seeds[] = {
      {"chatml",
       {std::string("\x01\x00\x01\x03", 4),
        "<|im_start|>system\nYou are helpful.\n<tools>\n{\"name\": \"f\"}\n"
        "</tools><|im_end|>\n<|im_start|>user\nHi <|vision_start|>"
        "<|image_pad|><|vision_end|> <audio><|im_end|>\n<|im_start|>assistant"
        "\n<think>hmm</think>\n<tool_call>\n[f(a=1)]\n</tool_call><|im_end|>"
        "\n<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>"
        "\n<|im_start|>assistant\nDone"}},
      {"llama3",
       {std::string("\x02\x20\x00\x02", 4),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "{\"name\": \"f\", \"parameters\": {}}\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello <|image|>"
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        "<|python_tag|>f()<|eom_id|><|start_header_id|>ipython"
        "<|end_header_id|>\n\n{\"r\": 1}<|eot_id|>"}},
      {"generic",
       {std::string("\x03\x14\x02\x00", 4),
        "### System:\nRules.\n### User:\nQuestion?\n### Assistant:\nAnswer "
        "<tool_call>x</tool_call>\n### Tool:\nresult\n"}},
      {"continuation",
       {std::string("\x01\x14\x00\x05", 4),
        "more text<|im_end|>\n<|im_start|>user\nnext<|im_end|>\n"}},
  };
  for (const auto& [name, seed] : seeds) {
    Write(dir, name, seed.first + seed.second);
  }
}

// --- spill_file (layout: spill_file_fuzz.cc) --------------------------------
void PutU32(std::string* s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s->push_back(static_cast<char>(v >> (8 * i)));
}
void PutU64(std::string* s, uint64_t v) {
  for (int i = 0; i < 8; ++i) s->push_back(static_cast<char>(v >> (8 * i)));
}

void SpillSeeds(const fs::path& dir) {
  // The valid file of page `damaged` of the block the target spills, for a
  // few page sizes and page counts.
  const std::pair<size_t, uint8_t> cases[] = {
      {1, 0x00}, {300, 0x11}, {4096, 0x22}, {64, 0x02}};
  for (const auto& [page_bytes, layout] : cases) {
    const size_t pages = layout % 3 + 1;
    const uint32_t damaged = ((layout >> 4) & 3) % pages;
    std::string page(page_bytes, '\0');
    for (size_t i = 0; i < page_bytes; ++i) {
      page[i] = static_cast<char>(
          triax::fuzz::SpillPatternByte(i, damaged, page_bytes));
    }
    const uint32_t crc = triax::worker::Crc32c(
        reinterpret_cast<const uint8_t*>(page.data()), page.size());
    std::string file = "TRXKVPG1";
    PutU32(&file, 1);
    PutU32(&file, damaged);
    PutU64(&file, 7);
    PutU64(&file, page_bytes);
    PutU32(&file, crc);
    PutU32(&file, triax::worker::Crc32c(
                      reinterpret_cast<const uint8_t*>(file.data()), 36));
    file += page;
    const size_t stored = page_bytes - 1;  // the target adds 1
    std::string input;
    input.push_back(static_cast<char>(stored & 0xff));
    input.push_back(static_cast<char>(stored >> 8));
    input.push_back(static_cast<char>(layout));
    Write(dir,
          "valid_" + std::to_string(page_bytes) + "_" + std::to_string(pages),
          input + file);
  }
}

// --- calibration_table (layout: calibration_table_fuzz.cc) ------------------
void CalibrationSeeds(const fs::path& dir, const fs::path& source_dir) {
  const std::string table_text =
      ReadAll(source_dir / "bench/results/calibration_kvproxy-18m.txtpb");
  triax::v1::CalibrationTable table;
  if (!google::protobuf::TextFormat::ParseFromString(table_text, &table)) {
    std::fprintf(stderr, "make_fuzz_seeds: cannot parse the bench table\n");
    std::exit(1);
  }
  // A few entries keep the seeds small and each run fast.
  while (table.entries_size() > 12) table.mutable_entries()->RemoveLast();
  std::string text;
  google::protobuf::TextFormat::PrintToString(table, &text);
  Write(dir, "kvproxy_text", "\x01" + text);
  Write(dir, "kvproxy_binary",
        std::string(1, '\0') + table.SerializeAsString());
}

// --- llama2c (layout: llama2c_fuzz.cc) --------------------------------------
void Llama2cSeeds(const fs::path& dir, const fs::path& data_dir) {
  // dim 8, hidden 16, 1 layer, 2 heads, 1 KV head, vocab 16, seq 16.
  const int32_t header[] = {1, 8, 16, 1, 2, 1, 16, 16};
  for (const bool shared : {true, false}) {
    std::string model;
    PutU32(&model, 0x616b3432);
    for (int32_t v : header) PutU32(&model, static_cast<uint32_t>(v));
    model.push_back(shared ? 1 : 0);
    model.resize(256, '\0');
    const size_t weights = 16 + 8 + 128 + 192 + 384 + (shared ? 0 : 128);
    model += Floats(weights, 0.01f);
    Write(dir, shared ? "model_shared" : "model_unshared",
          std::string(1, '\0') + model);
  }
  const char* pieces[] = {"<unk>", "<s>", "</s>", " ",  "a",
                          "b",     "ab",  " a",   "O",  "n",
                          "c",     "e",   "on",   "ce", "\xc3\xa9"};
  std::string tok;
  PutU32(&tok, 15);  // the target's vocab_size: every piece
  PutU32(&tok, 5);   // max_token_length
  float score = 0;
  for (const char* p : pieces) {
    std::string f(4, '\0');
    std::memcpy(&f[0], &score, 4);
    tok += f;
    PutU32(&tok, static_cast<uint32_t>(std::strlen(p)));
    tok += p;
    score -= 1;
  }
  Write(dir, "tokenizer_small", "\x01" + tok);
  const fs::path real = data_dir / "models/stories260k/tokenizer.bin";
  if (!data_dir.empty() && fs::exists(real)) {
    std::string input = "\x01";
    PutU32(&input, 512);
    Write(dir, "tokenizer_stories260k", input + ReadAll(real));
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr,
                 "usage: make_fuzz_seeds CORPUS_DIR SOURCE_DIR [DATA_DIR]\n");
    return 2;
  }
  const fs::path out(argv[1]);
  const fs::path source(argv[2]);
  const fs::path data = argc > 3 ? fs::path(argv[3]) : fs::path();
  ManagerSeeds(out / "manager_core");
  WorkerSeeds(out / "worker_core");
  TaggerSeeds(out / "tagger");
  SpillSeeds(out / "spill_file");
  CalibrationSeeds(out / "calibration_table", source);
  Llama2cSeeds(out / "llama2c", data);
  std::printf("make_fuzz_seeds: wrote %s\n", out.c_str());
  return 0;
}
