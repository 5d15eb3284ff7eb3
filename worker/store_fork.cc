// SequenceStore::Fork: a child sequence from the first num_tokens tokens of
// a parent (see "Forks" in sequence_store.h). The child plan is checked
// against the parent first; then the child's blocks are built (shared blocks
// take a reference on the parent's pages, copied ones get pages of their
// own) and filled layer by layer, and the child is listed last. Until then
// nothing is visible: an error releases everything the child took.
#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/status_macros.h"
#include "worker/sequence_store.h"
#include "worker/sequence_store_internal.h"

namespace triax::worker {

using kernels::Encoding;
using kernels::Format;
using store_internal::Block;
using store_internal::IsBf16;
using store_internal::Sequence;
using store_internal::ValidatePlan;

namespace {

// Checks the child plan against the parent; returns, per child block,
// whether it shares the parent's pages (same lineage id at the same index)
// rather than copying them.
absl::StatusOr<std::vector<bool>> PlanFork(const Device& device,
                                           const Sequence& parent,
                                           uint64_t num_tokens,
                                           absl::Span<const BlockSpec> blocks)
    ABSL_SHARED_LOCKS_REQUIRED(parent.mu) {
  TRIAX_RETURN_IF_ERROR(
      ValidatePlan(device, blocks, parent.block_tokens, parent.shape));
  if (num_tokens > parent.planned) {
    return absl::OutOfRangeError(absl::StrCat("num_tokens=", num_tokens,
                                              " is past the parent's planned ",
                                              parent.planned, " tokens"));
  }
  const uint64_t child_planned =
      blocks.back().first_token + blocks.back().num_tokens;
  if (child_planned < num_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("blocks cover ", child_planned,
                     " tokens, fewer than num_tokens=", num_tokens));
  }
  for (size_t i = 0; i < parent.blocks.size(); ++i) {
    const Block& pb = parent.blocks[i];
    if (pb.spec.first_token >= num_tokens) break;
    if (pb.spec.evicted) {
      return absl::FailedPreconditionError(absl::StrCat(
          "parent block ", i, " (lineage_id=", pb.spec.lineage_id,
          ") lies within num_tokens=", num_tokens,
          " but is evicted; a fork cannot inherit evicted tokens"));
    }
    if (!pb.resident()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "parent block ", i, " (lineage_id=", pb.spec.lineage_id,
          ") lies within num_tokens=", num_tokens, " but is spilled to the ",
          TierLabel(pb.spec.tier), " tier; Restore it before forking"));
    }
  }
  std::vector<bool> shared(blocks.size(), false);
  for (size_t i = 0; i < blocks.size(); ++i) {
    const BlockSpec& want = blocks[i];
    size_t j = parent.blocks.size();
    for (size_t k = 0; k < parent.blocks.size(); ++k) {
      if (parent.blocks[k].spec.lineage_id == want.lineage_id) j = k;
    }
    if (j == parent.blocks.size()) {
      // A copied block takes its tokens from the parent's block at the same
      // index, so the tokens it inherits must all lie in that block.
      if (want.first_token < num_tokens) {
        const uint64_t inherit_end =
            std::min<uint64_t>(want.first_token + want.num_tokens, num_tokens);
        if (i >= parent.blocks.size() ||
            parent.blocks[i].spec.first_token != want.first_token ||
            inherit_end > parent.blocks[i].end()) {
          return absl::FailedPreconditionError(absl::StrCat(
              "blocks[", i, "] (first_token=", want.first_token, " num_tokens=",
              want.num_tokens, ") does not line up with the parent's block ", i,
              " within num_tokens=", num_tokens));
        }
      }
      continue;
    }
    const BlockSpec& have = parent.blocks[j].spec;
    // A shared block keeps the parent's (current) encoding.
    if (j != i || have.first_token != want.first_token ||
        have.num_tokens != want.num_tokens) {
      return absl::FailedPreconditionError(
          absl::StrCat("blocks[", i, "] (lineage_id=", want.lineage_id,
                       ") mismatches the parent's block ", j, " (first_token=",
                       have.first_token, " num_tokens=", have.num_tokens, ")"));
    }
    if (have.first_token + have.num_tokens > num_tokens) {
      return absl::FailedPreconditionError(absl::StrCat(
          "blocks[", i, "] (lineage_id=", want.lineage_id, ") ends at token ",
          have.first_token + have.num_tokens, ", past num_tokens=", num_tokens,
          "; only whole blocks are shared"));
    }
    for (uint32_t l = 0; l < parent.model.n_layers; ++l) {
      if (parent.written[l] < have.first_token + have.num_tokens) {
        return absl::FailedPreconditionError(
            absl::StrCat("blocks[", i, "] (lineage_id=", want.lineage_id,
                         ") is not fully written in the parent on layer ", l,
                         " (", parent.written[l],
                         " tokens written); only written blocks are "
                         "shared"));
      }
    }
    shared[i] = true;
  }
  return shared;
}

