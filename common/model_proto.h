// proto <-> domain conversion of the shared vocabulary (common/model.h), one
// converter per type, used by both services and the client library.
//
// From the wire, enum values are cast (both sides share numbers); a value
// outside 0..254 becomes 255, so the domain validators refuse it by name
// instead of it wrapping into a valid value. Encodings travel as four fields
// (format = K, format_v = V or unspecified for "same as K", group_size,
// scale_dtype) on v1::BlockPlan, v1::PolicyRule and v1::BlockEncoding; the
// templates below take any of them.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/model.h"
#include "triax/v1/types.pb.h"

namespace triax {

// Wire enum value -> domain enum. Format and ScaleDtype are one byte wide:
// values outside 0..254 map to 255. The int-backed enums take any value.
inline int ClampWireEnum(int wire) {
  return wire >= 0 && wire < 255 ? wire : 255;
}
inline Format FormatFromProto(int wire) {
  return static_cast<Format>(ClampWireEnum(wire));
}
inline Tier TierFromProto(int wire) { return static_cast<Tier>(wire); }

ModelShape FromProto(const v1::ModelShape& p);
void ToProto(const ModelShape& d, v1::ModelShape* p);

Tag FromProto(const v1::Tag& p);
void ToProto(const Tag& d, v1::Tag* p);

// The encoding named by a message's four encoding fields: format_v
// unspecified means the K format, scale_dtype unspecified means FP16, group 0
// stays 0 (= 32). Out-of-range values are kept for ValidateEncodingFields.
template <typename Msg>
Encoding EncodingFromProto(const Msg& m) {
  Encoding e;
  e.k = FormatFromProto(m.format());
  e.v = m.format_v() == v1::FORMAT_UNSPECIFIED ? e.k
                                               : FormatFromProto(m.format_v());
  e.group = static_cast<int>(std::min<uint32_t>(m.group_size(), 1u << 30));
  e.scale_dtype = m.scale_dtype() == v1::SCALE_DTYPE_UNSPECIFIED
                      ? ScaleDtype::kFP16
                      : static_cast<ScaleDtype>(ClampWireEnum(m.scale_dtype()));
  return e;
}

// Sets a message's encoding fields to the canonical wire form of `e`:
// format and format_v always set; group_size and scale_dtype only when K or
// V is an INT format (they mean nothing otherwise), the group as its value
// (0 written as 32).
template <typename Msg>
void EncodingToProto(const Encoding& e, Msg* m) {
  m->set_format(static_cast<v1::Format>(e.k));
  m->set_format_v(static_cast<v1::Format>(e.v));
  if (kernels::IsIntFormat(e.k) || kernels::IsIntFormat(e.v)) {
    m->set_group_size(static_cast<uint32_t>(e.Group()));
    m->set_scale_dtype(static_cast<v1::ScaleDtype>(e.scale_dtype));
  } else {
    m->set_group_size(0);
    m->set_scale_dtype(v1::SCALE_DTYPE_UNSPECIFIED);
  }
}

// The BlockSpec part of a v1::BlockPlan (capacity, tag and refcount are the
// manager's; see kvmanager/convert.h). Tier unspecified stays kUnspecified
// (a worker reads it as kDevice).
BlockSpec FromProto(const v1::BlockPlan& p);
void ToProto(const BlockSpec& d, v1::BlockPlan* p);

}  // namespace triax
