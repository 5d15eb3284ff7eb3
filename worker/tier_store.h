// The worker's spill tiers: where sealed blocks' pages go when the manager
// moves them out of the device pool.
//
//   host tier  one allocation of --host_tier_mb MiB (Device::AllocateHostTier:
//              pinned memory on CUDA, plain aligned memory on the CPU
//              backend), carved with coalescing (worker::Arena) in extents
//              of whole 256-byte units (a capacity's last capacity % 256
//              bytes are never used). A spilled page takes one extent (its
//              bytes rounded up to 256, first fit) when a free run holds it;
//              otherwise it is scattered over several extents (pieces),
//              each step taking the rest in one run if one holds it, else
//              all of the largest run (Arena::Gather). So a host spill is
//              refused only when the free bytes do not cover the block's
//              pages rounded to 256 (never for fragmentation). A scattered
//              page is copied piece by piece (one device copy per piece on
//              Spill and Restore, at the matching offsets of the device
//              page) and checksummed over its pieces in page order; a move
//              to disk gathers it into a buffer first (one extra host copy).
//   disk tier  one file per spilled page under
//              <disk_dir>/<owner>/<sequence_id>.<lineage_id>.L<layer>.<n>.kvpage
//              (owner: the worker id, else "pid-<pid>"), written to
//              "<name>.tmp", fsync'd, then renamed, so a file with the final
//              name is always complete. Capacity --disk_tier_mb counts page
//              bytes (headers not included). The directory is created by
//              Create and emptied of this owner's *.kvpage / *.kvpage.tmp
//              leftovers (and those of "pid-<n>" siblings whose process is
//              gone), since spilled pages never outlive the process that
//              wrote them.
//
// Disk file format (little-endian), 40-byte header then the page bytes:
//   [0, 8)    magic "TRXKVPG1"
//   [8, 12)   u32 format version (1)
//   [12, 16)  u32 layer
//   [16, 24)  u64 lineage_id
//   [24, 32)  u64 page bytes
//   [32, 36)  u32 CRC32C of the page bytes
//   [36, 40)  u32 CRC32C of header bytes [0, 36)
//   [40, ...) the page, byte for byte as in the device pool
//
// Checksums: every page's CRC32C (worker/checksum.h) is computed on spill
// from the bytes that reached the tier and kept in memory (SpilledPage::crc);
// Restore and Move recompute it from the tier and refuse a mismatch with
// DATA_LOSS naming the block, the layer and the tier (a disk file is also
// refused for a bad header or size). Nothing is freed on DATA_LOSS: the block
// stays spilled, and only Release (the caller evicting or freeing it) drops
// it.
//
// Error codes:
//   INVALID_ARGUMENT    a tier that is not kHost or kDisk, page counts that
//                       do not match, bad options (Create)
//   FAILED_PRECONDITION the tier is disabled on this worker (capacity 0 or
//                       no --disk_tier_dir)
//   RESOURCE_EXHAUSTED  the tier cannot hold the pages: names the bytes
//                       needed, free and over; nothing is kept. A full file
//                       system (ENOSPC) is also RESOURCE_EXHAUSTED.
//   DATA_LOSS           checksum, header or size mismatch on Restore/Move
//   INTERNAL            a file system call failed (path and errno text)
//
// Thread contract: thread-safe. The mutex guards the host arena, the disk
// reservation and the counters; a block's host extents are reserved under
// one hold of it (all or nothing); copies and file I/O run outside it (each
// page's extents or file belong to one SpilledBlock, and callers serialize
// operations on one block).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/model.h"
#include "worker/device.h"
#include "worker/page_allocator.h"

