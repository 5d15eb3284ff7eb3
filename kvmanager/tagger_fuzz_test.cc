// Deterministic fuzzing of the tagger: valid renderings of each template are
// mutated (byte flips, deletions, truncations, duplicated ranges, inserted
// marker fragments, random templates, continuations, token offsets and BOS
// counts) and every result must be either OK with spans that cover every
// token exactly once, or INVALID_ARGUMENT naming a `rendered.` field. Fixed
// seed; ~100k inputs in a few seconds. (The same loop runs under ASan with
// -DCMAKE_CXX_FLAGS=-fsanitize=address; see docs/manager.md.)
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "kvmanager/tagger.h"

namespace triax::manager {
namespace {

struct Seed {
  ChatTemplate tmpl;
  std::string text;
};

std::vector<Seed> Seeds() {
  return {
      {ChatTemplate::kChatML,
       "<|im_start|>system\nYou are helpful. <tools></tools> tags:\n<tools>\n"
       "{\"name\": \"f\", \"parameters\": {\"a\": [1, 2.5e-3, true, null]}}\n"
       "</tools>\n{\"name\": \"g\"}\n<|im_end|>\n<|im_start|>user\nHi "
       "<|vision_start|><|image_pad|><|vision_end|> <audio><|im_end|>\n"
       "<|im_start|>assistant\n<think>hmm</think>\n<tool_call>\n[f(a=1)]\n"
       "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nok\n"
       "</tool_response><|im_end|>\n<|im_start|>tool\n{\"r\": 1}<|im_end|>\n"
       "<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n<think>x"},
      {ChatTemplate::kLlama3,
       "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
       "Tools:\n{\n  \"name\": \"f\"\n}\nBye<|eot_id|><|start_header_id|>user"
       "<|end_header_id|>\n\n<|image|>What?<|eot_id|><|start_header_id|>"
       "assistant<|end_header_id|>\n\n<|python_tag|>f()<|eom_id|>"
       "<|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|>"
       "<|start_header_id|>user<|end_header_id|>\n\n<|audio_bos|>a"
       "<|audio_eos|><|eot_id|><|start_header_id|>assistant<|end_header_id|>"
       "\n\n<think>"},
      {ChatTemplate::kGeneric,
       "### System:\nBe brief.\n{\"name\": \"s\"}\n### User:\nFind <image>\n"
       "### Assistant:\n<think>go</think><tool_call>s()</tool_call>\n"
       "### Tool:\nfound\n### User:\n### Header\nmore\n### Assistant:\nok"},
  };
}

const std::vector<std::string>& Fragments() {
  static const auto* f = new std::vector<std::string>{"<|im_start|>",
                                                      "<|im_end|>",
                                                      "<|im_start|>user\n",
                                                      "<|im_start|>assistant\n",
                                                      "<|begin_of_text|>",
                                                      "<|start_header_id|>",
                                                      "<|end_header_id|>",
                                                      "<|eot_id|>",
                                                      "<|eom_id|>",
                                                      "<|python_tag|>",
                                                      "### User:\n",
                                                      "### Assistant:\n",
                                                      "### Foo:\n",
                                                      "<think>",
                                                      "</think>",
                                                      "<tool_call>",
                                                      "</tool_call>",
                                                      "<tools>",
                                                      "</tools>",
                                                      "<tool_response>",
                                                      "</tool_response>",
                                                      "<image>",
                                                      "<|vision_start|>",
                                                      "<|vision_end|>",
                                                      "<|audio_start|>",
                                                      "<|audio_end|>",
                                                      "<|image_pad|>",
                                                      "{\"name\": 1}\n",
                                                      "{",
                                                      "}",
                                                      "[",
                                                      "\"",
                                                      "\\",
                                                      "\n",
                                                      "<|",
                                                      "|>",
                                                      "<",
                                                      std::string(1, '\0'),
                                                      "\xff\xfe"};
  return *f;
}

std::string Mutate(std::string s, std::mt19937& rng) {
  auto pick = [&](size_t n) {
    return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n);
  };
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits; ++e) {
    const size_t at = pick(s.size() + 1);
    switch (rng() % 6) {
      case 0:  // flip a byte
        if (!s.empty()) s[pick(s.size())] = static_cast<char>(rng());
        break;
      case 1:  // delete a range
        if (at < s.size()) s.erase(at, 1 + pick(16));
        break;
      case 2:  // truncate
        s.resize(at);
        break;
      case 3: {  // duplicate a range
        if (at < s.size()) {
          const std::string piece = s.substr(at, 1 + pick(40));
          s.insert(pick(s.size() + 1), piece);
        }
        break;
      }
      default: {  // insert a marker, or a prefix of one
        const std::string& f = Fragments()[pick(Fragments().size())];
        s.insert(at, rng() % 4 == 0 ? f.substr(0, pick(f.size() + 1)) : f);
        break;
      }
    }
  }
  return s;
}

