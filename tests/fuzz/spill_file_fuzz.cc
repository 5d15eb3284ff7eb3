// Fuzz target: the reader of the worker's disk-tier page files
// (worker/tier_store.h "Disk file format"). A block of 1..3 pages is spilled
// to the disk tier, one page's file is replaced by fuzz bytes (a file on a
// damaged or tampered disk), and the block is read back three ways:
// ReadPage of that layer, Restore of the whole block into device pages, and
// Move to the host tier. Each must either return the exact bytes that were
// spilled or refuse with DATA_LOSS (checksum, header or size); nothing may
// crash or read out of bounds. Input layout:
//   [0, 2)  page bytes (u16 little-endian, % 4096 + 1)
//   [2]     pages (% 3 + 1) and, in bits 4-5, which one is replaced
//   [3, ..) the replacement file (header and page bytes)
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_util.h"
#include "worker/device.h"
#include "worker/tier_store.h"

namespace triax::worker {
namespace {

constexpr size_t kMaxPage = 4096;
constexpr size_t kMaxPages = 3;

[[noreturn]] void Fail(const char* why) {
  std::fprintf(stderr, "fuzz_spill_file: %s\n", why);
  std::abort();
}

void CheckRefusal(const absl::Status& s, const char* call) {
  fuzz::FuzzCheck(s, call);
  if (!s.ok() && s.code() != absl::StatusCode::kDataLoss) {
    fuzz::FuzzFail(call, s, "a damaged page file must be DATA_LOSS");
  }
}

const std::string& DiskDir() {
  static const std::string* dir = [] {
    std::string tmpl = "/tmp/triax-fuzz-spill-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) std::abort();
    return new std::string(tmpl);
  }();
  return *dir;
}

}  // namespace
}  // namespace triax::worker

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace triax::worker;  // NOLINT(google-build-using-namespace)
  if (size < 3) return 0;
  static CpuDevice* device = new CpuDevice();
  // Device pages: the spilled source, then the restore destination.
  static uint8_t* arena = [] {
    auto a = device->AllocateArena(2 * kMaxPages * kMaxPage);
    if (!a.ok()) std::abort();
    return *a;
  }();
  const size_t page_bytes = (data[0] | (size_t{data[1]} << 8)) % kMaxPage + 1;
  const size_t pages = data[2] % kMaxPages + 1;
  const uint32_t damaged = ((data[2] >> 4) & 3) % pages;
  const std::string file(reinterpret_cast<const char*>(data + 3), size - 3);

  TierStoreOptions o;
  o.host_capacity_bytes = 64 << 10;
  o.disk_dir = DiskDir();
  o.disk_capacity_bytes = 64 << 10;
  o.owner = "fuzz";
  o.fsync = false;
  auto store = TierStore::Create(device, o);
  if (!store.ok()) triax::fuzz::FuzzFail("TierStore", store.status(), "setup");

  std::vector<const uint8_t*> src;
  std::vector<uint8_t*> dst;
  std::vector<size_t> bytes(pages, page_bytes);
  for (size_t l = 0; l < pages; ++l) {
    uint8_t* p = arena + l * kMaxPage;
    for (size_t i = 0; i < page_bytes; ++i) {
      p[i] = triax::fuzz::SpillPatternByte(i, l, page_bytes);
    }
    src.push_back(p);
    dst.push_back(arena + (kMaxPages + l) * kMaxPage);
  }
  BlockLabel label;
  label.sequence_id = "seq-1";
  label.lineage_id = 7;
  label.index = 0;
  auto block = (*store)->Spill(triax::Tier::kDisk, src, bytes, label);
  if (!block.ok()) triax::fuzz::FuzzFail("Spill", block.status(), "setup");
  {
    std::ofstream out(block->pages[damaged].path,
                      std::ios::binary | std::ios::trunc);
    out.write(file.data(), static_cast<std::streamsize>(file.size()));
    if (!out.good()) Fail("cannot write the page file");
  }
  const uint8_t* want = src[damaged];

  std::vector<uint8_t> got;
  const absl::Status read = (*store)->ReadPage(*block, damaged, label, &got);
  CheckRefusal(read, "ReadPage");
  if (read.ok() && (got.size() != page_bytes ||
                    std::memcmp(got.data(), want, page_bytes) != 0)) {
    Fail("ReadPage returned other bytes than were spilled");
  }

  const absl::Status restore = (*store)->Restore(*block, dst, label);
  CheckRefusal(restore, "Restore");
  if (restore.ok() != read.ok()) Fail("Restore and ReadPage disagree");
  if (restore.ok()) {
    for (size_t l = 0; l < pages; ++l) {
      if (std::memcmp(dst[l], src[l], page_bytes) != 0) {
        Fail("Restore wrote other bytes than were spilled");
      }
    }
  }

  auto moved = (*store)->Move(*block, triax::Tier::kHost, label);
  CheckRefusal(moved.status(), "Move");
  if (moved.ok() != read.ok()) Fail("Move and ReadPage disagree");
  if (moved.ok()) {
    std::vector<uint8_t> back;
    CheckRefusal((*store)->ReadPage(*moved, damaged, label, &back), "ReadPage");
    if (back.size() != page_bytes ||
        std::memcmp(back.data(), want, page_bytes) != 0) {
      Fail("Move to the host tier changed the bytes");
    }
    (*store)->Release(&*moved);
  }
  (*store)->Release(&*block);
  return 0;
}
