#include "kvmanager/block_ranker.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <utility>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "absl/strings/str_cat.h"

namespace triax::manager {

absl::StatusOr<PressureMode> ParsePressureMode(absl::string_view name) {
  if (name == "demote-first") return PressureMode::kDemoteFirst;
  if (name == "graph-evict") return PressureMode::kGraphEvict;
  if (name == "lru") return PressureMode::kLru;
  return absl::InvalidArgumentError(
      absl::StrCat("pressure mode \"", name,
                   "\" is not one of demote-first, graph-evict, lru"));
}

const char* PressureModeName(PressureMode mode) {
  switch (mode) {
    case PressureMode::kDemoteFirst:
      return "demote-first";
    case PressureMode::kGraphEvict:
      return "graph-evict";
    case PressureMode::kLru:
      return "lru";
  }
  return "unknown";
}

// --- Rank --------------------------------------------------------------------

namespace {

constexpr uint32_t kNoOption = std::numeric_limits<uint32_t>::max();

// One block's chosen action, before ordering (48 bytes).
struct Candidate {
  uint64_t lineage_id;
  double cost;  // final cost (kLru: age in ms)
  uint64_t bytes_freed;
  uint32_t block;
  uint32_t sequence;
  uint32_t option;  // index into the flattened options, or kNoOption
  uint32_t bucket;  // ((worker * kNumTiers + tier) << 1) | below_floor
  uint8_t action;
};

// Asks for transparent huge pages on the 2 MiB-aligned interior of a buffer
// that is about to be written for the first time: on the 2-core dev VM,
// first-touch faults of 4 KiB pages cost ~50 ms per 64 MiB, a third of the
// ranking time at 1M blocks without it (bench/results/pressure.md).
void AdviseHugePages(const void* p, size_t bytes) {
#ifdef __linux__
  constexpr uintptr_t k2M = uintptr_t{2} << 20;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
  const uintptr_t lo = (begin + k2M - 1) & ~(k2M - 1);
  const uintptr_t hi = (begin + bytes) & ~(k2M - 1);
  if (hi > lo) {
    // Offset from p rather than a pointer made from an integer.
    char* base = const_cast<char*>(static_cast<const char*>(p));
    madvise(base + (lo - begin), hi - lo, MADV_HUGEPAGE);
  }
#else
  (void)p;
  (void)bytes;
#endif
}

template <typename T>
void ReserveHuge(std::vector<T>* v, size_t n) {
  if (v->capacity() >= n) return;
  std::vector<T>().swap(*v);
  v->reserve(n);
  AdviseHugePages(v->data(), n * sizeof(T));
}

// Order-preserving image of float(v) as an unsigned integer.
inline uint32_t OrderedBits(double v) {
  const float f = static_cast<float>(v) + 0.0f;  // -0 -> +0
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Stable LSD radix sort of a[0, n) by the high 32 bits (digits of 11, 11
// and 10 bits); passes whose digit is the same for every item are skipped.
void RadixSortHigh32(uint64_t* a, uint64_t* tmp, size_t n) {
  static constexpr int kShift[3] = {32, 43, 54};
  static constexpr uint32_t kMask[3] = {2047, 2047, 1023};
  uint32_t hist[3 * 2048] = {};
  uint32_t* h[3] = {hist, hist + 2048, hist + 4096};
  for (size_t i = 0; i < n; ++i) {
    const uint64_t x = a[i];
    ++h[0][(x >> 32) & 2047];
    ++h[1][(x >> 43) & 2047];
    ++h[2][(x >> 54) & 1023];
  }
  uint64_t* src = a;
  uint64_t* dst = tmp;
  for (int p = 0; p < 3; ++p) {
    const uint32_t buckets = kMask[p] + 1;
    bool trivial = false;
    uint32_t sum = 0;
    for (uint32_t d = 0; d < buckets; ++d) {
      if (h[p][d] == n) trivial = true;
      const uint32_t c = h[p][d];
      h[p][d] = sum;
      sum += c;
    }
    if (trivial) continue;
    const int shift = kShift[p];
    const uint64_t mask = kMask[p];
    for (size_t i = 0; i < n; ++i) {
      const uint64_t x = src[i];
      dst[h[p][(x >> shift) & mask]++] = x;
    }
    std::swap(src, dst);
  }
  if (src != a) std::memcpy(a, src, n * sizeof(uint64_t));
}

absl::Status BadOption(absl::string_view field, double value,
                       absl::string_view want) {
  return absl::InvalidArgumentError(
      absl::StrCat("ranker option ", field, " = ", value, " must be ", want));
}

bool FiniteNonNegative(double v) { return v >= 0 && std::isfinite(v); }

absl::Status ValidateOptions(const RankerOptions& o) {
  const int mode = static_cast<int>(o.mode);
  if (mode < 0 || mode > 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("ranker option mode = ", mode, " is unknown"));
  }
  if (!FiniteNonNegative(o.spill_host_penalty)) {
    return BadOption("spill_host_penalty", o.spill_host_penalty,
                     "finite and >= 0");
  }
  if (!FiniteNonNegative(o.spill_disk_penalty)) {
    return BadOption("spill_disk_penalty", o.spill_disk_penalty,
                     "finite and >= 0");
  }
  if (!(o.reuse_half_life_ms > 0) || !std::isfinite(o.reuse_half_life_ms)) {
    return BadOption("reuse_half_life_ms", o.reuse_half_life_ms,
                     "finite and > 0");
  }
  if (!FiniteNonNegative(o.evict_factor)) {
    return BadOption("evict_factor", o.evict_factor, "finite and >= 0");
  }
  if (!FiniteNonNegative(o.default_evict_distortion)) {
    return BadOption("default_evict_distortion", o.default_evict_distortion,
                     "finite and >= 0");
  }
  if (!FiniteNonNegative(o.importance_weight)) {
    return BadOption("importance_weight", o.importance_weight,
                     "finite and >= 0");
  }
  if (o.threads < 1 || o.threads > kMaxRankThreads) {
    return absl::InvalidArgumentError(
        absl::StrCat("ranker option threads = ", o.threads, " must be in [1, ",
                     kMaxRankThreads, "]"));
  }
  return absl::OkStatus();
}

absl::Status OutOfRange(absl::string_view what, size_t i,
                        absl::string_view field, int64_t value, size_t n,
                        absl::string_view of) {
  return absl::InvalidArgumentError(
      absl::StrCat(what, "[", i, "].", field, " = ", value,
                   " is out of range (", n, " ", of, ")"));
}

absl::Status BadNumber(absl::string_view what, size_t i,
                       absl::string_view field, double value) {
  return absl::InvalidArgumentError(absl::StrCat(
      what, "[", i, "].", field, " = ", value, " must be finite and >= 0"));
}

// Per-block scoring state derived once per Rank.
struct Prepared {
  // Flattened options of every set.
  std::vector<uint64_t> opt_bytes;
  std::vector<double> opt_distortion;
  std::vector<Encoding> opt_encoding;
  std::vector<uint32_t> set_begin;  // size sets + 1
  std::vector<double> set_evict;    // resolved eviction distortion
  // Per worker.
  std::vector<uint8_t> host_present, disk_present;
  std::vector<uint64_t> host_room, disk_room;
  // Per tenant and tier (index tenant * kNumTiers + tier).
  std::vector<uint8_t> above;
  std::vector<double> inv_divisor;
  bool protected_role[kNumRoles] = {};
};

absl::Status Prepare(const PressureInput& in, const RankerOptions& o,
                     Prepared* p) {
  const size_t sets = in.option_sets.size();
  p->set_begin.assign(sets + 1, 0);
  p->set_evict.assign(sets, 0);
  for (size_t s = 0; s < sets; ++s) {
    const OptionSet& set = in.option_sets[s];
    if (!FiniteNonNegative(set.evict_distortion)) {
      return BadNumber("option_sets", s, "evict_distortion",
                       set.evict_distortion);
    }
    if (p->opt_bytes.size() + set.options.size() >= kNoOption) {
      return absl::InvalidArgumentError(absl::StrCat(
          "option_sets hold more than ", kNoOption - 1, " options"));
    }
    p->set_begin[s] = static_cast<uint32_t>(p->opt_bytes.size());
    double max_d = 0;
    for (size_t j = 0; j < set.options.size(); ++j) {
      const DemoteOption& opt = set.options[j];
      if (!FiniteNonNegative(opt.distortion)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "option_sets[", s, "].options[", j,
            "].distortion = ", opt.distortion, " must be finite and >= 0"));
      }
      max_d = std::max(max_d, opt.distortion);
      p->opt_bytes.push_back(opt.bytes);
      p->opt_distortion.push_back(opt.distortion);
      p->opt_encoding.push_back(opt.encoding);
    }
    double ev = set.evict_distortion;
    if (!(ev > 0)) {
      ev = max_d > 0 ? o.evict_factor * max_d : o.default_evict_distortion;
    }
    p->set_evict[s] = ev;
  }
  p->set_begin[sets] = static_cast<uint32_t>(p->opt_bytes.size());

