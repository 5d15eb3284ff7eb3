#include "common/port_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

#include "common/status_matchers.h"

namespace triax {
namespace {

using ::testing::HasSubstr;
using testing::IsOk;
using testing::StatusIs;

std::string TempDir() {
  std::string dir = ::testing::TempDir() + "/port_file_test_XXXXXX";
  return mkdtemp(dir.data()) != nullptr ? dir : "";
}

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(PortFileTest, WritesThePortAndLeavesNoTemporary) {
  const std::string dir = TempDir();
  ASSERT_FALSE(dir.empty());
  const std::string path = dir + "/port";
  ASSERT_THAT(WritePortFile(path, 41234), IsOk());
  EXPECT_EQ(Read(path), "41234\n");
  // Rewriting replaces the whole file.
  ASSERT_THAT(WritePortFile(path, 7), IsOk());
  EXPECT_EQ(Read(path), "7\n");
  struct stat st;
  EXPECT_NE(stat((path + ".tmp").c_str(), &st), 0);
  unlink(path.c_str());
  rmdir(dir.c_str());
}

TEST(PortFileTest, UnwritableDirectoryIsInternalNamingThePath) {
  EXPECT_THAT(WritePortFile("/nonexistent-dir/sub/port", 1),
              StatusIs(absl::StatusCode::kInternal,
                       HasSubstr("/nonexistent-dir/sub/port.tmp")));
}

TEST(PortFileTest, RenameOntoADirectoryFailsAndCleansUp) {
  const std::string dir = TempDir();
  ASSERT_FALSE(dir.empty());
  const std::string path = dir + "/taken";
  ASSERT_EQ(mkdir(path.c_str(), 0700), 0);
  EXPECT_THAT(WritePortFile(path, 5),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("rename")));
  struct stat st;
  EXPECT_NE(stat((path + ".tmp").c_str(), &st), 0);
  rmdir(path.c_str());
  rmdir(dir.c_str());
}

}  // namespace
}  // namespace triax
