// Log records and Kv pairs are valid logfmt whatever the values hold.
#include "common/log.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "absl/strings/str_split.h"
#include "common/logfmt.h"
#include "common/status_matchers.h"

namespace triax {
namespace {

using ::testing::HasSubstr;
using ::triax::testing::IsOk;

TEST(KvTest, PlainValuesAreBare) {
  EXPECT_EQ(Kv("worker_id", "w0"), "worker_id=w0");
  EXPECT_EQ(Kv("bytes", uint64_t{4096}), "bytes=4096");
  EXPECT_EQ(Kv("delta", int64_t{-3}), "delta=-3");
  EXPECT_EQ(Kv("ok", true), "ok=true");
  EXPECT_EQ(Kv("ok", false), "ok=false");
  EXPECT_EQ(Kv("path", std::string("/tmp/a.log")), "path=/tmp/a.log");
}

TEST(KvTest, StringsOfEveryTypeAreQuotedWhenTheyNeedIt) {
  // std::string and const char* used to print bare through a template.
  const std::string error = "UNAVAILABLE: connection refused";
  EXPECT_EQ(Kv("error", error), "error=\"UNAVAILABLE: connection refused\"");
  EXPECT_EQ(Kv("error", "a b"), "error=\"a b\"");
  EXPECT_EQ(Kv("error", absl::string_view("a b")), "error=\"a b\"");
  EXPECT_EQ(Kv("empty", ""), "empty=\"\"");
  EXPECT_EQ(Kv("eq", "k=v"), "eq=\"k=v\"");
}

TEST(KvTest, EscapesQuotesBackslashesAndControlBytes) {
  EXPECT_EQ(Kv("m", "say \"hi\""), R"(m="say \"hi\"")");
  EXPECT_EQ(Kv("m", "C:\\dir"), R"(m="C:\\dir")");
  EXPECT_EQ(Kv("m", "a\nb\tc\rd"), R"(m="a\nb\tc\rd")");
  EXPECT_EQ(Kv("m", std::string("x\x01y\x7f", 4)), R"(m="x\u0001y\u007f")");
  // UTF-8 passes through unescaped.
  EXPECT_EQ(Kv("m", "größe"), "m=größe");
}

TEST(KvTest, EveryByteRoundTripsThroughAStrictParser) {
  std::string all;
  for (int c = 1; c < 256; ++c) all.push_back(static_cast<char>(c));
  for (const std::string& v : {all, std::string("\"\"\""), std::string("\\"),
                               std::string(" "), std::string("=")}) {
    auto parsed = ParseLogfmt(Kv("v", v));
    ASSERT_THAT(parsed, IsOk()) << Kv("v", v);
    ASSERT_EQ(parsed->size(), 1u);
    EXPECT_EQ((*parsed)[0].first, "v");
    EXPECT_EQ((*parsed)[0].second, v);
  }
}

TEST(LogfmtParserTest, RejectsWhatIsNotLogfmt) {
  for (const char* line :
       {"", "msg=a b", "msg=\"open", "k", "k=", "=v", "a=1  b=2", "a=1 ",
        "msg=\"bad \\q escape\"", "kvworker: cannot listen", "a=\"x\"y"}) {
    EXPECT_FALSE(ParseLogfmt(line).ok()) << line;
  }
  EXPECT_THAT(ParseLogfmt("a=1 b=\"x y\" c=-"), IsOk());
}

TEST(LogTest, ARecordIsOneLogfmtLineWithTheQuotedMessage) {
  ::testing::internal::CaptureStderr();
  Log(LogLevel::kWarn, "manager", "worker \"w0\" lost:\nconnection reset",
      absl::StrCat(Kv("worker_id", "w0"), " ",
                   Kv("error", std::string("UNAVAILABLE: no route"))));
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_FALSE(err.empty());
  EXPECT_EQ(err.back(), '\n');
  std::vector<std::string> lines = absl::StrSplit(err, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 1u) << err;
  auto record = ParseLogfmt(lines[0]);
  ASSERT_THAT(record, IsOk());
  EXPECT_EQ(LogfmtValue(*record, "level"), "warn");
  EXPECT_EQ(LogfmtValue(*record, "component"), "manager");
  EXPECT_EQ(LogfmtValue(*record, "msg"),
            "worker \"w0\" lost:\nconnection reset");
  EXPECT_EQ(LogfmtValue(*record, "worker_id"), "w0");
  EXPECT_EQ(LogfmtValue(*record, "error"), "UNAVAILABLE: no route");
  EXPECT_THAT(LogfmtValue(*record, "ts"), HasSubstr("T"));
}

TEST(LogTest, JsonFormatIsOneObjectALineWithTypedPairs) {
  SetLogFormat(LogFormat::kJson);
  ::testing::internal::CaptureStderr();
  Log(LogLevel::kError, "worker", "bad \"x\"\n",
      absl::StrCat(Kv("bytes", 42), " ", Kv("error", "a b"), " ",
                   Kv("msg", "dup"), " ", Kv("path", "/tmp/\xff")));
  Log(LogLevel::kInfo, "worker", "raw", "not logfmt");
  const std::string err = ::testing::internal::GetCapturedStderr();
  SetLogFormat(LogFormat::kLogfmt);
  std::vector<std::string> lines = absl::StrSplit(err, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u) << err;
  const nlohmann::json a = nlohmann::json::parse(lines[0], nullptr, false);
  ASSERT_FALSE(a.is_discarded()) << lines[0];
  EXPECT_EQ(a["level"], "error");
  EXPECT_EQ(a["component"], "worker");
  EXPECT_EQ(a["msg"], "bad \"x\"\n");
  EXPECT_EQ(a["bytes"], 42);  // a number
  EXPECT_EQ(a["error"], "a b");
  EXPECT_EQ(a["kv_msg"], "dup");              // the record's msg stays
  EXPECT_EQ(a["path"], "/tmp/\xef\xbf\xbd");  // not UTF-8: U+FFFD
  EXPECT_TRUE(a["ts"].is_string());
  const nlohmann::json b = nlohmann::json::parse(lines[1], nullptr, false);
  ASSERT_FALSE(b.is_discarded()) << lines[1];
  EXPECT_EQ(b["kvs"], "not logfmt");
}

}  // namespace
}  // namespace triax