namespace triax::worker {

struct TierStoreOptions {
  uint64_t host_capacity_bytes = 0;  // 0: no host tier
  std::string disk_dir;              // empty: no disk tier
  uint64_t disk_capacity_bytes = 0;  // 0 with a disk_dir: no disk tier
  // Subdirectory of disk_dir for this worker: an id ([A-Za-z0-9._:-]);
  // empty: "pid-<getpid()>".
  std::string owner;
  bool fsync = true;  // fsync each page file before its rename
};

struct TierUsage {
  uint64_t capacity_bytes = 0;  // 0: the tier is disabled
  uint64_t used_bytes = 0;      // page bytes held
  uint64_t blocks = 0;
  uint64_t pages = 0;
  // Bytes a spill can still take: host, free extent bytes (whole 256-byte
  // units, so capacity - used_bytes less the rounding); disk, capacity -
  // used_bytes.
  uint64_t free_bytes = 0;
  // Host: free runs the free bytes are split into (1 when unfragmented, 0
  // when full); disk: 0.
  uint64_t free_runs = 0;
  uint64_t largest_free_run = 0;  // host: bytes of the longest; disk: 0
  // Host: pages held in more than one extent.
  uint64_t scattered_pages = 0;
};

// One extent of a host-tier page: `bytes` of the page (the next ones, in
// order) at `offset` in the host arena, in an extent of `extent` bytes
// (a multiple of 256, >= bytes).
struct HostPiece {
  size_t offset = 0;
  size_t extent = 0;
  size_t bytes = 0;
};

// One spilled page (one layer of a block).
struct SpilledPage {
  size_t bytes = 0;
  uint32_t crc = 0;  // CRC32C of the page bytes, taken on spill
  // kHost: the page's extents, in page order (one unless it was scattered);
  // their `bytes` sum to `bytes`.
  std::vector<HostPiece> host_pieces;
  std::string path;  // kDisk: the page's file
};

// A host-tier page's bytes in place, across its pieces (for tests and
// diagnostics). Valid while the page is held.
class HostPageView {
 public:
  HostPageView() = default;
  HostPageView(uint8_t* base, const std::vector<HostPiece>* pieces,
               size_t bytes)
      : base_(base), pieces_(pieces), bytes_(bytes) {}
  size_t size() const { return bytes_; }
  bool empty() const { return bytes_ == 0; }
  // Byte `i` of the page; i < size().
  uint8_t& operator[](size_t i) const;

 private:
  uint8_t* base_ = nullptr;
  const std::vector<HostPiece>* pieces_ = nullptr;
  size_t bytes_ = 0;
};

// A block's pages in one tier, one per layer. Owned by the caller, which
// must Release it (freeing the extents / deleting the files).
struct SpilledBlock {
  Tier tier = Tier::kUnspecified;  // kUnspecified: empty / released
  std::vector<SpilledPage> pages;
  uint64_t bytes() const;
};

// What a block is called in file names and messages.
struct BlockLabel {
  std::string sequence_id;
  uint64_t lineage_id = 0;
  uint32_t index = 0;  // the block's index in its sequence
};

class TierStore {
 public:
  static constexpr size_t kHeaderBytes = 40;

  // Sets up the enabled tiers. INVALID_ARGUMENT for a bad owner;
  // RESOURCE_EXHAUSTED when the host tier cannot be allocated; INTERNAL when
  // the disk directory cannot be created or cleaned. `device` must outlive
  // the store.
  static absl::StatusOr<std::unique_ptr<TierStore>> Create(
      Device* device, TierStoreOptions options);
  ~TierStore();

  TierStore(const TierStore&) = delete;
  TierStore& operator=(const TierStore&) = delete;

  bool Enabled(Tier tier) const;
  // OK when `tier` is kHost or kDisk and enabled; else INVALID_ARGUMENT /
  // FAILED_PRECONDITION as above.
  absl::Status CheckTier(Tier tier) const;

  // Copies device pages (pages[i] of bytes[i] bytes, layer i) into `tier`
  // and checksums them. All or nothing: on error nothing is kept.
  absl::StatusOr<SpilledBlock> Spill(Tier tier,
                                     absl::Span<const uint8_t* const> pages,
                                     absl::Span<const size_t> bytes,
                                     const BlockLabel& label);

  // Verifies every page against its checksum and copies it into device
  // page dst[i] (which has room for pages[i].bytes). The block itself is
  // left as it is (the caller Releases it once it has committed). DATA_LOSS
  // on a mismatch; dst pages may then hold partial data.
  absl::Status Restore(const SpilledBlock& block,
                       absl::Span<uint8_t* const> dst, const BlockLabel& label);

