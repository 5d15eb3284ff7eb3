#include "worker/tier_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/status_macros.h"
#include "worker/checksum.h"

namespace triax::worker {
namespace {

namespace fs = std::filesystem;

constexpr char kMagic[8] = {'T', 'R', 'X', 'K', 'V', 'P', 'G', '1'};
constexpr uint32_t kVersion = 1;
constexpr char kSuffix[] = ".kvpage";
constexpr char kTmpSuffix[] = ".kvpage.tmp";
constexpr size_t kHostAlign = 256;

size_t RoundUp(size_t n) { return (n + kHostAlign - 1) & ~(kHostAlign - 1); }
size_t RoundDown(size_t n) { return n & ~(kHostAlign - 1); }

std::string Runs(size_t n) {
  return absl::StrCat(n, n == 1 ? " free run" : " free runs");
}

std::string Errno(int e) { return std::strerror(e); }

absl::Status FsError(int e, absl::string_view what, absl::string_view path) {
  const std::string msg =
      absl::StrCat("disk tier: ", what, " ", Quote(path), ": ", Errno(e));
  if (e == ENOSPC || e == EDQUOT) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

void PutU32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void PutU64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t GetU32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{p[i]} << (8 * i);
  return v;
}
uint64_t GetU64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t{p[i]} << (8 * i);
  return v;
}

std::string What(const BlockLabel& label) {
  return absl::StrCat("sequence_id=", Quote(label.sequence_id), " block ",
                      label.index, " (lineage_id=", label.lineage_id, ")");
}

absl::Status WriteAll(int fd, const uint8_t* p, size_t n,
                      const std::string& path) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return FsError(errno, "write", path);
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

bool IsOurFile(const fs::path& p) {
  const std::string name = p.filename().string();
  return absl::EndsWith(name, kSuffix) || absl::EndsWith(name, kTmpSuffix);
}

// Removes our page files in `dir`; returns how many.
int RemovePageFiles(const fs::path& dir) {
  int removed = 0;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    std::error_code fec;
    if (it->is_regular_file(fec) && IsOurFile(it->path())) {
      if (fs::remove(it->path(), fec)) ++removed;
    }
  }
  return removed;
}

}  // namespace

uint8_t& HostPageView::operator[](size_t i) const {
  static uint8_t none = 0;  // what an empty view's misuse gets
  if (pieces_ == nullptr || pieces_->empty()) return none;
  for (const HostPiece& piece : *pieces_) {
    if (i < piece.bytes) return base_[piece.offset + i];
    i -= piece.bytes;
  }
  // Out of range (i >= size()): the last byte of the last extent, so a
  // misuse stays inside the arena.
  const HostPiece& last = pieces_->back();
  return base_[last.offset + last.extent - 1];
}

uint64_t SpilledBlock::bytes() const {
  uint64_t n = 0;
  for (const SpilledPage& p : pages) n += p.bytes;
  return n;
}

TierStore::TierStore(Device* device, TierStoreOptions options)
    : device_(device), options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<TierStore>> TierStore::Create(
    Device* device, TierStoreOptions options) {
  if (!options.owner.empty()) {
    TRIAX_RETURN_IF_ERROR(ValidateId("tier owner", options.owner));
  }
  std::unique_ptr<TierStore> store(new TierStore(device, std::move(options)));
  if (store->options_.host_capacity_bytes > 0) {
    const size_t bytes = store->options_.host_capacity_bytes;
    absl::StatusOr<uint8_t*> base = device->AllocateHostTier(bytes);
    if (!base.ok()) {
      return absl::Status(base.status().code(),
                          absl::StrCat("host tier of ", bytes,
                                       " bytes: ", base.status().message()));
    }
    store->host_base_ = *base;
    store->host_capacity_ = bytes;
    absl::MutexLock lock(&store->mu_);
    // Whole 256-byte units only, so every extent and free run is one.
    store->host_arena_ = std::make_unique<Arena>(RoundDown(bytes));
    store->host_.capacity_bytes = bytes;
  }
  if (!store->options_.disk_dir.empty() &&
      store->options_.disk_capacity_bytes > 0) {
    TRIAX_RETURN_IF_ERROR(store->SetUpDisk());
  }
  return store;
}

