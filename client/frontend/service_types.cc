#include "client/frontend/service_types.h"

namespace triax::frontend {

v1::ModelShape ServiceShape(const Model& model) {
  v1::ModelShape s;
  s.set_name(model.name);
  s.set_n_layers(model.config.n_layers);
  s.set_n_kv_heads(model.config.n_kv_heads);
  s.set_n_q_heads(model.config.n_heads);
  s.set_head_dim(model.config.head_dim());
  return s;
}

v1::Span ServiceSpan(Role role, uint32_t num_tokens) {
  v1::Span s;
  s.set_role(static_cast<v1::Role>(role));
  s.set_modality(v1::MODALITY_TEXT);
  s.set_num_tokens(num_tokens);
  return s;
}

std::vector<v1::Span> ServiceSpans(const std::vector<TokenSpan>& spans) {
  std::vector<v1::Span> out;
  out.reserve(spans.size());
  for (const TokenSpan& s : spans) {
    out.push_back(ServiceSpan(s.role, s.num_tokens));
  }
  return out;
}

}  // namespace triax::frontend
