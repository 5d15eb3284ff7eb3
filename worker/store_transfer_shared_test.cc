// The ipc path at the store level: shared exports (pages pinned in place,
// named by arena offset with their CRC32Cs, kept from sealing or taken on
// the device), ImportSession::InstallShared, and what pins keep alive.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_matchers.h"
#include "worker/checksum.h"
#include "worker/store_transfer.h"
#include "worker/store_transfer_test_fixture.h"

namespace triax::worker::transfer_testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using triax::testing::IsOk;
using triax::testing::StatusIs;

class SharedTransferTest : public TransferTest {
 protected:
  // A shared export of `blocks` of `seq` into `pins`.
  absl::StatusOr<std::vector<TransferPage>> ExportShared(
      const std::string& seq, const std::vector<ExportBlock>& blocks,
      PagePins* pins) {
    ExportOptions options;
    options.pins = pins;
    return Export(seq, blocks, options);
  }
  absl::StatusOr<ImportResult> ImportShared(
      const ImportPlan& plan, const std::vector<TransferPage>& pages) {
    auto session = dst_->BeginImport(plan);
    if (!session.ok()) return session.status();
    if (absl::Status s = (*session)->InstallShared(
            pages, src_alloc_->arena_base(), src_alloc_->arena_bytes());
        !s.ok()) {
      return s;
    }
    return (*session)->Commit();
  }
};

// Every page is pinned and named by its offset with the CRC32C of its
// bytes; the destination ends with the bytes a stream import gives, stored,
// re-encoded on the way or read from a tier.
TEST_F(SharedTransferTest, InstallsTheBytesTheStreamInstalls) {
  struct Case {
    Encoding from, to;
    bool spill;
  };
  const Case cases[] = {
      {Encoding(Format::kBF16), Encoding(Format::kBF16), false},
      {Encoding(Format::kINT4), Encoding(Format::kINT4), false},
      {Encoding(Format::kTQ3), Encoding(Format::kTQ3), false},
      {Encoding(Format::kINT8, Format::kINT4),
       Encoding(Format::kINT8, Format::kINT4), false},
      {Encoding(Format::kBF16), Encoding(Format::kINT4), false},
      {Encoding(Format::kINT8), Encoding(Format::kINT8), true},
      {Encoding(Format::kINT8), Encoding(Format::kINT2), true},
  };
  int n = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(Name(c.from) + " -> " + Name(c.to) +
                 (c.spill ? " spilled" : ""));
    const std::string s = "s" + std::to_string(n);
    const std::string viastream = "t" + std::to_string(n);
    const std::string viaipc = "i" + std::to_string(n);
    ++n;
    Install(src_.get(), s, Plan(kTokens, c.from), kTokens, n);
    if (c.spill) {
      const uint64_t host[] = {100}, disk[] = {101};
      ASSERT_THAT(src_->Spill(kTenant, s, host, Tier::kHost).status(), IsOk());
      ASSERT_THAT(src_->Spill(kTenant, s, disk, Tier::kDisk).status(), IsOk());
    }
    const std::vector<BlockSpec> to = Plan(kTokens, c.to);
    auto streamed = Export(s, ExportList(to));
    ASSERT_THAT(streamed.status(), IsOk());
    ASSERT_THAT(Import(DstPlan(viastream, to), *streamed).status(), IsOk());
    const uint64_t used_before = src_alloc_->Stats().used_bytes;
    {
      PagePins pins(src_alloc_.get());
      auto shared = ExportShared(s, ExportList(to), &pins);
      ASSERT_THAT(shared.status(), IsOk());
      ASSERT_EQ(shared->size(), streamed->size());
      EXPECT_EQ(pins.size(), shared->size());
      EXPECT_EQ(pins.held(), shared->size());
      for (size_t i = 0; i < shared->size(); ++i) {
        const TransferPage& p = (*shared)[i];
        EXPECT_TRUE(p.shared);
        EXPECT_TRUE(p.data.empty());
        ASSERT_EQ(p.shared_bytes, (*streamed)[i].data.size());
        ASSERT_LE(p.arena_offset + p.shared_bytes, src_alloc_->arena_bytes());
        const uint8_t* bytes = src_alloc_->arena_base() + p.arena_offset;
        EXPECT_EQ(
            0, std::memcmp(bytes, (*streamed)[i].data.data(), p.shared_bytes))
            << "page " << i;
        EXPECT_EQ(p.crc32c, (*streamed)[i].crc32c);
      }
      auto r = ImportShared(DstPlan(viaipc, to), *shared);
      ASSERT_THAT(r.status(), IsOk());
      EXPECT_EQ(r->pages, shared->size());
      ExpectSameTargetBytes(dst_.get(), viastream, dst_.get(), viaipc, 5);
      ExpectSameReads(dst_.get(), viastream, dst_.get(), viaipc);
    }
    // The pins are gone with their set: scratch pages are back in the pool.
    EXPECT_EQ(src_alloc_->Stats().used_bytes, used_before);
  }
}

