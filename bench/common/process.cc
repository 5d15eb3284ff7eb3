#include "bench/common/process.h"

#include <sched.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <set>
#include <string>
#include <system_error>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace triax::bench {
namespace {

absl::StatusOr<cpu_set_t> ParseCpuList(absl::string_view cpus,
                                       absl::string_view flag) {
  auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": \"", cpus,
                     "\" is not a CPU list (e.g. \"1\", \"0-3\", \"0,2-3\")"));
  };
  cpu_set_t set;
  CPU_ZERO(&set);
  if (cpus.empty()) return bad();
  for (absl::string_view part : absl::StrSplit(cpus, ',')) {
    std::pair<absl::string_view, absl::string_view> range =
        absl::StrSplit(part, absl::MaxSplits('-', 1));
    int lo = 0, hi = 0;
    if (!absl::SimpleAtoi(range.first, &lo)) return bad();
    hi = lo;
    if (!range.second.empty() && !absl::SimpleAtoi(range.second, &hi)) {
      return bad();
    }
    if (lo < 0 || hi < lo || hi >= CPU_SETSIZE) return bad();
    for (int c = lo; c <= hi; ++c) CPU_SET(c, &set);
  }
  return set;
}

}  // namespace

std::string SelfDir() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  const std::string path(buf, n);
  return path.substr(0, path.rfind('/'));
}

absl::Status CheckCpuList(absl::string_view cpus, absl::string_view flag) {
  return ParseCpuList(cpus, flag).status();
}

absl::Status PinProcess(pid_t pid, absl::string_view cpus,
                        absl::string_view flag) {
  auto set = ParseCpuList(cpus, flag);
  if (!set.ok()) return set.status();
  // Threads may start while the list is read; a second pass that pins
  // nothing new ends it (new threads inherit from pinned ones).
  std::set<pid_t> pinned;
  for (int pass = 0; pass < 10; ++pass) {
    bool fresh = false;
    std::error_code ec;
    const std::string dir = absl::StrCat("/proc/", pid, "/task");
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
      pid_t tid = 0;
      if (!absl::SimpleAtoi(entry.path().filename().string(), &tid) ||
          pinned.count(tid) > 0) {
        continue;
      }
      if (sched_setaffinity(tid, sizeof(*set), &*set) != 0 && errno != ESRCH) {
        return absl::InternalError(absl::StrCat(flag, "=", cpus,
                                                ": sched_setaffinity(", tid,
                                                "): ", std::strerror(errno)));
      }
      pinned.insert(tid);
      fresh = true;
    }
    if (ec) {
      return absl::InternalError(
          absl::StrCat(flag, ": cannot list ", dir, ": ", ec.message()));
    }
    if (!fresh) return absl::OkStatus();
  }
  return absl::OkStatus();
}

absl::StatusOr<double> ProcessCpuSeconds(pid_t pid) {
  clockid_t clock = CLOCK_PROCESS_CPUTIME_ID;
  if (pid != 0) {
    if (const int rc = clock_getcpuclockid(pid, &clock); rc != 0) {
      return absl::InternalError(
          absl::StrCat("clock_getcpuclockid(", pid, "): ", std::strerror(rc)));
    }
  }
  timespec ts{};
  if (clock_gettime(clock, &ts) != 0) {
    return absl::InternalError(absl::StrCat("clock_gettime of process ", pid,
                                            ": ", std::strerror(errno)));
  }
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

}  // namespace triax::bench
