// MetadataLog: records survive a reopen in order; a torn tail of the newest
// segment is dropped, corruption elsewhere is DATA_LOSS; a snapshot replaces
// the segments before it; a second opener of a directory is refused.
#include "kvmanager/metadata_log.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/status_matchers.h"

namespace triax::manager {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::triax::testing::IsOk;
using ::triax::testing::StatusIs;

std::string NewDir() {
  std::string tmpl = (fs::temp_directory_path() / "metalog-XXXXXX").string();
  EXPECT_NE(mkdtemp(tmpl.data()), nullptr);
  return tmpl;
}

// Opens `dir`, replays it into *out (snapshot records prefixed "S:").
absl::StatusOr<std::unique_ptr<MetadataLog>> OpenAndRead(
    const std::string& dir, std::vector<std::string>* out) {
  MetadataLogOptions o;
  o.dir = dir;
  auto log = MetadataLog::Open(o);
  if (!log.ok()) return log.status();
  absl::Status st =
      (*log)->Replay([&](absl::string_view r, bool snap) -> absl::Status {
        out->push_back((snap ? "S:" : "") + std::string(r));
        return absl::OkStatus();
      });
  if (!st.ok()) return st;
  return log;
}

std::vector<std::string> Files(const std::string& dir, const char* prefix) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(prefix, 0) == 0) out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(MetadataLogTest, RecordsSurviveAReopenInOrder) {
  const std::string dir = NewDir();
  {
    std::vector<std::string> seen;
    auto log = OpenAndRead(dir, &seen);
    ASSERT_THAT(log, IsOk());
    EXPECT_TRUE(seen.empty());
    (*log)->Append("one");
    (*log)->Append("two");
    const uint64_t t = (*log)->Append(std::string(100000, 'x'));
    ASSERT_THAT((*log)->Wait(t), IsOk());
    EXPECT_GE((*log)->stats().syncs, 1u);
  }
  std::vector<std::string> seen;
  auto log = OpenAndRead(dir, &seen);
  ASSERT_THAT(log, IsOk());
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_EQ(seen[0], "one");
  EXPECT_EQ(seen[1], "two");
  EXPECT_EQ(seen[2], std::string(100000, 'x'));
}

TEST(MetadataLogTest, ATornTailOfTheNewestSegmentIsDropped) {
  const std::string dir = NewDir();
  {
    std::vector<std::string> seen;
    auto log = OpenAndRead(dir, &seen);
    ASSERT_THAT(log, IsOk());
    (*log)->Append("kept");
    ASSERT_THAT((*log)->Wait((*log)->Append("cut")), IsOk());
  }
  const std::vector<std::string> segs = Files(dir, "wal-");
  ASSERT_FALSE(segs.empty());
  const std::string path = dir + "/" + segs.back();
  const auto size = fs::file_size(path);
  fs::resize_file(path, size - 2);  // the crash cut the last write
  std::vector<std::string> seen;
  auto log = OpenAndRead(dir, &seen);
  ASSERT_THAT(log, IsOk());
  EXPECT_THAT(seen, ElementsAre("kept"));
  EXPECT_EQ(fs::file_size(path), size - (8 + 3));  // truncated there
}

TEST(MetadataLogTest, CorruptionBeforeTheNewestSegmentIsDataLoss) {
  const std::string dir = NewDir();
  for (int i = 0; i < 2; ++i) {  // two runs: two segments
    std::vector<std::string> seen;
    auto log = OpenAndRead(dir, &seen);
    ASSERT_THAT(log, IsOk());
    ASSERT_THAT((*log)->Wait((*log)->Append("record")), IsOk());
  }
  const std::vector<std::string> segs = Files(dir, "wal-");
  ASSERT_GE(segs.size(), 2u);
  {
    std::fstream f(dir + "/" + segs.front(),
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(9);
    f.put('#');  // a payload byte: the CRC no longer matches
  }
  std::vector<std::string> seen;
  auto log = OpenAndRead(dir, &seen);
  EXPECT_THAT(log.status(), StatusIs(absl::StatusCode::kDataLoss,
                                     HasSubstr("is corrupt at byte 0")));
}

TEST(MetadataLogTest, ASnapshotReplacesWhatCameBefore) {
  const std::string dir = NewDir();
  {
    std::vector<std::string> seen;
    auto log = OpenAndRead(dir, &seen);
    ASSERT_THAT(log, IsOk());
    (*log)->Append("old");
    (*log)->AppendSnapshot({"state-a", "state-b"});
    ASSERT_THAT((*log)->Wait((*log)->Append("new")), IsOk());
    EXPECT_EQ((*log)->stats().snapshots, 1u);
  }
  EXPECT_EQ(Files(dir, "snap-").size(), 1u);
  std::vector<std::string> seen;
  auto log = OpenAndRead(dir, &seen);
  ASSERT_THAT(log, IsOk());
  EXPECT_THAT(seen, ElementsAre("S:state-a", "S:state-b", "new"));
  // A second snapshot deletes the first and the segments before it.
  (*log)->AppendSnapshot({"state-c"});
  ASSERT_THAT((*log)->Wait((*log)->Append("newer")), IsOk());
  EXPECT_EQ(Files(dir, "snap-").size(), 1u);
  EXPECT_EQ(Files(dir, "wal-").size(), 1u);
}

TEST(MetadataLogTest, ASecondOpenerIsRefused) {
  const std::string dir = NewDir();
  MetadataLogOptions o;
  o.dir = dir;
  auto first = MetadataLog::Open(o);
  ASSERT_THAT(first, IsOk());
  EXPECT_THAT(MetadataLog::Open(o).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("in use by another kvmanager")));
  first->reset();
  EXPECT_THAT(MetadataLog::Open(o), IsOk());
  o.dir = "";
  EXPECT_THAT(MetadataLog::Open(o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
}

}  // namespace
}  // namespace triax::manager