absl::Status TierStore::SetUpDisk() {
  const std::string owner = options_.owner.empty()
                                ? absl::StrCat("pid-", ::getpid())
                                : options_.owner;
  const fs::path root(options_.disk_dir);
  const fs::path dir = root / owner;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat(
        "disk tier: cannot create ", Quote(dir.string()), ": ", ec.message()));
  }
  RemovePageFiles(dir);
  // Leftovers of earlier workers that named their directory by pid and are
  // gone (a crash skips the cleanup on Release).
  for (fs::directory_iterator it(root, ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    int pid = 0;
    if (!absl::StartsWith(name, "pid-") || it->path() == dir ||
        !absl::SimpleAtoi(absl::string_view(name).substr(4), &pid) ||
        pid <= 0) {
      continue;
    }
    if (::kill(pid, 0) != 0 && errno == ESRCH) {
      RemovePageFiles(it->path());
      std::error_code rec;
      fs::remove(it->path(), rec);  // only when now empty
    }
  }
  dir_ = dir.string();
  absl::MutexLock lock(&mu_);
  disk_.capacity_bytes = options_.disk_capacity_bytes;
  return absl::OkStatus();
}

TierStore::~TierStore() {
  if (host_base_ != nullptr) device_->FreeHostTier(host_base_, host_capacity_);
  if (!dir_.empty()) {
    std::error_code ec;
    fs::remove(dir_, ec);  // succeeds only when every page was released
  }
}

bool TierStore::Enabled(Tier tier) const {
  if (tier == Tier::kHost) return host_base_ != nullptr;
  if (tier == Tier::kDisk) return !dir_.empty();
  return false;
}

absl::Status TierStore::CheckTier(Tier tier) const {
  if (tier != Tier::kHost && tier != Tier::kDisk) {
    return absl::InvalidArgumentError(
        absl::StrCat("tier=", static_cast<int>(tier), " (", TierLabel(tier),
                     ") is not a spill tier (2 host, 3 disk)"));
  }
  if (!Enabled(tier)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the ", TierLabel(tier), " tier is disabled on this worker (",
        tier == Tier::kHost ? "--host_tier_mb=0"
                            : "no --disk_tier_dir or --disk_tier_mb=0",
        ")"));
  }
  return absl::OkStatus();
}

absl::Status TierStore::CheckHostRoom(uint64_t extents, uint64_t block_bytes,
                                      const BlockLabel& label) {
  const uint64_t free_bytes = host_arena_->free_bytes();
  if (extents <= free_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "host tier: ", What(label), " needs ", block_bytes, " bytes (", extents,
      " in 256-byte extents); ", free_bytes, " of ", host_capacity_,
      " bytes are free (", Runs(host_arena_->free_runs()), "), ",
      extents - free_bytes, " bytes over"));
}

absl::Status TierStore::ReserveHost(absl::Span<const size_t> bytes,
                                    const BlockLabel& label,
                                    std::vector<SpilledPage>* pages) {
  uint64_t extents = 0, total = 0;
  for (size_t b : bytes) {
    extents += RoundUp(b);
    total += b;
  }
  absl::MutexLock lock(&mu_);
  TRIAX_RETURN_IF_ERROR(CheckHostRoom(extents, total, label));
  const size_t first = pages->size();
  std::vector<Arena::Run> runs;
  for (size_t b : bytes) {
    runs.clear();
    const size_t extent = RoundUp(b);
    // b == 0 takes nothing; such a page has no pieces.
    if (extent > 0 && !host_arena_->Gather(extent, kHostAlign, &runs)) {
      // Unreachable while the room check holds (every run is whole 256-byte
      // units); given back all the same so a refusal changes nothing.
      for (size_t i = first; i < pages->size(); ++i) {
        GiveHostPieces((*pages)[i]);
      }
      pages->resize(first);
      return absl::InternalError(
          absl::StrCat("host tier: ", What(label), " could not gather ", extent,
                       " bytes although ", host_arena_->free_bytes(),
                       " are free in ", Runs(host_arena_->free_runs())));
    }
    SpilledPage p;
    p.bytes = b;
    size_t left = b;
    for (const Arena::Run& run : runs) {
      const size_t in = std::min(left, run.bytes);
      p.host_pieces.push_back(HostPiece{run.offset, run.bytes, in});
      left -= in;
    }
    pages->push_back(std::move(p));
  }
  for (size_t i = first; i < pages->size(); ++i) {
    host_.used_bytes += (*pages)[i].bytes;
    host_.pages += 1;
    if ((*pages)[i].host_pieces.size() > 1) host_.scattered_pages += 1;
  }
  return absl::OkStatus();
}

