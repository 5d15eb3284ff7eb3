// The service's (triax.v1) views of frontend values: the ModelShape of a
// loaded model and the Spans of a BFCL session's token spans. Part of
// triax::frontend_service (the adapter that may include protobuf headers).
//
// Thread contract: pure functions.
#pragma once

#include <cstdint>
#include <vector>

#include "client/frontend/bfcl.h"
#include "client/frontend/bfcl_session.h"
#include "client/frontend/llama2c.h"
#include "triax/v1/types.pb.h"

namespace triax::frontend {

// name, n_layers, n_kv_heads, n_q_heads (= n_heads), head_dim of `model`.
v1::ModelShape ServiceShape(const Model& model);

// A text span: role cast to triax.v1.Role (the values are equal), modality
// MODALITY_TEXT, `num_tokens` tokens.
v1::Span ServiceSpan(Role role, uint32_t num_tokens);
std::vector<v1::Span> ServiceSpans(const std::vector<TokenSpan>& spans);

}  // namespace triax::frontend
