#include "kvmanager/metadata_log.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log.h"

namespace triax::manager {

namespace {

namespace fs = std::filesystem;

// A frame longer than this is corrupt (a snapshot's records are chunked far
// below it).
constexpr uint32_t kMaxFrame = 1u << 30;

absl::Status Errno(absl::string_view what, const std::string& path) {
  return absl::InternalError(
      absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

uint32_t Crc(absl::string_view s) {
  return static_cast<uint32_t>(crc32(0L,
                                     reinterpret_cast<const Bytef*>(s.data()),
                                     static_cast<uInt>(s.size())));
}

void PutU32(uint32_t v, std::string* out) {
  char b[4];
  for (int i = 0; i < 4; ++i) b[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  out->append(b, 4);
}

uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) {
    v |= uint32_t{static_cast<unsigned char>(p[i])} << (8 * i);
  }
  return v;
}

std::string SegmentName(uint64_t n) {
  return absl::StrFormat("wal-%016d.log", n);
}
std::string SnapshotName(uint64_t n) {
  return absl::StrFormat("snap-%016d.pb", n);
}

// "wal-<n>.log" / "snap-<n>.pb" -> n; false for other names.
bool ParseName(const std::string& name, absl::string_view prefix,
               absl::string_view suffix, uint64_t* n) {
  if (name.size() != prefix.size() + 16 + suffix.size()) return false;
  if (!absl::StartsWith(name, prefix) || !absl::EndsWith(name, suffix)) {
    return false;
  }
  return absl::SimpleAtoi(absl::string_view(name).substr(prefix.size(), 16), n);
}

absl::Status WriteAll(int fd, absl::string_view data, const std::string& path) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("cannot write", path);
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

absl::Status SyncDir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Errno("cannot open directory", dir);
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return Errno("cannot fsync directory", dir);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Errno("cannot read", path);
  return std::string(std::istreambuf_iterator<char>(in),
                     std::istreambuf_iterator<char>());
}

}  // namespace

void AppendFrame(absl::string_view payload, std::string* out) {
  PutU32(static_cast<uint32_t>(payload.size()), out);
  PutU32(Crc(payload), out);
  out->append(payload.data(), payload.size());
}

absl::StatusOr<size_t> ForEachFrame(
    absl::string_view data, bool from_snapshot,
    const std::function<absl::Status(absl::string_view, bool)>& fn) {
  size_t off = 0;
  while (off + 8 <= data.size()) {
    const uint32_t len = GetU32(data.data() + off);
    const uint32_t crc = GetU32(data.data() + off + 4);
    if (len > kMaxFrame || off + 8 + len > data.size()) break;
    const absl::string_view payload = data.substr(off + 8, len);
    if (Crc(payload) != crc) break;
    if (absl::Status st = fn(payload, from_snapshot); !st.ok()) return st;
    off += 8 + len;
  }
  return off;
}

MetadataLog::MetadataLog(const MetadataLogOptions& options)
    : options_(options) {}

absl::StatusOr<std::unique_ptr<MetadataLog>> MetadataLog::Open(
    const MetadataLogOptions& options) {
  if (options.dir.empty()) {
    return absl::InvalidArgumentError("metadata directory is empty");
  }
  std::error_code ec;
  fs::create_directories(options.dir, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("cannot create metadata directory ",
                                            options.dir, ": ", ec.message()));
  }
  std::unique_ptr<MetadataLog> log(new MetadataLog(options));
  const std::string lock_path = options.dir + "/LOCK";
  log->lock_fd_ = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (log->lock_fd_ < 0) return Errno("cannot open", lock_path);
  if (::flock(log->lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat(
          "metadata directory ", options.dir,
          " is in use by another kvmanager (", lock_path, " is locked)"));
    }
    return Errno("cannot lock", lock_path);
  }
  return log;
}

MetadataLog::~MetadataLog() {
  StopWriter();
  if (segment_fd_ >= 0) ::close(segment_fd_);
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the flock
}

// --- GroupCommitLog
// ------------------------------------------------------------

GroupCommitLog::~GroupCommitLog() { StopWriter(); }

void GroupCommitLog::StopWriter() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (writer_.joinable()) writer_.join();
}

absl::Status GroupCommitLog::Replay(
    const std::function<absl::Status(absl::string_view, bool)>& fn) {
  if (absl::Status st = ReplayStored(fn); !st.ok()) return st;
  writer_ = std::thread([this] { WriterLoop(); });
  return absl::OkStatus();
}

