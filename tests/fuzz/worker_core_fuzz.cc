// Fuzz target: the worker's request handling. Each input is a list of
// records (fuzz_util.h) whose payloads are wire requests of the Worker
// service; they are parsed, converted (worker/convert.h, as the service
// does) and applied to a fresh WorkerCore over a SequenceStore on the CPU
// device (4 MiB pool, window 4 tokens) with a 256 KiB host tier and a
// 256 KiB disk tier in a temporary directory. Selectors (mod kOps):
//   0 AllocatePages  1 WriteKV (one message)  2 Attend   3 ReadKV
//   4 Fork           5 Demote                 6 Spill    7 Restore
//   8 Evict          9 FreePages             10 GetInventory
// Background restores are served after every call (no prefetch thread), and
// the inventory is read after every call.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "tests/fuzz/fuzz_util.h"
#include "triax/v1/worker.pb.h"
#include "worker/convert.h"
#include "worker/device.h"
#include "worker/page_allocator.h"
#include "worker/sequence_store.h"
#include "worker/tier_store.h"
#include "worker/worker_core.h"

namespace triax::worker {
namespace {

using fuzz::FuzzCheck;

constexpr int kOps = 11;

template <typename Proto>
bool Parse(absl::string_view payload, Proto* p) {
  return p->ParseFromArray(payload.data(), static_cast<int>(payload.size()));
}

void Apply(WorkerCore& core, uint8_t op, absl::string_view payload) {
  switch (op % kOps) {
    case 0: {
      v1::AllocatePagesRequest p;
      if (!Parse(payload, &p)) return;
      FuzzCheck(core.AllocatePages(FromProto(p)), "AllocatePages");
      return;
    }
    case 1: {
      v1::WriteKVRequest p;
      if (!Parse(payload, &p)) return;
      bool sent = false;
      WriteStream stream;
      stream.next = [&](WriteMessage* m) -> absl::StatusOr<bool> {
        if (sent) return false;
        sent = true;
        *m = FromProto(p);
        return true;
      };
      FuzzCheck(core.WriteKV(stream), "WriteKV");
      return;
    }
    case 2: {
      v1::AttendRequest p;
      if (!Parse(payload, &p)) return;
      auto r = core.Attend(FromProto(p));
      FuzzCheck(r, "Attend");
      if (r.ok()) {
        for (const auto& item : r->items) FuzzCheck(item, "Attend item");
      }
      return;
    }
    case 3: {
      v1::ReadKVRequest p;
      if (!Parse(payload, &p)) return;
      FuzzCheck(core.Read(FromProto(p)), "Read");
      return;
    }
    case 4: {
      v1::WorkerForkRequest p;
      if (!Parse(payload, &p)) return;
      FuzzCheck(core.Fork(FromProto(p)), "Fork");
      return;
    }
    case 5: {
      v1::DemoteRequest p;
      if (!Parse(payload, &p)) return;
      FuzzCheck(core.Demote(FromProto(p)), "Demote");
      return;
    }
    case 6: {
      v1::SpillRequest p;
      if (!Parse(payload, &p)) return;
      FuzzCheck(core.Spill(FromProto(p)), "Spill");
      return;
    }
    case 7: {
      v1::RestoreRequest p;
      if (!Parse(payload, &p)) return;
      FuzzCheck(core.Restore(FromProto(p)), "Restore");
      return;
    }
    case 8: {
      v1::EvictRequest p;
      if (!Parse(payload, &p)) return;
      FuzzCheck(core.Evict(FromProto(p)), "Evict");
      return;
    }
    case 9: {
      v1::FreePagesRequest p;
      if (!Parse(payload, &p)) return;
      FuzzCheck(core.Free(FromProto(p)), "Free");
      return;
    }
    case 10: {
      v1::GetInventoryRequest p;
      if (!Parse(payload, &p)) return;
      FuzzCheck(core.GetInventory(FromProto(p)), "GetInventory");
      return;
    }
  }
}

// One temporary directory per process for the disk tier (each input's
// TierStore empties it of its own leftovers at creation).
const std::string& DiskDir() {
  static const std::string* dir = [] {
    std::string tmpl = "/tmp/triax-fuzz-worker-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) std::abort();
    return new std::string(tmpl);
  }();
  return *dir;
}

}  // namespace
}  // namespace triax::worker

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace triax::worker;  // NOLINT(google-build-using-namespace)
  static CpuDevice* device = new CpuDevice();
  auto alloc = PageAllocator::Create(device, 4 << 20);
  if (!alloc.ok()) triax::fuzz::FuzzFail("PageAllocator", alloc.status(), "");
  TierStoreOptions to;
  to.host_capacity_bytes = 256 << 10;
  to.disk_dir = DiskDir();
  to.disk_capacity_bytes = 256 << 10;
  to.owner = "fuzz";
  to.fsync = false;
  auto tiers = TierStore::Create(device, to);
  if (!tiers.ok()) triax::fuzz::FuzzFail("TierStore", tiers.status(), "");
  StoreOptions so;
  so.window_tokens = 4;
  so.tiers = tiers->get();
  so.prefetch_thread = false;
  auto store = std::make_unique<SequenceStore>(device, alloc->get(), so);
  auto core = std::make_unique<WorkerCore>(store.get(), device);
  triax::fuzz::Records records(data, size);
  uint8_t op = 0;
  absl::string_view payload;
  int calls = 0;
  while (calls++ < 64 && records.Next(&op, &payload)) {
    Apply(*core, op, payload);
    store->ServePrefetchQueue();
    core->Inventory();
  }
  core.reset();
  store.reset();
  return 0;
}