void TierStore::GiveHostPieces(const SpilledPage& page) {
  for (const HostPiece& piece : page.host_pieces) {
    host_arena_->Give(piece.offset, piece.extent);
  }
}

absl::Status TierStore::ReserveDisk(uint64_t bytes, const BlockLabel& label) {
  absl::MutexLock lock(&mu_);
  const uint64_t free_bytes = disk_.capacity_bytes - disk_.used_bytes;
  if (bytes > free_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("disk tier: ", What(label), " needs ", bytes, " bytes; ",
                     free_bytes, " of ", disk_.capacity_bytes,
                     " bytes are free, ", bytes - free_bytes, " bytes over"));
  }
  disk_.used_bytes += bytes;
  return absl::OkStatus();
}

std::string TierStore::PagePath(const BlockLabel& label, uint32_t layer) {
  uint64_t n;
  {
    absl::MutexLock lock(&mu_);
    n = next_file_++;
  }
  return (fs::path(dir_) / absl::StrCat(label.sequence_id, ".",
                                        label.lineage_id, ".L", layer, ".", n,
                                        kSuffix))
      .string();
}

absl::Status TierStore::WriteFile(const std::string& path, const uint8_t* data,
                                  size_t bytes, uint32_t crc, uint32_t layer,
                                  uint64_t lineage_id) {
  uint8_t header[kHeaderBytes];
  std::memcpy(header, kMagic, 8);
  PutU32(header + 8, kVersion);
  PutU32(header + 12, layer);
  PutU64(header + 16, lineage_id);
  PutU64(header + 24, bytes);
  PutU32(header + 32, crc);
  PutU32(header + 36, Crc32c(header, 36));
  const std::string tmp =
      path.substr(0, path.size() - std::strlen(kSuffix)) + kTmpSuffix;
  const int fd =
      ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return FsError(errno, "cannot create", tmp);
  absl::Status s = WriteAll(fd, header, kHeaderBytes, tmp);
  if (s.ok()) s = WriteAll(fd, data, bytes, tmp);
  if (s.ok() && options_.fsync && ::fsync(fd) != 0) {
    s = FsError(errno, "fsync", tmp);
  }
  if (::close(fd) != 0 && s.ok()) s = FsError(errno, "close", tmp);
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    s = FsError(errno, "cannot rename to final name", tmp);
  }
  if (!s.ok()) ::unlink(tmp.c_str());
  return s;
}

absl::Status TierStore::ReadFile(const SpilledPage& page, uint32_t layer,
                                 const BlockLabel& label,
                                 std::vector<uint8_t>* out) {
  const std::string where =
      absl::StrCat(What(label), " layer ", layer, " in the disk tier (file ",
                   Quote(page.path), ")");
  const int fd = ::open(page.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    if (e == ENOENT) {
      return absl::DataLossError(
          absl::StrCat(where, " is missing; the block stays spilled"));
    }
    return FsError(e, "cannot open", page.path);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    return FsError(e, "fstat", page.path);
  }
  const uint64_t want = kHeaderBytes + page.bytes;
  if (static_cast<uint64_t>(st.st_size) != want) {
    ::close(fd);
    return absl::DataLossError(absl::StrCat(where, " has ", st.st_size,
                                            " bytes, expected ", want,
                                            "; the block stays spilled"));
  }
  out->resize(want);
  size_t done = 0;
  while (done < want) {
    const ssize_t r = ::read(fd, out->data() + done, want - done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      const int e = r < 0 ? errno : EIO;
      ::close(fd);
      return FsError(e, "read", page.path);
    }
    done += static_cast<size_t>(r);
  }
  ::close(fd);
  const uint8_t* h = out->data();
  if (std::memcmp(h, kMagic, 8) != 0 || GetU32(h + 8) != kVersion ||
      GetU32(h + 36) != Crc32c(h, 36) || GetU32(h + 12) != layer ||
      GetU64(h + 16) != label.lineage_id || GetU64(h + 24) != page.bytes ||
      GetU32(h + 32) != page.crc) {
    return absl::DataLossError(
        absl::StrCat(where,
                     ": the header is damaged or names another page; checksum "
                     "failure, the block stays spilled and is not served"));
  }
  const uint32_t got = Crc32c(h + kHeaderBytes, page.bytes);
  if (got != page.crc) {
    return absl::DataLossError(
        absl::StrCat(where, ": checksum mismatch (CRC32C stored ",
                     absl::Hex(page.crc, absl::kZeroPad8), ", computed ",
                     absl::Hex(got, absl::kZeroPad8),
                     "); the block stays spilled and is not served"));
  }
  return absl::OkStatus();
}

