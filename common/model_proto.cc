#include "common/model_proto.h"

namespace triax {

ModelShape FromProto(const v1::ModelShape& p) {
  ModelShape d;
  d.name = p.name();
  d.n_layers = p.n_layers();
  d.n_kv_heads = p.n_kv_heads();
  d.n_q_heads = p.n_q_heads();
  d.head_dim = p.head_dim();
  return d;
}

void ToProto(const ModelShape& d, v1::ModelShape* p) {
  p->set_name(d.name);
  p->set_n_layers(d.n_layers);
  p->set_n_kv_heads(d.n_kv_heads);
  p->set_n_q_heads(d.n_q_heads);
  p->set_head_dim(d.head_dim);
}

Tag FromProto(const v1::Tag& p) {
  Tag d;
  d.temporal = static_cast<Temporal>(p.temporal());
  d.modality = static_cast<Modality>(p.modality());
  d.role = static_cast<Role>(p.role());
  return d;
}

void ToProto(const Tag& d, v1::Tag* p) {
  p->set_temporal(static_cast<v1::Temporal>(d.temporal));
  p->set_modality(static_cast<v1::Modality>(d.modality));
  p->set_role(static_cast<v1::Role>(d.role));
}

BlockSpec FromProto(const v1::BlockPlan& p) {
  BlockSpec d;
  d.index = p.index();
  d.lineage_id = p.lineage_id();
  d.first_token = p.first_token();
  d.num_tokens = p.num_tokens();
  d.encoding = EncodingFromProto(p);
  d.tier = TierFromProto(p.tier());
  d.evicted = p.evicted();
  return d;
}

void ToProto(const BlockSpec& d, v1::BlockPlan* p) {
  p->set_index(d.index);
  p->set_lineage_id(d.lineage_id);
  p->set_first_token(d.first_token);
  p->set_num_tokens(d.num_tokens);
  EncodingToProto(d.encoding, p);
  p->set_tier(static_cast<v1::Tier>(d.tier));
  p->set_evicted(d.evicted);
}

}  // namespace triax