// The child's block records with their target pages: a shared block is the
// parent's record with a reference on its pages, a copied one the plan's
// block (its tier fields ignored) with fresh pages. On an error the pages
// taken so far stay in `child` for the caller to release.
absl::Status BuildForkBlocks(PageAllocator& allocator, const Sequence& parent,
                             Sequence& child,
                             absl::Span<const BlockSpec> blocks,
                             const std::vector<bool>& shared,
                             ForkResult* result)
    ABSL_SHARED_LOCKS_REQUIRED(parent.mu)
        ABSL_EXCLUSIVE_LOCKS_REQUIRED(child.mu) {
  const uint32_t layers = child.model.n_layers;
  for (size_t i = 0; i < blocks.size(); ++i) {
    Block b;
    if (shared[i]) {
      b.spec = parent.blocks[i].spec;
    } else {
      b.spec = blocks[i];
      b.spec.tier = Tier::kDevice;
      b.spec.evicted = false;
    }
    b.window.assign(layers, nullptr);
    b.target.assign(layers, nullptr);
    child.blocks.push_back(std::move(b));
    Block& cb = child.blocks.back();
    for (uint32_t l = 0; l < layers; ++l) {
      if (shared[i]) {
        cb.target[l] = parent.blocks[i].target[l];
        allocator.Ref(cb.target[l]);
        ++result->pages_shared;
        continue;
      }
      absl::StatusOr<Page*> p = allocator.Allocate(
          cb.spec.encoding, kernels::PageBytes(cb.spec.encoding, child.shape),
          PageUse::kTarget);
      if (!p.ok()) {
        return absl::Status(
            p.status().code(),
            absl::StrCat("ForkSequence child_sequence_id=", Quote(child.id),
                         " blocks[", i, "] layer ", l, ": ",
                         p.status().message()));
      }
      cb.target[l] = *p;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SequenceStore::CopyTokensAsBf16(
    const Sequence& src, uint32_t block, uint32_t layer, uint32_t tokens,
    uint8_t* dst) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const Block& b = src.blocks[block];
  const bool in_target = block < src.sealed[layer] || IsBf16(b.spec.encoding);
  const Page* page = in_target ? b.target[layer] : b.window[layer];
  const Encoding f = in_target ? b.spec.encoding : Encoding(Format::kBF16);
  if (IsBf16(f)) {
    return device_->CopyPage(dst, page->data,
                             kernels::PageBytes(Format::kBF16, src.shape));
  }
  std::vector<uint16_t> k, v;
  TRIAX_RETURN_IF_ERROR(PageToBf16(f, src.shape, page->data, tokens, &k, &v));
  return device_->WriteBf16Tokens(src.shape, k.data(), v.data(), 0,
                                  static_cast<int>(tokens), dst);
}

// A leading run of already-encoded pages stays sealed; the rest is staged
// through BF16 (the window, or the BF16 target page).
absl::Status SequenceStore::FillForkLayer(
    const Sequence& parent, Sequence& c, const std::vector<bool>& shared,
    uint32_t l, ForkResult* result) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  bool prefix = true;
  for (size_t i = 0; i < c.blocks.size(); ++i) {
    Block& cb = c.blocks[i];
    if (c.written[l] <= cb.spec.first_token) break;
    const uint32_t tokens = static_cast<uint32_t>(std::min<uint64_t>(
        cb.spec.num_tokens, c.written[l] - cb.spec.first_token));
    const Block& pb = parent.blocks[i];
    Page* t = cb.target[l];
    bool encoded = false;
    if (shared[i]) {
      absl::MutexLock seal_lock(&t->seal_mu);
      encoded = t->encoded;
    } else {
      ++result->pages_copied;
      if (i < parent.sealed[l] && pb.spec.encoding == cb.spec.encoding &&
          tokens == cb.spec.num_tokens && tokens == pb.spec.num_tokens) {
        TRIAX_RETURN_IF_ERROR(
            device_->CopyPage(t->data, pb.target[l]->data, t->bytes));
        bool crc_known = false;
        uint32_t crc = 0;
        {
          Page* from = pb.target[l];
          absl::MutexLock parent_lock(&from->seal_mu);
          crc_known = from->encoded && from->crc_known;
          crc = from->crc32c;
        }
        absl::MutexLock seal_lock(&t->seal_mu);
        t->encoded = encoded = true;
        t->crc_known = crc_known;
        t->crc32c = crc;
      }
    }
    if (encoded && prefix) {
      c.sealed[l] += 1;
      continue;
    }
    prefix = false;
    if (IsBf16(cb.spec.encoding)) {
      if (shared[i]) continue;  // the shared page already holds the data
      TRIAX_RETURN_IF_ERROR(CopyTokensAsBf16(parent, static_cast<uint32_t>(i),
                                             l, tokens, t->data));
      continue;
    }
    absl::StatusOr<Page*> w = allocator_->Allocate(
        Format::kBF16, kernels::PageBytes(Format::kBF16, c.shape),
        PageUse::kWindow);
    if (!w.ok()) {
      return absl::Status(
          w.status().code(),
          absl::StrCat("ForkSequence child_sequence_id=", Quote(c.id),
                       " window page for blocks[", i, "] layer ", l, ": ",
                       w.status().message()));
    }
    cb.window[l] = *w;
    TRIAX_RETURN_IF_ERROR(CopyTokensAsBf16(parent, static_cast<uint32_t>(i), l,
                                           tokens, (*w)->data));
  }
  return SealReady(c, l);
}

absl::StatusOr<ForkResult> SequenceStore::ForkOnce(
    absl::string_view tenant_id, absl::string_view parent_id,
    absl::string_view child_id, uint64_t num_tokens,
    absl::Span<const BlockSpec> blocks, absl::string_view parent_tenant_id) {
  TRIAX_RETURN_IF_ERROR(ValidateId("tenant_id", tenant_id));
  if (parent_tenant_id.empty()) parent_tenant_id = tenant_id;
  TRIAX_RETURN_IF_ERROR(ValidateId("parent_tenant_id", parent_tenant_id));
  TRIAX_RETURN_IF_ERROR(ValidateId("parent_sequence_id", parent_id));
  TRIAX_RETURN_IF_ERROR(ValidateId("child_sequence_id", child_id));
  if (parent_id == child_id) {
    return absl::InvalidArgumentError(absl::StrCat(
        "child_sequence_id=", Quote(child_id), " equals parent_sequence_id"));
  }
  if (num_tokens == 0) {
    return absl::InvalidArgumentError("num_tokens=0; a fork needs >= 1 token");
  }
  absl::StatusOr<std::shared_ptr<Sequence>> found = Lookup(parent_id);
  if (!found.ok()) {
    return absl::NotFoundError(absl::StrCat(
        "parent_sequence_id=", Quote(parent_id), " is not on this worker"));
  }
  if (Lookup(child_id).ok()) {
    return absl::AlreadyExistsError(
        absl::StrCat("child_sequence_id=", Quote(child_id), " already exists"));
  }
  TRIAX_ASSIGN_OR_RETURN(LockedSequence locked_parent,
                         LockOwned(*std::move(found), parent_tenant_id));
  const Sequence& parent = *locked_parent;
  TRIAX_ASSIGN_OR_RETURN(std::vector<bool> shared,
                         PlanFork(*device_, parent, num_tokens, blocks));

  auto child = std::make_shared<Sequence>();
  child->id = std::string(child_id);
  ForkResult result;
  {
    absl::MutexLock child_lock(&child->mu);
    Sequence& c = *child;
    const uint32_t layers = parent.model.n_layers;
    c.tenant = std::string(tenant_id);
    c.model = parent.model;
    c.block_tokens = parent.block_tokens;
    c.window_tokens = parent.window_tokens;
    c.shape = parent.shape;
    c.sealed.assign(layers, 0);
    c.written.resize(layers);
    for (uint32_t l = 0; l < layers; ++l) {
      c.written[l] = std::min(parent.written[l], num_tokens);
    }
    c.planned = blocks.back().first_token + blocks.back().num_tokens;
    absl::Status s =
        BuildForkBlocks(*allocator_, parent, c, blocks, shared, &result);
    for (uint32_t l = 0; l < layers && s.ok(); ++l) {
      s = FillForkLayer(parent, c, shared, l, &result);
    }
    if (!s.ok()) {
      ReleaseAll(c);
      return s;
    }
  }
  {
    absl::MutexLock lock(&mu_);
    if (!sequences_.contains(child_id)) {
      sequences_.emplace(std::string(child_id), child);
      return result;
    }
  }
  absl::MutexLock child_lock(&child->mu);
  ReleaseAll(*child);
  return absl::AlreadyExistsError(
      absl::StrCat("child_sequence_id=", Quote(child_id), " already exists"));
}

}  // namespace triax::worker
