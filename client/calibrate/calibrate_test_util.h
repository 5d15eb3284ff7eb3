// Synthetic conversations and model shapes shared by the calibration tests.
#pragma once

#include <cstddef>
#include <random>

#include "client/frontend/bfcl.h"
#include "client/frontend/llama2c.h"
#include "common/model.h"

namespace triax::calibrate::testutil {

// Turn 0: system header, schema and an exchange; later turns an exchange
// each (span lengths in bytes, like the BFCL renderer's); random letters.
inline frontend::RenderedConversation MakeConversation(int turns,
                                                       int schema_bytes,
                                                       int exchange_bytes) {
  frontend::RenderedConversation c;
  c.id = "synthetic";
  size_t pos = 0;
  auto add = [&](frontend::RenderedTurn* t, Role r, size_t n) {
    t->spans.push_back(frontend::RoleSpan{r, pos, n});
    pos += n;
  };
  for (int t = 0; t < turns; ++t) {
    frontend::RenderedTurn turn;
    turn.begin = pos;
    if (t == 0) {
      add(&turn, Role::kDelimiter, 19);
      add(&turn, Role::kSystem, 40);
      add(&turn, Role::kToolSchema, schema_bytes);
      add(&turn, Role::kDelimiter, 11);
    }
    add(&turn, Role::kDelimiter, 17);
    add(&turn, Role::kUser, exchange_bytes);
    add(&turn, Role::kDelimiter, 33);
    add(&turn, Role::kToolCall, exchange_bytes / 2 + 3);
    add(&turn, Role::kDelimiter, 29);
    add(&turn, Role::kToolResult, 16);
    add(&turn, Role::kDelimiter, 11);
    turn.end = pos;
    c.turns.push_back(turn);
  }
  c.text.assign(pos, 'x');
  std::mt19937 rng(5);
  for (char& ch : c.text) ch = static_cast<char>('a' + rng() % 26);
  return c;
}

// dim 64 = 4 query heads x 16, 2 KV heads, byte vocabulary.
inline frontend::ModelConfig SmallConfig(int layers) {
  frontend::ModelConfig c;
  c.dim = 64;
  c.hidden_dim = 96;
  c.n_layers = layers;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.vocab_size = 260;
  c.max_seq_len = 1024;
  return c;
}

}  // namespace triax::calibrate::testutil
