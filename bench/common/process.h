// What the benchmarks that start daemons share (transfer_bench,
// manager_bench, attend_bench): where their binaries are, and pinning
// processes to CPUs by a CPU list as taskset takes it ("1", "0-3",
// "0,2-3").
#pragma once

#include <sys/types.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace triax::bench {

// The directory of the running binary (where the daemons it starts sit in
// a build or a bundle); "." when /proc/self/exe cannot be read.
std::string SelfDir();

// Pins every thread of process `pid` to the CPUs of `cpus`, as `taskset -a
// -p` does; threads started later inherit it. INVALID_ARGUMENT naming
// `flag` and the list when it does not parse, INTERNAL with the errno text
// when the kernel refuses.
absl::Status PinProcess(pid_t pid, absl::string_view cpus,
                        absl::string_view flag);
// The parse alone (for flag checks before anything starts).
absl::Status CheckCpuList(absl::string_view cpus, absl::string_view flag);

// CPU seconds (user and system, every thread) that process `pid` has used
// so far, from its CPU-time clock (clock_getcpuclockid; 0 for this
// process); INTERNAL with the errno text when the clock cannot be read.
// On a shared machine the CPU a call costs is steadier than its wall time.
absl::StatusOr<double> ProcessCpuSeconds(pid_t pid);

}  // namespace triax::bench
