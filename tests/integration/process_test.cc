// The process launcher, driven with kvctl (a binary that needs no server).
#include "tests/integration/process.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>

#include "common/status_matchers.h"

namespace triax::testing {
namespace {

using ::testing::HasSubstr;

TEST(RunToCompletion, CapturesExitCodeAndOutput) {
  auto dir = TempDir::Create("triax-proc");
  ASSERT_THAT(dir, IsOk());
  std::string out, err;
  auto rc =
      RunToCompletion("kvctl", {"no-such-command"}, (*dir)->path(), &out, &err);
  ASSERT_THAT(rc, IsOk());
  EXPECT_EQ(*rc, 2);
  EXPECT_THAT(err, HasSubstr("usage: kvctl"));
}

TEST(ProcessStart, ExitBeforePortFileIsReportedWithLog) {
  auto dir = TempDir::Create("triax-proc");
  ASSERT_THAT(dir, IsOk());
  // kvctl does not know --port_file: it exits 2 at once.
  auto p = Process::Start("kvctl", "kvctl", {"workers"}, (*dir)->path());
  EXPECT_THAT(p, StatusIs(absl::StatusCode::kFailedPrecondition,
                          HasSubstr("unknown flag --port_file")));
}

TEST(ProcessStart, MissingBinary) {
  auto dir = TempDir::Create("triax-proc");
  ASSERT_THAT(dir, IsOk());
  EXPECT_THAT(Process::Start("x", "no-such-binary", {}, (*dir)->path()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no-such-binary")));
}

TEST(ProcessWait, ReturnsTheExitCode) {
  auto dir = TempDir::Create("triax-proc");
  ASSERT_THAT(dir, IsOk());
  auto p = Process::Start("bad", "kvctl", {"frobnicate"}, (*dir)->path(),
                          /*with_port_file=*/false);
  ASSERT_THAT(p, IsOk());
  EXPECT_TRUE((*p)->running());
  auto rc = (*p)->Wait(absl::Seconds(10));
  ASSERT_THAT(rc, IsOk());
  EXPECT_EQ(*rc, 2);
  EXPECT_FALSE((*p)->running());
  EXPECT_THAT((*p)->Log(), HasSubstr("bad command"));
}

TEST(TempDir, RemovedWithItsFiles) {
  std::string path;
  {
    auto dir = TempDir::Create("triax-proc");
    ASSERT_THAT(dir, IsOk());
    path = (*dir)->path();
    FILE* f = fopen((path + "/x").c_str(), "w");
    ASSERT_NE(f, nullptr);
    fclose(f);
  }
  EXPECT_NE(access(path.c_str(), F_OK), 0);
}

}  // namespace
}  // namespace triax::testing