  for (size_t i = 0; i < in.sequences.size(); ++i) {
    const SequenceView& seq = in.sequences[i];
    if (seq.tenant >= in.tenants.size()) {
      return OutOfRange("sequences", i, "tenant", seq.tenant, in.tenants.size(),
                        "tenants");
    }
    if (seq.worker >= in.workers.size()) {
      return OutOfRange("sequences", i, "worker", seq.worker, in.workers.size(),
                        "workers");
    }
  }

  const size_t nw = in.workers.size();
  p->host_present.assign(nw, 0);
  p->disk_present.assign(nw, 0);
  p->host_room.assign(nw, 0);
  p->disk_room.assign(nw, 0);
  const int host = static_cast<int>(Tier::kHost);
  const int disk = static_cast<int>(Tier::kDisk);
  for (size_t w = 0; w < nw; ++w) {
    const WorkerView& wv = in.workers[w];
    p->host_present[w] = wv.capacity[host] > 0;
    p->disk_present[w] = wv.capacity[disk] > 0;
    p->host_room[w] = wv.capacity[host] > wv.used[host]
                          ? wv.capacity[host] - wv.used[host]
                          : 0;
    p->disk_room[w] = wv.capacity[disk] > wv.used[disk]
                          ? wv.capacity[disk] - wv.used[disk]
                          : 0;
  }

