#include "worker/link_transfer.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/status_macros.h"

namespace triax::worker {
namespace {

constexpr uint64_t kSlotAlign = 256;  // each page starts aligned in a batch
uint64_t AlignUp(uint64_t n) {
  return (n + kSlotAlign - 1) & ~(kSlotAlign - 1);
}

}  // namespace

LinkEnd::LinkEnd(Device* device, std::unique_ptr<DeviceLink> link)
    : device_(device), link_(std::move(link)) {}

LinkEnd::~LinkEnd() {
  // The link goes first: no operation may still use a slot.
  link_->Abort("the link was dropped");
  for (uint8_t*& slot : slots_) {
    if (slot != nullptr) device_->FreeArena(slot, slot_bytes_);
    slot = nullptr;
  }
}

absl::StatusOr<uint8_t*> LinkEnd::Slot(int i, size_t bytes) {
  if (bytes > slot_bytes_) {
    for (uint8_t*& slot : slots_) {
      if (slot != nullptr) device_->FreeArena(slot, slot_bytes_);
      slot = nullptr;
    }
    slot_bytes_ = bytes;
  }
  if (slots_[i] == nullptr) {
    absl::StatusOr<uint8_t*> slot = device_->AllocateArena(slot_bytes_);
    if (!slot.ok()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("link staging slot of ", slot_bytes_,
                       " bytes: ", slot.status().message()));
    }
    slots_[i] = *slot;
  }
  return slots_[i];
}

void LinkRegistry::Add(const std::string& key, const std::string& owner,
                       std::shared_ptr<LinkEnd> end) {
  // Declared before the lock: destroyed after it is released.
  std::vector<std::shared_ptr<LinkEnd>> closed;
  absl::MutexLock lock(&mu_);
  for (auto it = links_.begin(); it != links_.end();) {
    if (it->second.owner == owner && !it->second.busy) {
      closed.push_back(std::move(it->second.end));
      links_.erase(it++);
    } else {
      ++it;
    }
  }
  links_[key] = Entry{owner, std::move(end), false};
}

absl::StatusOr<std::shared_ptr<LinkEnd>> LinkRegistry::Claim(
    const std::string& key) {
  absl::MutexLock lock(&mu_);
  auto it = links_.find(key);
  if (it == links_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "link_key=", Quote(key),
        " names no link of this worker (never made, dropped after an error, "
        "or this worker restarted)"));
  }
  if (it->second.busy) {
    return absl::AbortedError(
        absl::StrCat("link_key=", Quote(key), " is held by another transfer"));
  }
  it->second.busy = true;
  return it->second.end;
}

void LinkRegistry::Release(const std::string& key, bool ok) {
  std::shared_ptr<LinkEnd> dropped;  // destroyed unlocked
  absl::MutexLock lock(&mu_);
  auto it = links_.find(key);
  if (it == links_.end()) return;
  it->second.busy = false;
  if (!ok) {
    dropped = std::move(it->second.end);
    links_.erase(it);
  }
}

size_t LinkRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return links_.size();
}

absl::Status SendOverLink(WorkerCore* core, const ExportRequest& req,
                          const LinkSendOptions& options, LinkEnd* end,
                          LinkBatchSink sink) {
  const uint64_t slot_bytes =
      options.max_batch_bytes == 0 ? kLinkBatchBytes : options.max_batch_bytes;
  uint8_t* slots[2];
  for (int i = 0; i < 2; ++i) {
    TRIAX_ASSIGN_OR_RETURN(slots[i], end->Slot(i, slot_bytes));
  }
  Device* const device = core->device();
  const uint8_t* const base = core->ArenaBase();
  DeviceLink* const link = end->link();
  std::unique_ptr<PagePins> pins = core->NewPagePins();
  ExportOptions export_options;
  export_options.follow_writes = req.follow_writes;
  export_options.deadline = options.deadline;
  export_options.cancelled = options.cancelled;
  export_options.pins = pins.get();
  export_options.shared_checksums = false;
  uint64_t tickets[2] = {0, 0};  // the send last posted from each slot
  int next_slot = 0;
  size_t pins_sent = 0;  // pins of pages already gathered

  // Gathers `batch` (pins [pins_sent, pins_sent + batch.size())) into the
  // next slot, hands its descriptors to the sink and posts its send.
  std::vector<PageCopy> jobs;
  std::vector<uint32_t> crcs;
  auto send = [&](std::vector<TransferPage>* batch) -> absl::Status {
    const int s = next_slot;
    next_slot ^= 1;
    if (tickets[s] != 0) {
      TRIAX_RETURN_IF_ERROR(
          link->Wait(tickets[s], options.deadline, options.cancelled));
    }
    jobs.clear();
    uint64_t offset = 0;
    for (TransferPage& page : *batch) {
      jobs.push_back(PageCopy{slots[s] + offset, base + page.arena_offset,
                              page.shared_bytes});
      page.arena_offset = offset;
      offset = AlignUp(offset + page.shared_bytes);
    }
    crcs.assign(jobs.size(), 0);
    TRIAX_RETURN_IF_ERROR(device->CopyPagesChecked(jobs, absl::MakeSpan(crcs)));
    for (size_t i = 0; i < batch->size(); ++i) {
      (*batch)[i].crc32c = crcs[i];
      if (options.corrupt_next && options.corrupt_next()) {
        (*batch)[i].crc32c ^= 0x40;
      }
    }
    pins_sent += batch->size();
    pins->ReleaseFirst(pins_sent);  // gathered: the pages may move again
    TRIAX_RETURN_IF_ERROR(sink(batch, offset));
    TRIAX_ASSIGN_OR_RETURN(tickets[s],
                           link->PostSend(slots[s], offset, options.deadline));
    return absl::OkStatus();
  };

  // Batches span layers; with follow_writes each layer's last batch goes
  // before the next layer is waited for.
  std::vector<TransferPage> batch;
  uint64_t bytes = 0;
  auto layer_sink = [&](uint32_t layer,
                        std::vector<TransferPage>* pages) -> absl::Status {
    for (TransferPage& page : *pages) {
      if (page.shared_bytes > slot_bytes) {
        return absl::InvalidArgumentError(absl::StrCat(
            "max_batch_bytes=", slot_bytes, " is smaller than a page of layer ",
            layer, " (", page.shared_bytes, " bytes)"));
      }
      if (!batch.empty() && AlignUp(bytes) + page.shared_bytes > slot_bytes) {
        TRIAX_RETURN_IF_ERROR(send(&batch));
        batch.clear();
        bytes = 0;
      }
      bytes = AlignUp(bytes) + page.shared_bytes;
      batch.push_back(std::move(page));
    }
    if (req.follow_writes && !batch.empty()) {
      TRIAX_RETURN_IF_ERROR(send(&batch));
      batch.clear();
      bytes = 0;
    }
    return absl::OkStatus();
  };
  TRIAX_RETURN_IF_ERROR(core->Export(req, export_options, layer_sink));
  if (!batch.empty()) TRIAX_RETURN_IF_ERROR(send(&batch));
  for (const int s : {next_slot, next_slot ^ 1}) {
    if (tickets[s] != 0) {
      TRIAX_RETURN_IF_ERROR(
          link->Wait(tickets[s], options.deadline, options.cancelled));
    }
  }
  return absl::OkStatus();
}

}  // namespace triax::worker
