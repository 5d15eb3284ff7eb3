#include "client/frontend/bfcl_session.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/frontend/llama2c.h"

namespace triax::frontend {

int64_t BfclSession::num_focus() const {
  return std::count(focus.begin(), focus.end(), true);
}

std::vector<TokenSpan> BfclSession::AllSpans() const {
  std::vector<TokenSpan> all;
  for (const auto& t : turns) {
    all.insert(all.end(), t.spans.begin(), t.spans.end());
  }
  return all;
}

absl::StatusOr<BfclSession> MakeBfclSession(const RenderedConversation& conv,
                                            const BfclSessionOptions& options) {
  if (options.max_turns < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_turns=", options.max_turns, "; must be >= 0"));
  }
  if (conv.turns.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("conversation \"", conv.id, "\" has no turns"));
  }
  size_t n_turns = conv.turns.size();
  if (options.max_turns > 0) {
    n_turns = std::min(n_turns, static_cast<size_t>(options.max_turns));
  }
  // Cut after the last kept turn when turns were dropped.
  const size_t text_bytes = n_turns < conv.turns.size()
                                ? conv.turns[n_turns - 1].end
                                : conv.text.size();
  size_t expect = 0;  // the next turn's and span's first byte
  for (size_t t = 0; t < n_turns; ++t) {
    const RenderedTurn& turn = conv.turns[t];
    if (turn.begin != expect || turn.end < turn.begin ||
        turn.end > std::min(text_bytes, conv.text.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("conversation \"", conv.id, "\" turn ", t, ": bytes [",
                       turn.begin, ", ", turn.end, ") do not follow at byte ",
                       expect, " within ", conv.text.size(), " bytes of text"));
    }
    for (const RoleSpan& r : turn.spans) {
      if (r.begin != expect || r.begin + r.length > turn.end) {
        return absl::InvalidArgumentError(absl::StrCat(
            "conversation \"", conv.id, "\" turn ", t, ": span at byte ",
            r.begin, " of ", r.length, " bytes does not follow at byte ",
            expect, " within the turn's [", turn.begin, ", ", turn.end, ")"));
      }
      expect = r.begin + r.length;
    }
    if (expect != turn.end) {
      return absl::InvalidArgumentError(absl::StrCat(
          "conversation \"", conv.id, "\" turn ", t, ": spans end at byte ",
          expect, ", the turn at ", turn.end));
    }
  }

  BfclSession s;
  s.id = conv.id;
  s.tokens = ByteTokenizer().Encode(
      absl::string_view(conv.text).substr(0, text_bytes), /*bos=*/true);
  s.focus.assign(s.tokens.size(), false);
  for (size_t t = 0; t < n_turns; ++t) {
    const RenderedTurn& turn = conv.turns[t];
    BfclSessionTurn out;
    for (const RoleSpan& r : turn.spans) {
      // BOS joins the first span.
      out.spans.push_back(
          {r.role, static_cast<uint32_t>(r.length + (r.begin == 0 ? 1 : 0))});
      if (std::find(options.focus_roles.begin(), options.focus_roles.end(),
                    r.role) != options.focus_roles.end()) {
        std::fill_n(s.focus.begin() + 1 + r.begin, r.length, true);
      }
    }
    out.first = t == 0 ? 0 : static_cast<int64_t>(turn.begin) + 1;
    out.end = static_cast<int64_t>(turn.end) + 1;
    s.turns.push_back(std::move(out));
  }
  return s;
}

}  // namespace triax::frontend
