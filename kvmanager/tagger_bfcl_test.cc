// The tagger on the real BFCL renderings of client/frontend (the ChatML
// kvproxy-18m was trained on): its spans from the text alone must equal the
// converter's spans, turn by turn. Skips without the data directory.
#include <gtest/gtest.h>

#include <vector>

#include "client/frontend/bfcl.h"
#include "client/frontend/test_data.h"
#include "kvmanager/tagger.h"

namespace triax::manager {
namespace {

std::vector<TaggedSpan> ConverterSpans(
    const frontend::RenderedConversation& rc) {
  std::vector<TaggedSpan> out;
  for (size_t t = 0; t < rc.turns.size(); ++t) {
    for (const frontend::RoleSpan& s : rc.turns[t].spans) {
      out.push_back(TaggedSpan{static_cast<Role>(s.role), Modality::kText,
                               static_cast<uint32_t>(s.length),
                               static_cast<uint32_t>(t)});
    }
  }
  return out;
}

TEST(TaggerBfclTest, SpansEqualTheConverterOnEveryEntry) {
  const std::string dir = frontend::TestDataDir();
  TRIAX_REQUIRE_DATA_DIR(dir);
  auto data = frontend::BfclData::Load(dir);
  ASSERT_TRUE(data.ok()) << data.status();
  int checked = 0;
  for (const auto& [id, entry] : data->entries()) {
    // Full conversations and ones cut to a context budget.
    for (size_t max_bytes : {size_t{0}, size_t{6000}}) {
      auto rc = data->Render(id, max_bytes);
      if (!rc.ok()) continue;  // nothing fits the budget
      RenderedText r;
      r.text = rc->text;
      r.chat_template = ChatTemplate::kChatML;
      auto spans = TagRendered(r, TurnNumbering::kOpen);
      ASSERT_TRUE(spans.ok()) << id << ": " << spans.status();
      ASSERT_EQ(*spans, ConverterSpans(*rc)) << id;
      ++checked;
    }
  }
  EXPECT_GE(checked, 200);
}

}  // namespace
}  // namespace triax::manager
