#include "common/parse_errors.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/stubs/logging.h>
#include <grpcpp/grpcpp.h>

#include <mutex>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace triax {
namespace {

using grpc::experimental::InterceptionHookPoints;
using grpc::experimental::ServerRpcInfo;

// The field named by the last "invalid UTF-8 when parsing" log line of this
// thread, until an interceptor takes it.
thread_local std::string invalid_utf8_field;

google::protobuf::LogHandler* previous_handler = nullptr;

void NoteInvalidUtf8(google::protobuf::LogLevel level, const char* filename,
                     int line, const std::string& message) {
  // wire_format_lite.cc: "String field '" << name << "' contains invalid
  // UTF-8 data when parsing a protocol buffer. ..." (serializing logs the
  // same with "serializing"; only a refused parse matters here).
  constexpr absl::string_view kPrefix = "String field '";
  if (absl::StartsWith(message, kPrefix) &&
      absl::StrContains(message, "invalid UTF-8 data when parsing")) {
    absl::string_view rest = absl::string_view(message).substr(kPrefix.size());
    invalid_utf8_field = std::string(rest.substr(0, rest.find('\'')));
  }
  if (previous_handler != nullptr) {
    previous_handler(level, filename, line, message);
  }
}

// "/triax.v1.Manager/OpenSequence" -> "triax.v1.OpenSequenceRequest"; the
// method's path when the generated pool does not know it.
std::string RequestType(absl::string_view path) {
  std::string name(absl::StripPrefix(path, "/"));
  const size_t slash = name.rfind('/');
  if (slash != std::string::npos) name[slash] = '.';
  const google::protobuf::MethodDescriptor* m =
      google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(
          name);
  return m != nullptr ? m->input_type()->full_name() : std::string(path);
}

std::string TakeInvalidUtf8Field() {
  return std::exchange(invalid_utf8_field, {});
}

class ParseErrorInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit ParseErrorInterceptor(ServerRpcInfo* info)
      // The registered method's name, which outlives the call; looked up
      // only when a request fails to parse.
      : method_(info->method() != nullptr ? info->method() : ""),
        // Only these receive their request before the handler runs; a
        // stream's null message is also its end, and only a UTF-8 failure
        // (which names the field) tells the two apart.
        request_first_(info->type() == ServerRpcInfo::Type::UNARY ||
                       info->type() == ServerRpcInfo::Type::SERVER_STREAMING) {}

  void Intercept(
      grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            InterceptionHookPoints::POST_RECV_MESSAGE)) {
      // Taken on every message so that a name left by a parse elsewhere on
      // this thread is never reported for another request.
      const std::string field = TakeInvalidUtf8Field();
      if (methods->GetRecvMessage() == nullptr && failure_.empty()) {
        if (!field.empty()) {
          failure_ = absl::StrCat("string field ", field,
                                  " is not valid UTF-8 (proto3 strings must "
                                  "be; send bytes in a bytes field)");
        } else if (request_first_) {
          failure_ = "the bytes are not a valid protobuf message of this type";
        }
      }
    }
    if (!failure_.empty() && methods->QueryInterceptionHookPoint(
                                 InterceptionHookPoints::PRE_SEND_STATUS)) {
      methods->ModifySendStatus(grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrCat("request ", RequestType(method_), ": ", failure_)));
    }
    methods->Proceed();
  }

 private:
  const char* const method_;
  const bool request_first_;
  std::string failure_;
};

class Factory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      ServerRpcInfo* info) override {
    return new ParseErrorInterceptor(info);
  }
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
ParseErrorInterceptorFactory() {
  static std::once_flag once;
  std::call_once(once, [] {
    previous_handler = google::protobuf::SetLogHandler(&NoteInvalidUtf8);
  });
  return std::make_unique<Factory>();
}

}  // namespace triax