  // Copies page `layer` of `block` into `out`, its checksum verified
  // (DATA_LOSS on a mismatch, as Restore). The block is left as it is.
  absl::Status ReadPage(const SpilledBlock& block, uint32_t layer,
                        const BlockLabel& label, std::vector<uint8_t>* out);

  // Copies a block into the other tier, verifying each page on the way.
  // The source is left for the caller to Release. Errors as Spill, plus
  // DATA_LOSS.
  absl::StatusOr<SpilledBlock> Move(const SpilledBlock& block, Tier to,
                                    const BlockLabel& label);

  // Frees the block's extents or deletes its files; leaves it empty.
  void Release(SpilledBlock* block);

  TierUsage Usage(Tier tier) const;
  // The disk tier's directory ("" when disabled).
  const std::string& disk_dir() const { return dir_; }

  // The bytes of a host-tier page, scattered or not, for tests and
  // diagnostics (corruption tests flip one to check that Restore refuses
  // it). Empty when the host tier is disabled.
  HostPageView HostPageBytes(const SpilledPage& page);

 private:
  TierStore(Device* device, TierStoreOptions options);
  absl::Status SetUpDisk();

  // RESOURCE_EXHAUSTED unless `extents` bytes of host extents are free.
  absl::Status CheckHostRoom(uint64_t extents, uint64_t block_bytes,
                             const BlockLabel& label)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reserves host extents for pages of `bytes[i]` bytes (one SpilledPage
  // each, appended to `pages` with bytes and host_pieces set) and counts
  // them in the usage. All or nothing, under one hold of the mutex:
  // RESOURCE_EXHAUSTED (CheckHostRoom's) leaves everything as it was.
  absl::Status ReserveHost(absl::Span<const size_t> bytes,
                           const BlockLabel& label,
                           std::vector<SpilledPage>* pages);
  absl::Status ReserveDisk(uint64_t bytes, const BlockLabel& label);
  // Writes one page file (temp name, fsync, rename).
  absl::Status WriteFile(const std::string& path, const uint8_t* data,
                         size_t bytes, uint32_t crc, uint32_t layer,
                         uint64_t lineage_id);
  // Reads a page file into `out`, checking header, size and checksum.
  absl::Status ReadFile(const SpilledPage& page, uint32_t layer,
                        const BlockLabel& label, std::vector<uint8_t>* out);
  // DATA_LOSS unless the CRC32C over a host page's pieces, in page order,
  // is the one taken on spill.
  absl::Status VerifyHost(const SpilledPage& page, uint32_t layer,
                          const BlockLabel& label) const;
  // Reads page `layer` of `block` into host memory and verifies it: for a
  // host page in one extent a pointer into the arena; a scattered host page
  // is verified in place, then gathered into `buf`; a disk page is read into
  // `buf`.
  absl::StatusOr<const uint8_t*> LoadVerified(const SpilledBlock& block,
                                              uint32_t layer,
                                              const BlockLabel& label,
                                              std::vector<uint8_t>* buf);
  // Gives a host page's extents back to the arena.
  void GiveHostPieces(const SpilledPage& page)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string PagePath(const BlockLabel& label, uint32_t layer);
  // Stores host bytes into `to` as layer `layer`; fills `page`.
  absl::Status Put(Tier to, const uint8_t* host_src, size_t bytes, uint32_t crc,
                   uint32_t layer, const BlockLabel& label, SpilledPage* page);
  void FreePage(Tier tier, const SpilledPage& page);

  Device* const device_;
  const TierStoreOptions options_;
  std::string dir_;               // disk tier directory; empty: disabled
  uint8_t* host_base_ = nullptr;  // host tier memory; null: disabled
  size_t host_capacity_ = 0;

  mutable absl::Mutex mu_;
  std::unique_ptr<Arena> host_arena_ ABSL_GUARDED_BY(mu_);
  TierUsage host_ ABSL_GUARDED_BY(mu_);
  TierUsage disk_ ABSL_GUARDED_BY(mu_);
  uint64_t next_file_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace triax::worker