absl::Status TierStore::VerifyHost(const SpilledPage& page, uint32_t layer,
                                   const BlockLabel& label) const {
  // Over the pieces in page order: the CRC32C of the contiguous page.
  uint32_t got = 0;
  for (const HostPiece& piece : page.host_pieces) {
    got = Crc32c(host_base_ + piece.offset, piece.bytes, got);
  }
  if (got == page.crc) return absl::OkStatus();
  return absl::DataLossError(
      absl::StrCat(What(label), " layer ", layer,
                   " in the host tier: checksum mismatch (CRC32C stored ",
                   absl::Hex(page.crc, absl::kZeroPad8), ", computed ",
                   absl::Hex(got, absl::kZeroPad8),
                   "); the block stays spilled and is not served"));
}

absl::StatusOr<const uint8_t*> TierStore::LoadVerified(
    const SpilledBlock& block, uint32_t layer, const BlockLabel& label,
    std::vector<uint8_t>* buf) {
  const SpilledPage& page = block.pages[layer];
  if (block.tier == Tier::kHost) {
    TRIAX_RETURN_IF_ERROR(VerifyHost(page, layer, label));
    if (page.host_pieces.size() == 1) {
      return static_cast<const uint8_t*>(host_base_ +
                                         page.host_pieces[0].offset);
    }
    // Scattered (or empty): gathered so the caller sees the page contiguous.
    buf->resize(page.bytes);
    size_t at = 0;
    for (const HostPiece& piece : page.host_pieces) {
      std::memcpy(buf->data() + at, host_base_ + piece.offset, piece.bytes);
      at += piece.bytes;
    }
    return static_cast<const uint8_t*>(buf->data());
  }
  TRIAX_RETURN_IF_ERROR(ReadFile(page, layer, label, buf));
  return static_cast<const uint8_t*>(buf->data() + kHeaderBytes);
}

absl::Status TierStore::Put(Tier to, const uint8_t* host_src, size_t bytes,
                            uint32_t crc, uint32_t layer,
                            const BlockLabel& label, SpilledPage* page) {
  page->bytes = bytes;
  page->crc = crc;
  if (to == Tier::kHost) {
    for (const HostPiece& piece : page->host_pieces) {
      std::memcpy(host_base_ + piece.offset, host_src, piece.bytes);
      host_src += piece.bytes;
    }
    return absl::OkStatus();
  }
  return WriteFile(page->path, host_src, bytes, crc, layer, label.lineage_id);
}

void TierStore::FreePage(Tier tier, const SpilledPage& page) {
  if (tier == Tier::kHost) {
    absl::MutexLock lock(&mu_);
    GiveHostPieces(page);
    host_.used_bytes -= page.bytes;
    host_.pages -= 1;
    if (page.host_pieces.size() > 1) host_.scattered_pages -= 1;
  } else if (tier == Tier::kDisk) {
    if (!page.path.empty()) ::unlink(page.path.c_str());
    absl::MutexLock lock(&mu_);
    disk_.used_bytes -= page.bytes;
    disk_.pages -= 1;
  }
}