  const size_t nt = in.tenants.size();
  p->above.assign(nt * kNumTiers, 0);
  p->inv_divisor.assign(nt * kNumTiers, 1.0);
  for (size_t t = 0; t < nt; ++t) {
    const TenantView& tv = in.tenants[t];
    for (int tier = 0; tier < kNumTiers; ++tier) {
      const uint64_t used = tv.used[tier];
      const uint64_t floor = tv.floor[tier];
      if (used <= floor) continue;
      p->above[t * kNumTiers + tier] = 1;
      if (floor > 0) {
        const double overage = static_cast<double>(used - floor);
        p->inv_divisor[t * kNumTiers + tier] =
            1.0 / (1.0 + overage / static_cast<double>(floor));
      }
    }
  }
  for (Role r : o.protected_roles) {
    const int v = static_cast<int>(r);
    if (v >= 0 && v < kNumRoles) p->protected_role[v] = true;
  }
  return absl::OkStatus();
}

// Everything a scoring pass reads (shared, read-only, by every part).
struct ScoreContext {
  const PressureInput* input;
  const RankerOptions* options;
  const Prepared* p;
};

// Scores blocks [b0, b1) into out[0, n) (candidate order = block order),
// with key_bucket[i] = (OrderedBits of out[i]'s sort key << 32) | bucket
// (the split pass reads these 8 bytes, not the 48-byte candidate), and
// counts them per bucket into counts[0, n_buckets) (zeroed by the caller).
// Returns the error of the first bad block of the range.
absl::Status ScoreRange(const ScoreContext& ctx, size_t b0, size_t b1,
                        Candidate* out, uint64_t* key_bucket, uint32_t* counts,
                        size_t* n_out) {
  const PressureInput& input = *ctx.input;
  const RankerOptions& options = *ctx.options;
  const Prepared& p = *ctx.p;
  const PressureMode mode = options.mode;
  const int64_t now = input.now_ms;
  const double reuse_scale = 1.0 / options.reuse_half_life_ms;
  const size_t n_sets = input.option_sets.size();
  const size_t n_seqs = input.sequences.size();
  size_t n = 0;
  *n_out = 0;
  for (size_t i = b0; i < b1; ++i) {
    const BlockView& b = input.blocks[i];
    if (b.sequence >= n_seqs) {
      return OutOfRange("blocks", i, "sequence", b.sequence, n_seqs,
                        "sequences");
    }
    if (b.option_set < -1 ||
        (b.option_set >= 0 && static_cast<size_t>(b.option_set) >= n_sets)) {
      return OutOfRange("blocks", i, "option_set", b.option_set, n_sets,
                        "option sets");
    }
    const int tier = static_cast<int>(b.tier);
    if (tier < static_cast<int>(Tier::kDevice) ||
        tier > static_cast<int>(Tier::kDisk)) {
      return absl::InvalidArgumentError(
          absl::StrCat("blocks[", i, "].tier = ", tier,
                       " is not TIER_DEVICE, TIER_HOST or TIER_DISK"));
    }
    if (!FiniteNonNegative(b.distortion)) {
      return BadNumber("blocks", i, "distortion", b.distortion);
    }
    if (!FiniteNonNegative(b.importance)) {
      return BadNumber("blocks", i, "importance", b.importance);
    }
    if (b.refcount > 1 || !b.sealed || b.bytes == 0 || b.tier == Tier::kDisk) {
      continue;
    }
    const SequenceView& seq = input.sequences[b.sequence];
    const int role = static_cast<int>(b.tag.role);
    const bool protect =
        role >= 0 && role < kNumRoles && p.protected_role[role];
    const bool device = b.tier == Tier::kDevice;
    const double tokens = static_cast<double>(b.tokens);
    const double bytes = static_cast<double>(b.bytes);

    Candidate c;
    c.lineage_id = b.lineage_id;
    c.block = static_cast<uint32_t>(i);
    c.sequence = b.sequence;
    c.option = kNoOption;
    c.bytes_freed = b.bytes;

    if (mode == PressureMode::kLru) {
      if (protect) continue;
      const int64_t last = std::max(b.last_access_ms, seq.last_access_ms);
      c.cost = now > last ? static_cast<double>(now - last) : 0.0;
      c.action = static_cast<uint8_t>(PressureAction::kEvict);
    } else {
      double best = std::numeric_limits<double>::infinity();
      uint64_t best_freed = 0;
      uint8_t best_action = 0;
      uint32_t best_option = kNoOption;
      auto consider = [&](double raw, uint64_t freed, PressureAction a,
                          uint32_t opt) {
        if (raw < best || (raw == best && freed > best_freed)) {
          best = raw;
          best_freed = freed;
          best_action = static_cast<uint8_t>(a);
          best_option = opt;
        }
      };
      if (mode == PressureMode::kDemoteFirst) {
        if (device && b.option_set >= 0) {
          const uint32_t begin = p.set_begin[b.option_set];
          const uint32_t end = p.set_begin[b.option_set + 1];
          for (uint32_t k = begin; k < end; ++k) {
            const uint64_t ob = p.opt_bytes[k];
            if (ob >= b.bytes) continue;
            const uint64_t freed = b.bytes - ob;
            const double d = std::max(0.0, p.opt_distortion[k] - b.distortion);
            consider(tokens * d / static_cast<double>(freed), freed,
                     PressureAction::kDemote, k);
          }
        }
        const bool host_ok = device && p.host_present[seq.worker] &&
                             p.host_room[seq.worker] >= b.bytes;
        const bool disk_ok =
            p.disk_present[seq.worker] && p.disk_room[seq.worker] >= b.bytes;
        if (host_ok || disk_ok) {
          const int64_t last = std::max(b.last_access_ms, seq.last_access_ms);
          const double idle =
              now > last ? static_cast<double>(now - last) : 0.0;
          const double reuse = std::exp2(-idle * reuse_scale);
          if (host_ok) {
            consider(tokens * options.spill_host_penalty * reuse / bytes,
                     b.bytes, PressureAction::kSpillHost, kNoOption);
          }
          if (disk_ok) {
            consider(tokens * options.spill_disk_penalty * reuse / bytes,
                     b.bytes, PressureAction::kSpillDisk, kNoOption);
          }
        }
      }
      if (!protect) {
        const double ev = b.option_set >= 0 ? p.set_evict[b.option_set]
                                            : options.default_evict_distortion;
        consider(tokens * ev / bytes, b.bytes, PressureAction::kEvict,
                 kNoOption);
      }
      if (best_action == 0) continue;  // nothing allowed
      const double weight = 1.0 + options.importance_weight * b.importance;
      c.cost = best * weight * p.inv_divisor[seq.tenant * kNumTiers + tier];
      if (!(c.cost >= 0)) c.cost = std::numeric_limits<double>::infinity();
      c.bytes_freed = best_freed;
      c.action = best_action;
      c.option = best_option;
    }
    const bool above = p.above[seq.tenant * kNumTiers + tier] != 0;
    c.bucket = ((seq.worker * kNumTiers + static_cast<uint32_t>(tier)) << 1) |
               (above ? 0u : 1u);
    ++counts[c.bucket];
    key_bucket[n] = (static_cast<uint64_t>(OrderedBits(
                         mode == PressureMode::kLru ? -c.cost : c.cost))
                     << 32) |
                    c.bucket;
    out[n++] = c;
  }
  *n_out = n;
  return absl::OkStatus();
}

// Runs fn(0) .. fn(parts - 1), fn(0) on the calling thread and the others
// on threads started for the call; returns when all are done.
template <typename Fn>
void RunParts(size_t parts, const Fn& fn) {
  if (parts <= 1) {
    fn(0);
    return;
  }
  std::vector<std::thread> helpers;
  helpers.reserve(parts - 1);
  for (size_t r = 1; r < parts; ++r) helpers.emplace_back([&fn, r] { fn(r); });
  fn(0);
  for (std::thread& t : helpers) t.join();
}

// Orders the items of one bucket by (key, candidate index).
void SortBucket(uint64_t* items, size_t len, std::vector<uint64_t>* tmp) {
  if (len < 2) return;
  if (len < 2048) {
    std::sort(items, items + len);
    return;
  }
  if (tmp->size() < len) {
    ReserveHuge(tmp, len);
    tmp->resize(len);
  }
  RadixSortHigh32(items, tmp->data(), len);
}

}  // namespace