TEST(TaggerFuzzTest, MutatedRenderingsNeverCrashAndCoverEveryToken) {
  std::mt19937 rng(20240607);
  const std::vector<Seed> seeds = Seeds();
  const Role kContinues[] = {
      Role::kSystem,    Role::kUser,     Role::kAssistant, Role::kToolResult,
      Role::kReasoning, Role::kToolCall, Role::kDelimiter};
  constexpr int kIterations = 100000;
  int ok = 0, invalid = 0;
  for (int it = 0; it < kIterations; ++it) {
    const Seed& seed = seeds[rng() % seeds.size()];
    RenderedText r;
    r.text = Mutate(seed.text, rng);
    r.chat_template = seed.tmpl;
    if (rng() % 10 == 0) r.chat_template = static_cast<ChatTemplate>(rng() % 5);
    if (rng() % 8 == 0) r.continues = kContinues[rng() % 7];
    if (rng() % 8 == 0) r.bos_tokens = rng() % 3;
    if (rng() % 4 == 0 && !r.text.empty()) {
      // Random token cuts; 1 in 8 times also a broken list.
      r.token_offsets.push_back(0);
      for (uint32_t o = 1 + rng() % 6; o < r.text.size(); o += 1 + rng() % 6)
        r.token_offsets.push_back(o);
      if (rng() % 8 == 0) {
        r.token_offsets[rng() % r.token_offsets.size()] = rng() % 2000;
      }
    }
    const TurnNumbering numbering =
        rng() % 2 ? TurnNumbering::kOpen : TurnNumbering::kContinue;
    auto spans = TagRendered(r, numbering);
    if (!spans.ok()) {
      ++invalid;
      ASSERT_EQ(spans.status().code(), absl::StatusCode::kInvalidArgument)
          << spans.status() << " iteration " << it;
      ASSERT_TRUE(absl::StartsWith(spans.status().message(), "rendered."))
          << spans.status();
      continue;
    }
    ++ok;
    const uint64_t tokens =
        r.token_offsets.empty() ? r.text.size() : r.token_offsets.size();
    uint64_t sum = 0;
    for (size_t k = 0; k < spans->size(); ++k) {
      const TaggedSpan& s = (*spans)[k];
      ASSERT_GE(s.num_tokens, 1u);
      ASSERT_TRUE(IsValid(s.role) && s.role != Role::kUnspecified);
      ASSERT_TRUE(s.modality == Modality::kText ||
                  s.modality == Modality::kImage ||
                  s.modality == Modality::kAudio);
      if (k > 0) {
        const TaggedSpan& p = (*spans)[k - 1];
        ASSERT_GE(s.turn, p.turn);
        ASSERT_FALSE(s.role == p.role && s.modality == p.modality &&
                     s.turn == p.turn);  // merged
      }
      sum += s.num_tokens;
    }
    ASSERT_EQ(sum, tokens + r.bos_tokens) << "iteration " << it;
    ASSERT_LE(spans->back().turn, sum);
  }
  // Both outcomes are exercised.
  EXPECT_GT(ok, kIterations / 20);
  EXPECT_GT(invalid, kIterations / 20);
  std::printf("tagger fuzz: %d accepted, %d rejected\n", ok, invalid);
}

TEST(TaggerFuzzTest, RandomBytesNeverCrash) {
  std::mt19937 rng(7);
  for (int it = 0; it < 20000; ++it) {
    RenderedText r;
    r.chat_template = static_cast<ChatTemplate>(1 + rng() % 3);
    const size_t n = 1 + rng() % 64;
    for (size_t i = 0; i < n; ++i) {
      r.text.push_back(rng() % 3 == 0 ? "<|>/#\n "[rng() % 7]
                                      : static_cast<char>(rng()));
    }
    auto spans = TagRendered(r, TurnNumbering::kOpen);
    if (!spans.ok()) {
      ASSERT_EQ(spans.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
}

}  // namespace
}  // namespace triax::manager