absl::StatusOr<SpilledBlock> TierStore::Spill(
    Tier tier, absl::Span<const uint8_t* const> pages,
    absl::Span<const size_t> bytes, const BlockLabel& label) {
  TRIAX_RETURN_IF_ERROR(CheckTier(tier));
  if (pages.size() != bytes.size() || pages.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("Spill ", What(label), ": ",
                                                   pages.size(), " pages but ",
                                                   bytes.size(), " sizes"));
  }
  uint64_t total = 0;
  for (size_t b : bytes) total += b;
  SpilledBlock block;
  block.tier = tier;
  // Reserve the whole block first, so a full tier changes nothing.
  if (tier == Tier::kDisk) {
    TRIAX_RETURN_IF_ERROR(ReserveDisk(total, label));
    for (size_t l = 0; l < pages.size(); ++l) {
      SpilledPage p;
      p.bytes = bytes[l];
      p.path = PagePath(label, static_cast<uint32_t>(l));
      block.pages.push_back(std::move(p));
    }
    absl::MutexLock lock(&mu_);
    disk_.pages += pages.size();  // used_bytes was reserved above
  } else {
    TRIAX_RETURN_IF_ERROR(ReserveHost(bytes, label, &block.pages));
  }
  auto undo = [&] {
    for (const SpilledPage& p : block.pages) FreePage(tier, p);
    block.pages.clear();
  };
  std::vector<uint8_t> staging;
  for (size_t l = 0; l < pages.size(); ++l) {
    SpilledPage& p = block.pages[l];
    absl::Status s;
    if (tier == Tier::kHost) {
      // Piece by piece from the matching offsets of the device page; the
      // checksum runs over the pieces in page order.
      uint32_t crc = 0;
      size_t at = 0;
      for (const HostPiece& piece : p.host_pieces) {
        uint8_t* dst = host_base_ + piece.offset;
        s = device_->CopyToHost(dst, pages[l] + at, piece.bytes);
        if (!s.ok()) break;
        crc = Crc32c(dst, piece.bytes, crc);
        at += piece.bytes;
      }
      if (s.ok()) p.crc = crc;
    } else {
      staging.resize(p.bytes);
      s = device_->CopyToHost(staging.data(), pages[l], p.bytes);
      if (s.ok()) {
        p.crc = Crc32c(staging.data(), p.bytes);
        s = WriteFile(p.path, staging.data(), p.bytes, p.crc,
                      static_cast<uint32_t>(l), label.lineage_id);
      }
    }
    if (!s.ok()) {
      undo();
      return absl::Status(
          s.code(),
          absl::StrCat("Spill ", What(label), " layer ", l, " to the ",
                       TierLabel(tier), " tier: ", s.message()));
    }
  }
  absl::MutexLock lock(&mu_);
  (tier == Tier::kHost ? host_ : disk_).blocks += 1;
  return block;
}

absl::Status TierStore::Restore(const SpilledBlock& block,
                                absl::Span<uint8_t* const> dst,
                                const BlockLabel& label) {
  if (block.tier != Tier::kHost && block.tier != Tier::kDisk) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Restore ", What(label), ": the block is not in a spill tier"));
  }
  if (dst.size() != block.pages.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Restore ", What(label), ": ", dst.size(),
                     " destination pages for ", block.pages.size()));
  }
  std::vector<uint8_t> buf;
  for (size_t l = 0; l < block.pages.size(); ++l) {
    const SpilledPage& page = block.pages[l];
    if (block.tier == Tier::kHost) {
      // Verified in place, then copied piece by piece to the matching
      // offsets of the device page (no gather copy; on CUDA every piece
      // stays a pinned-memory DMA).
      TRIAX_RETURN_IF_ERROR(VerifyHost(page, static_cast<uint32_t>(l), label));
      size_t at = 0;
      for (const HostPiece& piece : page.host_pieces) {
        TRIAX_RETURN_IF_ERROR(device_->CopyFromHost(
            dst[l] + at, host_base_ + piece.offset, piece.bytes));
        at += piece.bytes;
      }
      continue;
    }
    TRIAX_ASSIGN_OR_RETURN(
        const uint8_t* src,
        LoadVerified(block, static_cast<uint32_t>(l), label, &buf));
    TRIAX_RETURN_IF_ERROR(device_->CopyFromHost(dst[l], src, page.bytes));
  }
  return absl::OkStatus();
}