// Candidates live in a raw array (no value-initialization of the whole
// buffer per Rank); part r of a parallel scoring pass writes from
// cand[r's first block], so the candidate indices used as the sort's
// tie-break are increasing in block order, with gaps.
struct RankScratch::Buffers {
  std::unique_ptr<Candidate[]> cand;
  std::unique_ptr<uint64_t[]> key_bucket;  // per candidate slot
  size_t cand_capacity = 0;
  std::vector<uint64_t> items;
  std::vector<std::vector<uint64_t>> tmp;  // one per thread

  Candidate* Candidates(size_t n) {
    if (cand_capacity < n) {
      cand.reset();
      key_bucket.reset();
      // Default-initialized on purpose: make_unique would zero n entries
      // that the ranking writes before reading.
      cand.reset(new Candidate[n]);       // NOLINT(modernize-make-unique)
      key_bucket.reset(new uint64_t[n]);  // NOLINT(modernize-make-unique)
      cand_capacity = n;
      AdviseHugePages(cand.get(), n * sizeof(Candidate));
      AdviseHugePages(key_bucket.get(), n * sizeof(uint64_t));
    }
    return cand.get();
  }
};

RankScratch::RankScratch() : buffers_(std::make_unique<Buffers>()) {}
RankScratch::~RankScratch() = default;