// On a device whose processes time-slice, a shared export of stored pages
// takes the checksums its pages do not keep from sealing (here the window
// pages of blocks 3 and 4) in one pass per group of layers (the whole
// sequence here) before the group goes out; one that re-encodes (scratch
// pages) goes layer by layer. Both name the same pages with the same
// CRC32Cs.
TEST_F(SharedTransferTest, TimeSlicedDeviceChecksumsStoredPagesInOnePass) {
  const std::vector<BlockSpec> plan = Plan(kTokens, Encoding(Format::kINT4));
  const size_t window = 2;  // blocks 3 and 4: unsealed, no stored CRC32C
  Install(src_.get(), "s", plan, kTokens, 5);
  PagePins layered_pins(src_alloc_.get());
  device_.ClearChecksums();
  auto layered = ExportShared("s", ExportList(plan), &layered_pins);
  ASSERT_THAT(layered.status(), IsOk());
  EXPECT_EQ(device_.checksums(), std::vector<size_t>(kLayers, window));

  device_.set_time_slices_processes(true);
  device_.ClearChecksums();
  PagePins pins(src_alloc_.get());
  std::vector<uint32_t> layers_seen;
  ExportOptions options;
  options.pins = &pins;
  std::vector<TransferPage> at_once;
  ASSERT_THAT(src_->Export(kTenant, "s", ExportList(plan), options,
                           [&](uint32_t layer, std::vector<TransferPage>* p) {
                             layers_seen.push_back(layer);
                             // Every page is pinned before the first layer.
                             EXPECT_EQ(pins.size(), plan.size() * kLayers);
                             at_once.insert(at_once.end(), p->begin(),
                                            p->end());
                             return absl::OkStatus();
                           }),
              IsOk());
  EXPECT_EQ(device_.checksums(), std::vector<size_t>{window * kLayers});
  EXPECT_EQ(layers_seen, (std::vector<uint32_t>{0, 1}));
  ASSERT_EQ(at_once.size(), layered->size());
  for (size_t i = 0; i < at_once.size(); ++i) {
    EXPECT_EQ(at_once[i].arena_offset, (*layered)[i].arena_offset);
    EXPECT_EQ(at_once[i].crc32c, (*layered)[i].crc32c) << i;
    EXPECT_EQ(at_once[i].crc32c,
              Crc32c(src_alloc_->arena_base() + at_once[i].arena_offset,
                     at_once[i].shared_bytes))
        << i;
  }
  ASSERT_THAT(ImportShared(DstPlan("d", plan), at_once).status(), IsOk());
  ExpectSameReads(src_.get(), "s", dst_.get(), "d");

  // Groups of layers: one byte per group makes each layer its own group,
  // checksummed and pinned only when its turn comes.
  {
    auto alloc = PageAllocator::Create(&device_, 16 << 20);
    ASSERT_THAT(alloc.status(), IsOk());
    StoreOptions so;
    so.window_tokens = 16;
    so.prefetch_thread = false;
    so.shared_checksum_group_bytes = 1;
    SequenceStore grouped(&device_, alloc->get(), so);
    Install(&grouped, "g", plan, kTokens, 5);
    device_.ClearChecksums();
    PagePins group_pins(alloc->get());
    ExportOptions go;
    go.pins = &group_pins;
    std::vector<size_t> pinned_at_sink;
    ASSERT_THAT(grouped.Export(kTenant, "g", ExportList(plan), go,
                               [&](uint32_t, std::vector<TransferPage>* p) {
                                 pinned_at_sink.push_back(group_pins.size());
                                 for (const TransferPage& page : *p) {
                                   EXPECT_EQ(page.crc32c,
                                             Crc32c(alloc->get()->arena_base() +
                                                        page.arena_offset,
                                                    page.shared_bytes));
                                 }
                                 return absl::OkStatus();
                               }),
                IsOk());
    EXPECT_EQ(device_.checksums(), (std::vector<size_t>{window, window}));
    EXPECT_EQ(pinned_at_sink,
              (std::vector<size_t>{plan.size(), 2 * plan.size()}));
  }

  // Re-encoded on the way: layer by layer even here, every page summed.
  device_.ClearChecksums();
  PagePins int2_pins(src_alloc_.get());
  const std::vector<BlockSpec> int2 = Plan(kTokens, Encoding(Format::kINT2));
  ASSERT_THAT(ExportShared("s", ExportList(int2), &int2_pins).status(), IsOk());
  EXPECT_EQ(device_.checksums(), std::vector<size_t>(kLayers, plan.size()));
  device_.set_time_slices_processes(false);
}

