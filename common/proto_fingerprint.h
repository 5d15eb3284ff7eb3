// The fingerprint of a wire request, for IdempotencyCache (idempotency.h):
// a hash of its deterministic serialization, so that a retried request (the
// same message) has the same fingerprint and a request id reused for other
// fields another one. The request id itself is part of the hash; requests
// are only compared under the same id. The converters compute it only for
// requests with a request id (one serialization of the request).
#pragma once

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/message.h>

#include <cstdint>
#include <string>

#include "common/idempotency.h"

namespace triax {

inline uint64_t ProtoFingerprint(const google::protobuf::Message& m) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream out(&bytes);
    google::protobuf::io::CodedOutputStream coded(&out);
    coded.SetSerializationDeterministic(true);
    m.SerializeToCodedStream(&coded);
  }
  return FingerprintAdd(0, bytes);
}

}  // namespace triax