absl::StatusOr<Ranking> Rank(const PressureInput& input,
                             const RankerOptions& options) {
  RankScratch scratch;
  return Rank(input, options, &scratch);
}

absl::StatusOr<Ranking> Rank(const PressureInput& input,
                             const RankerOptions& options,
                             RankScratch* scratch) {
  const auto start = std::chrono::steady_clock::now();
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  const size_t nb = input.blocks.size();
  if (nb >= std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("blocks holds ", nb, " entries; at most ",
                     std::numeric_limits<uint32_t>::max() - 1));
  }
  Prepared p;
  if (absl::Status s = Prepare(input, options, &p); !s.ok()) return s;
  RankScratch::Buffers& buf = *scratch->buffers_;

  const PressureMode mode = options.mode;
  const bool lru = mode == PressureMode::kLru;
  const size_t nw = input.workers.size();
  const size_t n_buckets = nw * kNumTiers * 2;

  // Threads: at most options.threads, and one per parallel_min_blocks.
  size_t threads = static_cast<size_t>(options.threads);
  if (options.parallel_min_blocks > 0) {
    threads = std::min(threads,
                       std::max<size_t>(1, nb / options.parallel_min_blocks));
  }
  threads = std::max<size_t>(1, std::min(threads, std::max<size_t>(1, nb)));
  if (buf.tmp.size() < threads) buf.tmp.resize(threads);

  // 1. Score: at most one candidate per block, parts of equal block ranges
  // in parallel; each part counts its candidates per bucket.
  Candidate* cand = buf.Candidates(std::max<size_t>(1, nb));
  uint64_t* key_bucket = buf.key_bucket.get();
  std::vector<size_t> part_begin(threads + 1);
  for (size_t r = 0; r <= threads; ++r) part_begin[r] = nb * r / threads;
  std::vector<size_t> part_n(threads, 0);
  std::vector<uint32_t> counts(threads * n_buckets, 0);
  std::vector<absl::Status> part_status(threads);
  const ScoreContext ctx{&input, &options, &p};
  RunParts(threads, [&](size_t r) {
    part_status[r] = ScoreRange(
        ctx, part_begin[r], part_begin[r + 1], cand + part_begin[r],
        key_bucket + part_begin[r], counts.data() + r * n_buckets, &part_n[r]);
  });
  // The first bad block overall is the first in the earliest failing part.
  for (const absl::Status& s : part_status) {
    if (!s.ok()) return s;
  }

  // 2. Split by bucket (worker, tier, below_floor) with (key, index) items;
  // part r's items of a bucket follow those of parts < r (block order).
  std::vector<uint32_t> bucket_begin(n_buckets + 1, 0);
  std::vector<uint32_t> fill(threads * n_buckets);
  for (size_t k = 0; k < n_buckets; ++k) {
    uint32_t at = bucket_begin[k];
    for (size_t r = 0; r < threads; ++r) {
      fill[r * n_buckets + k] = at;
      at += counts[r * n_buckets + k];
    }
    bucket_begin[k + 1] = at;
  }
  const size_t nc = bucket_begin[n_buckets];
  std::vector<uint64_t>& items = buf.items;
  ReserveHuge(&items, nc);
  items.resize(nc);
  RunParts(threads, [&](size_t r) {
    uint32_t* f = fill.data() + r * n_buckets;
    const uint64_t* kb = key_bucket + part_begin[r];
    const uint64_t base = part_begin[r];
    for (size_t i = 0; i < part_n[r]; ++i) {
      const uint64_t x = kb[i];
      items[f[static_cast<uint32_t>(x)]++] =
          (x & 0xFFFFFFFF00000000ull) | (base + i);
    }
  });

  // 3-4. Per pool (worker, tier): order each of its two buckets by (key,
  // candidate index), gather the RankedActions in that order and order each
  // run of equal float keys exactly by (double key, lineage_id). Pools are
  // independent: threads take them largest first from a shared counter.
  Ranking ranking;
  ranking.built_ms = input.now_ms;
  ranking.blocks = nb;
  ranking.pools.assign(nw, std::vector<std::vector<RankedAction>>(kNumTiers));
  std::vector<uint32_t> order;  // pool index w * kNumTiers + t
  for (size_t q = 0; q < nw * kNumTiers; ++q) {
    if (bucket_begin[2 * q] != bucket_begin[2 * q + 2]) {
      order.push_back(static_cast<uint32_t>(q));
    }
  }
  auto pool_len = [&](uint32_t q) {
    return bucket_begin[2 * size_t{q} + 2] - bucket_begin[2 * size_t{q}];
  };
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    return pool_len(a) > pool_len(b);
  });
  auto before = [lru](const RankedAction& x, const RankedAction& y) {
    if (x.cost != y.cost) return lru ? x.cost > y.cost : x.cost < y.cost;
    return x.lineage_id < y.lineage_id;
  };
  std::atomic<size_t> next{0};
  const size_t pool_threads = std::min(threads, order.size());
  RunParts(pool_threads, [&](size_t r) {
    std::vector<uint64_t>* tmp = &buf.tmp[r];
    for (size_t o = next.fetch_add(1, std::memory_order_relaxed);
         o < order.size(); o = next.fetch_add(1, std::memory_order_relaxed)) {
      const uint32_t q = order[o];
      const size_t w = q / kNumTiers;
      const int t = static_cast<int>(q % kNumTiers);
      const size_t lo = bucket_begin[2 * size_t{q}];
      const size_t split = bucket_begin[2 * size_t{q} + 1];
      const size_t hi = bucket_begin[2 * size_t{q} + 2];
      SortBucket(items.data() + lo, split - lo, tmp);
      SortBucket(items.data() + split, hi - split, tmp);
      std::vector<RankedAction>& pool = ranking.pools[w][t];
      ReserveHuge(&pool, hi - lo);
      // A run [run, j) of equal float keys (equal high 32 bits of items)
      // inside one bucket is re-sorted by the exact order when needed,
      // while its RankedActions are still in cache.
      auto close_run = [&](size_t run, size_t j) {
        if (j - run < 2) return;
        auto b = pool.begin() + (run - lo);
        auto e = pool.begin() + (j - lo);
        if (!std::is_sorted(b, e, before)) std::sort(b, e, before);
      };
      constexpr size_t kAhead = 16;
      for (const auto& [b_lo, b_hi] :
           {std::pair<size_t, size_t>{lo, split}, {split, hi}}) {
        size_t run = b_lo;
        for (size_t j = b_lo; j < b_hi; ++j) {
          if (j + kAhead < hi) {
            __builtin_prefetch(&cand[static_cast<uint32_t>(items[j + kAhead])]);
          }
          const Candidate& c = cand[static_cast<uint32_t>(items[j])];
          if ((items[j] >> 32) != (items[run] >> 32)) {
            close_run(run, j);
            run = j;
          }
          RankedAction a;
          a.lineage_id = c.lineage_id;
          a.bytes_freed = c.bytes_freed;
          a.cost = c.cost;
          a.block = c.block;
          a.sequence = c.sequence;
          a.from = static_cast<Tier>(t);
          if (c.option != kNoOption) a.encoding = p.opt_encoding[c.option];
          a.action = static_cast<PressureAction>(c.action);
          a.above_floor = j < split;
          pool.push_back(a);
        }
        close_run(run, b_hi);
      }
    }
  });
  ranking.ranking_ms = std::chrono::duration<double, std::milli>(
                           std::chrono::steady_clock::now() - start)
                           .count();
  return ranking;
}

absl::Status ValidateWatermarks(const Watermarks& w) {
  if (!(w.low > 0) || !(w.low <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("watermark low = ", w.low, " must be in (0, 1]"));
  }
  if (!(w.high >= w.low) || !(w.high <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "watermark high = ", w.high, " must be in [low = ", w.low, ", 1]"));
  }
  return absl::OkStatus();
}

uint64_t ReclaimTarget(const Watermarks& w, uint64_t capacity, uint64_t used) {
  if (capacity == 0) return 0;
  const double cap = static_cast<double>(capacity);
  if (static_cast<double>(used) <= w.high * cap) return 0;
  const double low = std::floor(std::max(0.0, w.low) * cap);
  const uint64_t low_bytes = low >= cap ? capacity : static_cast<uint64_t>(low);
  return used > low_bytes ? used - low_bytes : 0;
}

}  // namespace triax::manager