// A page's CRC32C is taken when it seals, in one Device::Checksum per write,
// and kept: an export of sealed pages does no device work for checksums
// (on one GPU the source's kernels would time-slice with the peer's
// copies), and a byte that changes at rest after sealing is caught by the
// destination (DATA_LOSS) on either data path. Imports keep the verified
// CRC32C, forks carry it over, a Demote drops it until the next export.
TEST_F(SharedTransferTest, SealedPagesKeepTheirChecksums) {
  auto alloc = PageAllocator::Create(&device_, 16 << 20);
  ASSERT_THAT(alloc.status(), IsOk());
  StoreOptions so;
  so.window_tokens = 0;  // every block seals once written
  so.prefetch_thread = false;
  SequenceStore store(&device_, alloc->get(), so);
  const std::vector<BlockSpec> plan = Plan(64, Encoding(Format::kINT4));
  device_.ClearChecksums();
  ASSERT_THAT(store.AllocatePages(kTenant, "s", Model(), kBlock, plan).status(),
              IsOk());
  for (uint32_t l = 0; l < kLayers; ++l) Write(&store, "s", l, 0, 40, 9);
  // Blocks 0 and 1 sealed on each layer by the first write: one pass each.
  EXPECT_EQ(device_.checksums(), std::vector<size_t>(kLayers, 2));
  for (uint32_t l = 0; l < kLayers; ++l) Write(&store, "s", l, 40, 24, 9);
  EXPECT_EQ(device_.checksums().size(), 2 * kLayers);
  auto page_crc = [](Page* page) -> std::optional<uint32_t> {
    absl::MutexLock lock(&page->seal_mu);
    if (!page->crc_known) return std::nullopt;
    return page->crc32c;
  };
  for (uint32_t l = 0; l < kLayers; ++l) {
    for (uint32_t i = 0; i < plan.size(); ++i) {
      auto page = store.TargetPage("s", i, l);
      ASSERT_THAT(page.status(), IsOk());
      EXPECT_EQ(page_crc(*page), Crc32c((*page)->data, (*page)->bytes))
          << "block " << i << " layer " << l;
    }
  }

  // The whole export names stored CRC32Cs: no checksum pass, either way.
  for (bool time_slices : {false, true}) {
    SCOPED_TRACE(time_slices ? "time-sliced" : "layer by layer");
    device_.set_time_slices_processes(time_slices);
    device_.ClearChecksums();
    PagePins pins(alloc->get());
    ExportOptions options;
    options.pins = &pins;
    std::vector<uint32_t> layers_seen;
    ASSERT_THAT(store.Export(kTenant, "s", ExportList(plan), options,
                             [&](uint32_t layer, std::vector<TransferPage>* p) {
                               layers_seen.push_back(layer);
                               for (const TransferPage& page : *p) {
                                 EXPECT_TRUE(page.crc_known);
                               }
                               return absl::OkStatus();
                             }),
                IsOk());
    EXPECT_THAT(device_.checksums(), ::testing::IsEmpty());
    // Nothing to checksum: each layer goes as soon as it is pinned.
    EXPECT_EQ(layers_seen, (std::vector<uint32_t>{0, 1}));
  }
  device_.set_time_slices_processes(false);

  // A byte changed at rest after sealing (block 2, layer 1): both data
  // paths carry the stored CRC32C and the destination refuses the page.
  auto victim = store.TargetPage("s", 2, 1);
  ASSERT_THAT(victim.status(), IsOk());
  uint8_t* byte = (*victim)->data + 100;
  *byte ^= 0x10;
  auto export_from = [&](PagePins* pins) {
    ExportOptions options;
    options.pins = pins;
    std::vector<TransferPage> all;
    EXPECT_THAT(store.Export(kTenant, "s", ExportList(plan), options,
                             [&](uint32_t, std::vector<TransferPage>* p) {
                               all.insert(all.end(), p->begin(), p->end());
                               return absl::OkStatus();
                             }),
                IsOk());
    return all;
  };
  ImportPlan dst_plan = DstPlan("d", plan);
  dst_plan.window_tokens = 0;
  {
    const std::vector<TransferPage> streamed = export_from(nullptr);
    auto session = dst_->BeginImport(dst_plan);
    ASSERT_THAT(session.status(), IsOk());
    absl::Status failed;
    for (const TransferPage& p : streamed) {
      failed = (*session)->Install(p);
      if (!failed.ok()) break;
    }
    EXPECT_THAT(failed, StatusIs(absl::StatusCode::kDataLoss,
                                 HasSubstr("lineage_id=102")));
  }
  {
    PagePins pins(alloc->get());
    const std::vector<TransferPage> shared = export_from(&pins);
    auto session = dst_->BeginImport(dst_plan);
    ASSERT_THAT(session.status(), IsOk());
    EXPECT_THAT(
        (*session)->InstallShared(shared, alloc->get()->arena_base(),
                                  alloc->get()->arena_bytes()),
        StatusIs(absl::StatusCode::kDataLoss, HasSubstr("lineage_id=102")));
  }
  *byte ^= 0x10;  // mended: the import goes through and keeps the CRC32Cs
  {
    PagePins pins(alloc->get());
    const std::vector<TransferPage> shared = export_from(&pins);
    auto session = dst_->BeginImport(dst_plan);
    ASSERT_THAT(session.status(), IsOk());
    ASSERT_THAT((*session)->InstallShared(shared, alloc->get()->arena_base(),
                                          alloc->get()->arena_bytes()),
                IsOk());
    ASSERT_THAT((*session)->Commit().status(), IsOk());
  }
  for (uint32_t l = 0; l < kLayers; ++l) {
    for (uint32_t i = 0; i < plan.size(); ++i) {
      auto page = dst_->TargetPage("d", i, l);
      ASSERT_THAT(page.status(), IsOk());
      EXPECT_EQ(page_crc(*page), Crc32c((*page)->data, (*page)->bytes));
    }
  }

  // A Demote re-encodes: those pages are summed again on their next export.
  std::vector<BlockSpec> after = plan;
  after[1].encoding = Encoding(Format::kINT2);
  ASSERT_THAT(store.Demote(kTenant, "s", {after[1]}).status(), IsOk());
  auto demoted_page = store.TargetPage("s", 1, 0);
  ASSERT_THAT(demoted_page.status(), IsOk());
  EXPECT_EQ(page_crc(*demoted_page), std::nullopt);
  device_.ClearChecksums();
  {
    PagePins pins(alloc->get());
    ExportOptions options;
    options.pins = &pins;
    ASSERT_THAT(store.Export(kTenant, "s", ExportList(after), options,
                             [&](uint32_t, std::vector<TransferPage>* p) {
                               for (const TransferPage& page : *p) {
                                 EXPECT_EQ(page.crc32c,
                                           Crc32c(alloc->get()->arena_base() +
                                                      page.arena_offset,
                                                  page.shared_bytes));
                               }
                               return absl::OkStatus();
                             }),
                IsOk());
  }
  EXPECT_EQ(device_.checksums(), std::vector<size_t>(kLayers, 1));
}