absl::Status TierStore::ReadPage(const SpilledBlock& block, uint32_t layer,
                                 const BlockLabel& label,
                                 std::vector<uint8_t>* out) {
  if (block.tier != Tier::kHost && block.tier != Tier::kDisk) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ReadPage ", What(label), ": the block is not in a spill tier"));
  }
  if (layer >= block.pages.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ReadPage ", What(label), ": layer ", layer,
                     " of a block of ", block.pages.size(), " pages"));
  }
  std::vector<uint8_t> buf;
  TRIAX_ASSIGN_OR_RETURN(const uint8_t* src,
                         LoadVerified(block, layer, label, &buf));
  out->assign(src, src + block.pages[layer].bytes);
  return absl::OkStatus();
}

absl::StatusOr<SpilledBlock> TierStore::Move(const SpilledBlock& block, Tier to,
                                             const BlockLabel& label) {
  TRIAX_RETURN_IF_ERROR(CheckTier(to));
  if (block.tier != Tier::kHost && block.tier != Tier::kDisk) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Move ", What(label), ": the block is not in a spill tier"));
  }
  if (to == block.tier) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Move ", What(label), ": already in the ", TierLabel(to), " tier"));
  }
  const uint64_t total = block.bytes();
  SpilledBlock moved;
  moved.tier = to;
  if (to == Tier::kDisk) {
    TRIAX_RETURN_IF_ERROR(ReserveDisk(total, label));
    for (size_t l = 0; l < block.pages.size(); ++l) {
      SpilledPage p;
      p.bytes = block.pages[l].bytes;
      p.path = PagePath(label, static_cast<uint32_t>(l));
      moved.pages.push_back(std::move(p));
    }
    absl::MutexLock lock(&mu_);
    disk_.pages += block.pages.size();
  } else {
    std::vector<size_t> sizes;
    for (const SpilledPage& p : block.pages) sizes.push_back(p.bytes);
    TRIAX_RETURN_IF_ERROR(ReserveHost(sizes, label, &moved.pages));
  }
  auto undo = [&] {
    for (const SpilledPage& p : moved.pages) FreePage(to, p);
    moved.pages.clear();
  };
  std::vector<uint8_t> buf;
  for (size_t l = 0; l < block.pages.size(); ++l) {
    absl::StatusOr<const uint8_t*> src =
        LoadVerified(block, static_cast<uint32_t>(l), label, &buf);
    absl::Status s = src.status();
    if (s.ok()) {
      s = Put(to, *src, block.pages[l].bytes, block.pages[l].crc,
              static_cast<uint32_t>(l), label, &moved.pages[l]);
    }
    if (!s.ok()) {
      undo();
      return s;
    }
  }
  absl::MutexLock lock(&mu_);
  (to == Tier::kHost ? host_ : disk_).blocks += 1;
  return moved;
}

void TierStore::Release(SpilledBlock* block) {
  if (block->tier != Tier::kHost && block->tier != Tier::kDisk) return;
  for (const SpilledPage& p : block->pages) FreePage(block->tier, p);
  {
    absl::MutexLock lock(&mu_);
    (block->tier == Tier::kHost ? host_ : disk_).blocks -= 1;
  }
  block->pages.clear();
  block->tier = Tier::kUnspecified;
}

TierUsage TierStore::Usage(Tier tier) const {
  absl::MutexLock lock(&mu_);
  if (tier == Tier::kHost) {
    TierUsage u = host_;
    if (host_arena_ != nullptr) {
      u.free_bytes = host_arena_->free_bytes();
      u.free_runs = host_arena_->free_runs();
      u.largest_free_run = host_arena_->LargestFreeRun();
    }
    return u;
  }
  if (tier == Tier::kDisk) {
    TierUsage u = disk_;
    u.free_bytes = disk_.capacity_bytes - disk_.used_bytes;
    return u;
  }
  return TierUsage{};
}

HostPageView TierStore::HostPageBytes(const SpilledPage& page) {
  if (host_base_ == nullptr || page.host_pieces.empty()) return {};
  return HostPageView(host_base_, &page.host_pieces, page.bytes);
}

}  // namespace triax::worker