// --- MetadataLog (files)
// --------------------------------------------------------

absl::Status MetadataLog::ReplayStored(
    const std::function<absl::Status(absl::string_view, bool)>& fn) {
  std::vector<uint64_t> segments;
  std::vector<uint64_t> snapshots;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(options_.dir, ec)) {
    const std::string name = entry.path().filename().string();
    uint64_t n = 0;
    if (ParseName(name, "wal-", ".log", &n)) {
      segments.push_back(n);
    } else if (ParseName(name, "snap-", ".pb", &n)) {
      snapshots.push_back(n);
    } else if (name.size() > 4 && name.substr(name.size() - 4) == ".tmp") {
      fs::remove(entry.path(), ec);  // a snapshot the crash cut short
    }
  }
  if (ec) {
    return absl::InternalError(absl::StrCat("cannot list metadata directory ",
                                            options_.dir, ": ", ec.message()));
  }
  std::sort(segments.begin(), segments.end());
  std::sort(snapshots.begin(), snapshots.end());
  uint64_t first = 0;
  if (!snapshots.empty()) {
    first = snapshots.back();
    const std::string path = options_.dir + "/" + SnapshotName(first);
    absl::StatusOr<std::string> data = ReadFile(path);
    if (!data.ok()) return data.status();
    absl::StatusOr<size_t> end = ForEachFrame(*data, true, fn);
    if (!end.ok()) return end.status();
    if (*end != data->size()) {
      return absl::DataLossError(absl::StrCat("metadata snapshot ", path,
                                              " is corrupt at byte ", *end,
                                              " of ", data->size()));
    }
  }
  uint64_t last = first;
  for (size_t i = 0; i < segments.size(); ++i) {
    const uint64_t n = segments[i];
    last = std::max(last, n);
    if (n < first) continue;  // replaced by the snapshot
    const std::string path = options_.dir + "/" + SegmentName(n);
    absl::StatusOr<std::string> data = ReadFile(path);
    if (!data.ok()) return data.status();
    absl::StatusOr<size_t> end = ForEachFrame(*data, false, fn);
    if (!end.ok()) return end.status();
    if (*end == data->size()) continue;
    if (i + 1 != segments.size()) {
      return absl::DataLossError(
          absl::StrCat("metadata log ", path, " is corrupt at byte ", *end,
                       " of ", data->size(), " and is not the newest segment"));
    }
    // The newest segment's tail: a write the crash cut. Drop it.
    Log(LogLevel::kWarn, "metadata",
        absl::StrCat("dropping a torn tail of ", path, ": bytes ", *end, "..",
                     data->size()));
    if (::truncate(path.c_str(), static_cast<off_t>(*end)) != 0) {
      return Errno("cannot truncate", path);
    }
  }
  return OpenSegment(last + 1);
}

absl::Status MetadataLog::OpenSegment(uint64_t n) {
  const std::string path = options_.dir + "/" + SegmentName(n);
  const int fd =
      ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("cannot open", path);
  if (segment_fd_ >= 0) ::close(segment_fd_);
  segment_fd_ = fd;
  segment_ = n;
  if (absl::Status st = SyncDir(options_.dir); !st.ok()) return st;
  absl::MutexLock lock(&mu_);
  stats_.segment = n;
  return absl::OkStatus();
}

uint64_t GroupCommitLog::Append(std::string record) {
  absl::MutexLock lock(&mu_);
  Item item;
  item.seq = next_seq_++;
  stats_.appended_records++;
  stats_.appended_bytes += record.size() + 8;
  stats_.bytes_since_snapshot += record.size() + 8;
  item.record = std::move(record);
  queue_.push_back(std::move(item));
  return queue_.back().seq;
}

uint64_t GroupCommitLog::AppendSnapshot(std::vector<std::string> records) {
  absl::MutexLock lock(&mu_);
  Item item;
  item.seq = next_seq_++;
  item.is_snapshot = true;
  item.snapshot = std::move(records);
  stats_.bytes_since_snapshot = 0;
  queue_.push_back(std::move(item));
  return queue_.back().seq;
}

absl::Status GroupCommitLog::Wait(uint64_t seq) {
  struct Arg {
    GroupCommitLog* log;
    uint64_t seq;
  } arg{this, seq};
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](Arg* a) {
        a->log->mu_.AssertHeld();
        return a->log->durable_seq_ >= a->seq || !a->log->failed_.ok();
      },
      &arg));
  return failed_;
}