// A pinned page keeps its bytes where the peer reads them while the source
// frees the sequence and compacts its arena.
TEST_F(SharedTransferTest, PinnedPagesOutliveAFreeAndACompaction) {
  const std::vector<BlockSpec> plan = Plan(kTokens, Encoding(Format::kINT4));
  Install(src_.get(), "s", plan, kTokens, 3);
  Install(src_.get(), "ref", plan, kTokens, 3);
  PagePins pins(src_alloc_.get());
  auto shared = ExportShared("s", ExportList(plan), &pins);
  ASSERT_THAT(shared.status(), IsOk());
  ASSERT_THAT(src_->Free(kTenant, "s").status(), IsOk());
  ASSERT_THAT(src_->Compact().status(), IsOk());
  // The pages still hold what was exported (their CRC32Cs match).
  for (const TransferPage& p : *shared) {
    EXPECT_EQ(p.crc32c, Crc32c(src_alloc_->arena_base() + p.arena_offset,
                               p.shared_bytes));
  }
  ASSERT_THAT(ImportShared(DstPlan("d", plan), *shared).status(), IsOk());
  ExpectSameReads(src_.get(), "ref", dst_.get(), "d");
  ExpectSameAttention(src_.get(), "ref", dst_.get(), "d");
  // Released halfway, then all: the freed sequence's pages go back.
  const uint64_t ref_only = src_alloc_->Stats().used_bytes;
  pins.ReleaseFirst(pins.size() / 2);
  EXPECT_EQ(pins.held(), pins.size() - pins.size() / 2);
  EXPECT_LT(src_alloc_->Stats().used_bytes, ref_only);
  pins.ReleaseFirst(pins.size());
  EXPECT_EQ(pins.held(), 0u);
  ASSERT_THAT(src_->Free(kTenant, "ref").status(), IsOk());
  EXPECT_EQ(src_alloc_->Stats().used_bytes, 0u);
}

