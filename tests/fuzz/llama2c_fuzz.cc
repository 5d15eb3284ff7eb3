// Fuzz target: the llama2.c loaders of the reference frontend
// (client/frontend/llama2c.h), which read model and tokenizer files that
// may be damaged or hostile. Input layout:
//   [0] even: the rest is a model file, parsed with ParseModel; a model that
//       parses must have every tensor view inside its storage.
//   [0] odd:  [1, 5) vocab_size (int32 little-endian), [5, ..) a
//       tokenizer.bin read with BpeTokenizer::Load; a tokenizer that loads
//       encodes and decodes a few texts (ids in range, Printable of every
//       pair of neighbours).
// Refusals must be INVALID_ARGUMENT, DATA_LOSS or NOT_FOUND with a message,
// and a loader must not allocate for sizes the file cannot hold.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "client/frontend/llama2c.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

[[noreturn]] void Fail(const char* why) {
  std::fprintf(stderr, "fuzz_llama2c: %s\n", why);
  std::abort();
}

const std::string& TokenizerPath() {
  static const std::string* path = [] {
    std::string tmpl = "/tmp/triax-fuzz-llama2c-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) std::abort();
    return new std::string(tmpl + "/tokenizer.bin");
  }();
  return *path;
}

void CheckModel(absl::string_view bytes) {
  using triax::frontend::Model;
  auto m = triax::frontend::ParseModel(bytes, "fuzz.bin");
  triax::fuzz::FuzzCheck(m, "ParseModel");
  if (!m.ok()) return;
  const Model& model = **m;
  const float* begin = model.storage.data();
  const float* end = begin + model.storage.size();
  for (const float* view :
       {model.attention_norm, model.ffn_norm, model.final_norm,
        model.tok_embeddings, model.wq, model.wk, model.wv, model.wo, model.w1,
        model.w2, model.w3, model.classifier}) {
    if (view < begin || view >= end) Fail("a tensor view outside storage");
  }
}

void CheckTokenizer(absl::string_view input) {
  if (input.size() < 4) return;
  int32_t vocab_size;
  std::memcpy(&vocab_size, input.data(), 4);
  {
    std::ofstream out(TokenizerPath(), std::ios::binary | std::ios::trunc);
    out.write(input.data() + 4, static_cast<std::streamsize>(input.size() - 4));
    if (!out.good()) Fail("cannot write the tokenizer file");
  }
  auto t = triax::frontend::BpeTokenizer::Load(TokenizerPath(), vocab_size);
  triax::fuzz::FuzzCheck(t, "BpeTokenizer::Load");
  if (!t.ok()) return;
  const std::string tail(
      input.substr(input.size() > 68 ? input.size() - 64 : 4));
  for (const std::string& text : {std::string("Once upon a time"),
                                  std::string("\xe2\x82\xac \x01"), tail}) {
    const std::vector<int> ids = (*t)->Encode(text, /*bos=*/true);
    int prev = (*t)->bos_id();
    for (int id : ids) {
      if (id < 0 || id >= (*t)->vocab_size()) Fail("an id out of range");
      (void)(*t)->Printable(prev, id);
      prev = id;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const absl::string_view rest(reinterpret_cast<const char*>(data + 1),
                               size - 1);
  if (data[0] & 1) {
    CheckTokenizer(rest);
  } else {
    CheckModel(rest);
  }
  return 0;
}