void GroupCommitLog::OnDurable(uint64_t seq,
                               std::function<void(const absl::Status&)> fn) {
  absl::Status now;
  {
    absl::MutexLock lock(&mu_);
    if (durable_seq_ < seq && failed_.ok()) {
      callbacks_.emplace(seq, std::move(fn));
      return;
    }
    now = failed_;
  }
  fn(now);
}

MetadataLogStats GroupCommitLog::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void GroupCommitLog::WriterLoop() {
  for (;;) {
    std::deque<Item> batch;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](GroupCommitLog* l) {
            l->mu_.AssertHeld();
            return l->stop_ || !l->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // stopping, nothing left
      batch.swap(queue_);
    }
    absl::Status st;
    uint64_t last = 0;
    uint64_t syncs = 0;
    std::vector<const std::string*> records;
    auto flush = [&]() -> absl::Status {
      if (records.empty()) return absl::OkStatus();
      ++syncs;
      absl::Status w = WriteRecords(records);
      records.clear();
      return w;
    };
    for (Item& item : batch) {
      last = item.seq;
      if (!item.is_snapshot) {
        records.push_back(&item.record);
        continue;
      }
      st = flush();
      if (st.ok()) st = WriteSnapshot(item.snapshot);
      if (!st.ok()) break;
    }
    if (st.ok()) st = flush();
    std::vector<std::function<void(const absl::Status&)>> ready;
    {
      absl::MutexLock lock(&mu_);
      stats_.syncs += syncs;
      if (!st.ok()) {
        failed_ = st;
        Log(LogLevel::kError, "metadata",
            absl::StrCat("metadata log write failed: ", st.message()));
      } else {
        durable_seq_ = last;
      }
      auto end =
          st.ok() ? callbacks_.upper_bound(durable_seq_) : callbacks_.end();
      for (auto it = callbacks_.begin(); it != end; ++it) {
        ready.push_back(std::move(it->second));
      }
      callbacks_.erase(callbacks_.begin(), end);
    }
    for (auto& fn : ready) fn(st);
    if (!st.ok()) return;
  }
}

absl::Status MetadataLog::WriteRecords(
    const std::vector<const std::string*>& records) {
  std::string buffer;
  for (const std::string* r : records) AppendFrame(*r, &buffer);
  const std::string path = options_.dir + "/" + SegmentName(segment_);
  if (absl::Status w = WriteAll(segment_fd_, buffer, path); !w.ok()) return w;
  if (options_.sync && ::fdatasync(segment_fd_) != 0) {
    return Errno("cannot fdatasync", path);
  }
  return absl::OkStatus();
}

absl::Status MetadataLog::WriteSnapshot(const std::vector<std::string>& recs) {
  // A new segment starts here; the snapshot is the state before it.
  if (absl::Status st = OpenSegment(segment_ + 1); !st.ok()) return st;
  const uint64_t n = segment_;
  const std::string path = options_.dir + "/" + SnapshotName(n);
  const std::string tmp = path + ".tmp";
  const int fd =
      ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("cannot open", tmp);
  std::string buffer;
  absl::Status st;
  for (const std::string& r : recs) {
    AppendFrame(r, &buffer);
    if (buffer.size() >= (8u << 20)) {
      st = WriteAll(fd, buffer, tmp);
      buffer.clear();
      if (!st.ok()) break;
    }
  }
  if (st.ok()) st = WriteAll(fd, buffer, tmp);
  if (st.ok() && options_.sync && ::fdatasync(fd) != 0) {
    st = Errno("cannot fdatasync", tmp);
  }
  ::close(fd);
  if (!st.ok()) return st;
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    return Errno("cannot rename", tmp);
  }
  {
    absl::MutexLock lock(&mu_);
    stats_.snapshots++;
  }
  if (options_.sync) {
    if (absl::Status d = SyncDir(options_.dir); !d.ok()) return d;
  }
  RemoveBefore(n);
  return absl::OkStatus();
}

void MetadataLog::RemoveBefore(uint64_t n) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(options_.dir, ec)) {
    const std::string name = entry.path().filename().string();
    uint64_t m = 0;
    if ((ParseName(name, "wal-", ".log", &m) ||
         ParseName(name, "snap-", ".pb", &m)) &&
        m < n) {
      fs::remove(entry.path(), ec);
    }
  }
}

}  // namespace triax::manager