// A hostile or broken source: offsets outside its arena, a page with bytes,
// a page twice in one batch, a CRC32C that does not match the bytes. Each
// is refused, nothing of the batch counts, and an aborted session leaves
// the destination empty.
TEST_F(SharedTransferTest, InstallSharedRefusesBadPages) {
  const std::vector<BlockSpec> plan = Plan(kTokens, Encoding(Format::kINT4));
  Install(src_.get(), "s", plan, kTokens);
  PagePins pins(src_alloc_.get());
  auto shared = ExportShared("s", ExportList(plan), &pins);
  ASSERT_THAT(shared.status(), IsOk());
  struct Case {
    std::function<void(std::vector<TransferPage>*)> mutate;
    absl::StatusCode code;
    std::string message;
  };
  const uint64_t arena = src_alloc_->arena_bytes();
  const std::vector<Case> cases = {
      {[&](auto* p) { (*p)[1].arena_offset = arena - 8; },
       absl::StatusCode::kInvalidArgument, "outside the source's arena"},
      {[&](auto* p) { (*p)[0].shared_bytes = ~uint64_t{0}; },
       absl::StatusCode::kInvalidArgument, "outside the source's arena"},
      {[](auto* p) { (*p)[2].shared = false; },
       absl::StatusCode::kInvalidArgument, "a page with bytes"},
      {[](auto* p) { (*p)[3] = (*p)[2]; }, absl::StatusCode::kInvalidArgument,
       "twice in one batch"},
      {[](auto* p) { (*p)[4].shared_bytes -= 16; },
       absl::StatusCode::kInvalidArgument, "data has"},
      {[](auto* p) { (*p)[5].crc32c ^= 1; }, absl::StatusCode::kDataLoss,
       "CRC32C of the copied page"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    std::vector<TransferPage> bad = *shared;
    c.mutate(&bad);
    EXPECT_THAT(ImportShared(DstPlan("d", plan), bad).status(),
                StatusIs(c.code, HasSubstr(c.message)));
    EXPECT_EQ(dst_alloc_->Stats().used_bytes, 0u);
    EXPECT_THAT(dst_->Inventory().sequence_ids, ::testing::IsEmpty());
  }
  // Stream pages are refused by the stream's Install the other way round.
  auto session = dst_->BeginImport(DstPlan("d", plan));
  ASSERT_THAT(session.status(), IsOk());
  EXPECT_THAT(
      (*session)->Install((*shared)[0]),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shared page")));
}

// Runs of shared pages as RunWriter (worker/convert.h) groups them:
// consecutive blocks of a layer with one encoding, sealed flag, num_tokens
// and length whose offsets step by one stride. The source lays a sequence
// out block by block, so a run's pages are not adjacent in its arena.
struct Runs {
  std::vector<uint64_t> lineage;
  std::vector<uint32_t> crc;
  std::vector<SharedRun> runs;
};
Runs RunsOf(const std::vector<TransferPage>& pages) {
  Runs r;
  r.lineage.reserve(pages.size());
  r.crc.reserve(pages.size());
  for (const TransferPage& p : pages) {
    r.lineage.push_back(p.lineage_id);
    r.crc.push_back(p.crc32c);
    if (!r.runs.empty()) {
      SharedRun& run = r.runs.back();
      const bool joins =
          p.layer == run.layer &&
          p.block_index == run.first_block + run.count &&
          p.encoding == run.encoding && p.sealed == run.sealed &&
          p.num_tokens == run.num_tokens && p.shared_bytes == run.bytes &&
          (run.count == 1
               ? p.arena_offset >= run.offset + run.bytes
               : p.arena_offset == run.offset + run.stride * run.count);
      if (joins) {
        if (run.count == 1) run.stride = p.arena_offset - run.offset;
        run.count += 1;
        continue;
      }
    }
    SharedRun& run = r.runs.emplace_back();
    run.layer = p.layer;
    run.first_block = p.block_index;
    run.count = 1;
    run.encoding = p.encoding;
    run.num_tokens = p.num_tokens;
    run.sealed = p.sealed;
    run.offset = p.arena_offset;
    run.stride = p.shared_bytes;
    run.bytes = p.shared_bytes;
  }
  size_t at = 0;
  for (SharedRun& run : r.runs) {
    run.lineage_ids = r.lineage.data() + at;
    run.crc32cs = r.crc.data() + at;
    at += run.count;
  }
  return r;
}

constexpr uint32_t kLongTokens = 8 * kBlock + 7;

// Runs install what their pages install, at once (InstallSharedRuns) or in
// a pipeline of one run a batch (StartSharedRuns: a batch installed while
// the next one's copies run; Commit installs the last).
TEST_F(SharedTransferTest, RunsInstallWhatTheirPagesInstall) {
  const std::vector<BlockSpec> plan =
      Plan(kLongTokens, Encoding(Format::kINT4));
  Install(src_.get(), "s", plan, kLongTokens, 5);
  PagePins pins(src_alloc_.get());
  auto shared = ExportShared("s", ExportList(plan), &pins);
  ASSERT_THAT(shared.status(), IsOk());
  const Runs r = RunsOf(*shared);
  uint32_t longest = 0;
  for (const SharedRun& run : r.runs) {
    longest = std::max(longest, run.count);
    if (run.count > 1) EXPECT_GT(run.stride, run.bytes);  // not adjacent
  }
  ASSERT_GE(longest, 4u);
  ASSERT_LT(r.runs.size(), shared->size());
  {
    auto session = dst_->BeginImport(DstPlan("d", plan));
    ASSERT_THAT(session.status(), IsOk());
    ASSERT_THAT((*session)->InstallSharedRuns(r.runs, src_alloc_->arena_base(),
                                              src_alloc_->arena_bytes()),
                IsOk());
    auto done = (*session)->Commit();
    ASSERT_THAT(done.status(), IsOk());
    EXPECT_EQ(done->pages, shared->size());
  }
  ExpectSameReads(src_.get(), "s", dst_.get(), "d");
  ExpectSameAttention(src_.get(), "s", dst_.get(), "d");
  {
    auto session = dst_->BeginImport(DstPlan("p", plan));
    ASSERT_THAT(session.status(), IsOk());
    for (const SharedRun& run : r.runs) {
      ASSERT_THAT(
          (*session)->StartSharedRuns({&run, 1}, src_alloc_->arena_base(),
                                      src_alloc_->arena_bytes()),
          IsOk());
      EXPECT_EQ((*session)->SharedInFlight(), 1u);
    }
    auto done = (*session)->Commit();  // installs the last batch
    ASSERT_THAT(done.status(), IsOk());
    EXPECT_EQ(done->pages, shared->size());
    EXPECT_EQ((*session)->SharedInFlight(), 0u);
  }
  ExpectSameReads(src_.get(), "s", dst_.get(), "p");
  // The destination's pages were pinned only while their copies ran.
  ASSERT_THAT(dst_->Free(kTenant, "d").status(), IsOk());
  ASSERT_THAT(dst_->Free(kTenant, "p").status(), IsOk());
  EXPECT_EQ(dst_alloc_->Stats().used_bytes, 0u);
}

// A page in the middle of a run whose copy does not match the source's
// CRC32C (a wrong CRC32C sent, or bytes changed in the source's arena) is
// DATA_LOSS naming its block and layer, nothing of the batch installs, and
// the aborted import leaves the destination empty; in the pipeline the
// mismatch surfaces when the next batch starts (or at FinishShared).
TEST_F(SharedTransferTest, ACorruptPageInTheMiddleOfARunIsDataLoss) {
  const std::vector<BlockSpec> plan =
      Plan(kLongTokens, Encoding(Format::kINT4));
  Install(src_.get(), "s", plan, kLongTokens, 6);
  PagePins pins(src_alloc_.get());
  auto shared = ExportShared("s", ExportList(plan), &pins);
  ASSERT_THAT(shared.status(), IsOk());
  Runs r = RunsOf(*shared);
  size_t j = 0;  // the first run of 3 or more pages
  while (j < r.runs.size() && r.runs[j].count < 3) ++j;
  ASSERT_LT(j, r.runs.size());
  ASSERT_LT(j + 1, r.runs.size());
  const SharedRun run = r.runs[j];
  const uint32_t k = run.count / 2;
  const uint32_t block = run.first_block + k;
  const std::string names =
      absl::StrCat("block ", block, " (lineage_id=", plan[block].lineage_id,
                   ") layer ", run.layer);
  uint32_t* crc = const_cast<uint32_t*>(run.crc32cs) + k;
  uint8_t* byte = src_alloc_->arena_base() + run.offset + run.stride * k + 5;
  const std::function<void()> corrupt[] = {[&] { *crc ^= 0x100; },
                                           [&] { *byte ^= 0x21; }};
  for (const auto& flip : corrupt) {
    flip();
    {
      auto session = dst_->BeginImport(DstPlan("d", plan));
      ASSERT_THAT(session.status(), IsOk());
      EXPECT_THAT(
          (*session)->InstallSharedRuns(r.runs, src_alloc_->arena_base(),
                                        src_alloc_->arena_bytes()),
          StatusIs(
              absl::StatusCode::kDataLoss,
              AllOf(HasSubstr(names), HasSubstr("CRC32C of the copied page"))));
      EXPECT_THAT(
          (*session)->Commit().status(),
          StatusIs(absl::StatusCode::kDataLoss, HasSubstr("never arrived")));
    }
    EXPECT_EQ(dst_alloc_->Stats().used_bytes, 0u);
    {
      auto session = dst_->BeginImport(DstPlan("d", plan));
      ASSERT_THAT(session.status(), IsOk());
      absl::Status s;
      size_t i = 0;
      for (; i < r.runs.size() && s.ok(); ++i) {
        s = (*session)->StartSharedRuns({&r.runs[i], 1},
                                        src_alloc_->arena_base(),
                                        src_alloc_->arena_bytes());
      }
      EXPECT_EQ(i, j + 2);  // run j was finished as run j + 1 started
      EXPECT_THAT(s, StatusIs(absl::StatusCode::kDataLoss, HasSubstr(names)));
      // The session goes with run j + 1 in flight: its pages are freed
      // once the device is done with them.
    }
    EXPECT_EQ(dst_alloc_->Stats().used_bytes, 0u);
    EXPECT_THAT(dst_->Inventory().sequence_ids, ::testing::IsEmpty());
    flip();  // mended
  }
  // Mended, both ways go through.
  auto session = dst_->BeginImport(DstPlan("d", plan));
  ASSERT_THAT(session.status(), IsOk());
  for (const SharedRun& each : r.runs) {
    ASSERT_THAT(
        (*session)->StartSharedRuns({&each, 1}, src_alloc_->arena_base(),
                                    src_alloc_->arena_bytes()),
        IsOk());
  }
  ASSERT_THAT((*session)->FinishShared(), IsOk());
  ASSERT_THAT((*session)->Commit().status(), IsOk());
  ExpectSameReads(src_.get(), "s", dst_.get(), "d");
}

// A run that names blocks past the plan, or whose last page lies outside
// the source's arena, is refused naming the first such page; a run of no
// pages is refused.
TEST_F(SharedTransferTest, InstallSharedRunsRefusesBadRuns) {
  const std::vector<BlockSpec> plan = Plan(kTokens, Encoding(Format::kINT4));
  Install(src_.get(), "s", plan, kTokens);
  PagePins pins(src_alloc_.get());
  auto shared = ExportShared("s", ExportList(plan), &pins);
  ASSERT_THAT(shared.status(), IsOk());
  const Runs good = RunsOf(*shared);
  const uint64_t arena = src_alloc_->arena_bytes();
  struct Case {
    std::function<void(SharedRun*)> mutate;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](SharedRun* r) { r->count = 0; }, "a run of 0 pages"},
      {[&](SharedRun* r) { r->count = static_cast<uint32_t>(plan.size()) + 1; },
       absl::StrCat("block_index=", plan.size(), " is not in the plan")},
      {[&](SharedRun* r) { r->stride = arena; }, "outside the source's arena"},
      {[](SharedRun* r) { r->layer = kLayers; }, "is >= model.n_layers"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    Runs bad = good;
    SharedRun& first = bad.runs[0];
    ASSERT_GE(first.count, 2u);
    c.mutate(&first);
    auto session = dst_->BeginImport(DstPlan("d", plan));
    ASSERT_THAT(session.status(), IsOk());
    EXPECT_THAT(
        (*session)->InstallSharedRuns(bad.runs, src_alloc_->arena_base(),
                                      arena),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)));
  }
  EXPECT_EQ(dst_alloc_->Stats().used_bytes, 0u);
}

}  // namespace
}  // namespace triax::worker::transfer_testing
