#include "kvmanager/capacity.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/ids.h"
#include "common/status_macros.h"
#include "kvmanager/calibration_store.h"
#include "kvmanager/policy.h"

namespace triax::manager {
namespace {

absl::Status Invalid(absl::string_view field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(field, what));
}

// A count from a double, saturating: a plan of 2^16 GPUs of tiny pages can
// pass what an int64 holds.
int64_t Count(double v) {
  constexpr auto kMax =
      static_cast<double>(std::numeric_limits<int64_t>::max());
  return v >= kMax ? std::numeric_limits<int64_t>::max()
                   : static_cast<int64_t>(v);
}

absl::Status Prefixed(const absl::Status& s, absl::string_view prefix) {
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

// Bytes per value of one tensor in the note's formula.
double IdealTensorBytes(Format f, const Encoding& e, int head_dim) {
  const double code = kernels::FormatBits(f) / 8.0;
  if (kernels::IsIntFormat(f)) {
    const double scale = e.scale_dtype == ScaleDtype::kFP8 ? 1 : 2;
    return code + scale / e.Group();
  }
  if (kernels::IsTqFormat(f)) return code + 2.0 / head_dim;
  return code;
}

// One encoding of a row and its weight (share of the row's tokens).
struct Part {
  Encoding encoding;
  double weight = 0;
};

// A resolved row before the arithmetic.
struct ResolvedRow {
  CapacityRow row;
  std::vector<Part> parts;
  bool uniform = false;
};

absl::Status CheckShape(const std::string& field, const Encoding& e,
                        const kernels::PageShape& shape) {
  if (const char* why = kernels::ValidateEncoding(e, shape); why != nullptr) {
    return Invalid(field,
                   absl::StrCat(" encoding ", EncodingString(e),
                                " is invalid for block_tokens ", shape.tokens,
                                ", n_kv_heads ", shape.heads, ", head_dim ",
                                shape.head_dim, ": ", why));
  }
  return absl::OkStatus();
}

// The mix's parts under a per-tag choice.
std::vector<Part> MixParts(const std::vector<CapacityTagChoice>& mix) {
  int64_t total = 0;
  for (const auto& c : mix) total += c.tokens;
  std::vector<Part> parts;
  for (const auto& c : mix) {
    if (c.tokens == 0) continue;
    parts.push_back({c.encoding, static_cast<double>(c.tokens) /
                                     static_cast<double>(total)});
  }
  return parts;
}

absl::StatusOr<ResolvedRow> ResolveRow(
    const CapacityRequest& req, const ModelShape& model, size_t i,
    const std::shared_ptr<const CalibrationTable>& table) {
  const CapacityPolicySpec& spec = req.policies[i];
  const std::string field = absl::StrCat("policies[", i, "]");
  const kernels::PageShape shape = PageShapeOf(model, req.block_tokens);
  const bool uniform = spec.encoding.format != static_cast<Format>(0);
  const bool named = !spec.policy.empty();
  const bool allocation = spec.budget_bits != 0;
  if (int(uniform) + int(named) + int(allocation) != 1) {
    return Invalid(
        field,
        absl::StrCat(" must set exactly one of encoding, policy and "
                     "budget_bits (has encoding ",
                     uniform ? "set" : "unset", ", policy ", Quote(spec.policy),
                     ", budget_bits ", spec.budget_bits, ")"));
  }
  if (spec.window_tokens > kMaxBlockTokens * 64) {
    return Invalid(field, absl::StrCat(".window_tokens=", spec.window_tokens,
                                       " is above ", kMaxBlockTokens * 64));
  }
  if (!uniform && spec.sink_tokens != 0) {
    return Invalid(field, absl::StrCat(".sink_tokens=", spec.sink_tokens,
                                       " is for encoding rows only (mixed "
                                       "rows have the sink tag)"));
  }
  ResolvedRow r;
  r.row.window_tokens = spec.window_tokens;
  r.row.sink_tokens = spec.sink_tokens;
  if (uniform) {
    TRIAX_ASSIGN_OR_RETURN(const Encoding e,
                           ResolveEncoding(field + ".encoding", spec.encoding));
    TRIAX_RETURN_IF_ERROR(CheckShape(field, e, shape));
    r.uniform = true;
    r.parts.push_back({e, 1});
    r.row.kind = "uniform";
    r.row.encoding = EncodingString(e);
    r.row.label = r.row.encoding;
    // The --policies syntax of kvctl plan.
    if (spec.sink_tokens > 0) {
      absl::StrAppend(&r.row.label, "+sink=", spec.sink_tokens);
    }
    if (spec.window_tokens > 0) {
      absl::StrAppend(&r.row.label, "+window=", spec.window_tokens);
    }
    if (!spec.label.empty()) r.row.label = spec.label;
    return r;
  }

  std::shared_ptr<const Policy> policy;
  if (named) {
    policy = FindBuiltinPolicy(spec.policy);
    for (const PolicyInfo& p : req.policies_known) {
      if (policy != nullptr) break;
      if (p.name != spec.policy) continue;
      TRIAX_ASSIGN_OR_RETURN(policy, BuildPolicy(p));
    }
    if (policy == nullptr) {
      return Invalid(field, absl::StrCat(".policy=", Quote(spec.policy),
                                         " is no built-in or stored policy"));
    }
  } else {
    if (!std::isfinite(spec.budget_bits) || spec.budget_bits <= 0 ||
        spec.budget_bits > kMaxBudgetBits) {
      return Invalid(field,
                     absl::StrCat(".budget_bits=", spec.budget_bits,
                                  " is outside (0, ", kMaxBudgetBits, "]"));
    }
    if (spec.objective != 0 && spec.objective != 1) {
      return Invalid(field, absl::StrCat(".objective=", spec.objective,
                                         " is neither 0 (KL) nor 1 (DNLL)"));
    }
    if (!std::isfinite(spec.answer_weight) || spec.answer_weight < 0) {
      return Invalid(field, absl::StrCat(".answer_weight=", spec.answer_weight,
                                         " is not finite and >= 0"));
    }
    if (table == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          field, " (budget_bits ", spec.budget_bits,
          ") needs a calibration table: give calibration or name a stored "
          "one"));
    }
    PolicyInfo info;
    info.name = "plan";
    info.budget_bits = spec.budget_bits;
    info.calibration_model = table->info.model;
    info.objective = spec.objective;
    info.answer_weight = spec.answer_weight;
    TRIAX_ASSIGN_OR_RETURN(policy, BuildPolicy(info));
  }

  int64_t mix_tokens = 0;
  for (const TagTokens& t : req.tag_mix) mix_tokens += t.tokens;
  if (mix_tokens == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        field, " (", named ? Quote(spec.policy) : "budget_bits",
        ") gives each tag its own encoding and needs a tag mix: give "
        "tag_mix or ask for the live one"));
  }
  r.row.label = spec.label;
  if (policy->IsAllocation()) {
    if (table == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat(field, " (allocation policy ", Quote(policy->name),
                       ") needs a calibration table: give calibration or "
                       "name a stored one"));
    }
    absl::StatusOr<TagAllocation> alloc = SequencePlanner::Allocate(
        *policy, *table, model, req.block_tokens, req.tag_mix,
        /*allow_infeasible=*/false, /*infeasible=*/nullptr);
    if (!alloc.ok()) return Prefixed(alloc.status(), field + ": ");
    for (size_t k = 0; k < alloc->size(); ++k) {
      r.row.mix.push_back({(*alloc)[k].first, (*alloc)[k].second, 0});
    }
    r.row.kind = "allocation";
    const ModelShape& ts = table->info.shape;
    r.row.calibration_shape_matches = ts.n_layers == model.n_layers &&
                                      ts.n_kv_heads == model.n_kv_heads &&
                                      ts.head_dim == model.head_dim;
    if (r.row.label.empty()) {
      r.row.label = named ? spec.policy
                          : absl::StrCat("triaxial@", spec.budget_bits, "b");
    }
  } else {
    for (const TagTokens& t : req.tag_mix) {
      r.row.mix.push_back({t.tag, policy->EncodingFor(t.tag), 0});
    }
    r.row.kind = "rules";
    if (r.row.label.empty()) r.row.label = spec.policy;
  }
  // Allocate answers one entry per distinct tag in the mix's order
  // (SequencePlanner::GroupTags keys); tokens come from the mix.
  for (CapacityTagChoice& c : r.row.mix) {
    for (const TagTokens& t : req.tag_mix) {
      if (t.tag == c.tag) c.tokens = t.tokens;
    }
    TRIAX_RETURN_IF_ERROR(CheckShape(
        absl::StrCat(field, " tag ", TagLabel(c.tag)), c.encoding, shape));
  }
  r.row.encoding = "mix";
  r.parts = MixParts(r.row.mix);
  return r;
}

// Page bytes of `e` (one layer) with its share of the frame's tail.
double EffectivePageBytes(const Encoding& e, const kernels::PageShape& shape,
                          int64_t frame_bytes) {
  const auto page = static_cast<double>(kernels::PageBytes(e, shape));
  if (frame_bytes <= 0) return page;
  const int64_t per_frame =
      frame_bytes / static_cast<int64_t>(kernels::PageBytes(e, shape));
  return static_cast<double>(frame_bytes) / static_cast<double>(per_frame);
}

// Water-filling (see the header).
std::vector<CapacityTenantShare> ShareOut(
    const std::vector<CapacityTenant>& tenants, double usable,
    bool* floors_exceed) {
  std::vector<CapacityTenantShare> out;
  double floors = 0;
  bool all_capped = true;
  double caps = 0;
  for (const CapacityTenant& t : tenants) {
    out.push_back({t.tenant_id, t.floor_bytes, t.ceiling_bytes, 0});
    floors += static_cast<double>(t.floor_bytes);
    all_capped = all_capped && t.ceiling_bytes > 0;
    caps += static_cast<double>(t.ceiling_bytes);
  }
  *floors_exceed = floors > usable;
  auto level_share = [&](double x, const CapacityTenant& t) {
    double s = std::max(x, static_cast<double>(t.floor_bytes));
    if (t.ceiling_bytes > 0)
      s = std::min(s, static_cast<double>(t.ceiling_bytes));
    return s;
  };
  if (*floors_exceed) {
    for (size_t i = 0; i < out.size(); ++i) {
      out[i].share_bytes =
          static_cast<double>(tenants[i].floor_bytes) * usable / floors;
    }
    return out;
  }
  double level = usable;
  if (!tenants.empty() && !(all_capped && caps <= usable)) {
    // The sum of shares S(x) is piecewise linear in the level x, with
    // breaks at the floors and ceilings, and S(usable) >= usable (some
    // tenant is uncapped or the ceilings add up past it): find the segment
    // where S crosses usable and solve it exactly there.
    std::vector<double> breaks = {0, usable};
    for (const CapacityTenant& t : tenants) {
      breaks.push_back(static_cast<double>(t.floor_bytes));
      if (t.ceiling_bytes > 0) {
        breaks.push_back(static_cast<double>(t.ceiling_bytes));
      }
    }
    std::sort(breaks.begin(), breaks.end());
    auto sum_at = [&](double x) {
      double sum = 0;
      for (const CapacityTenant& t : tenants) sum += level_share(x, t);
      return sum;
    };
    double a = 0, sa = sum_at(0);
    for (const double b : breaks) {
      if (b <= a) continue;
      const double sb = sum_at(b);
      if (sb >= usable) {
        level = sb == sa ? b : a + (usable - sa) * (b - a) / (sb - sa);
        break;
      }
      a = b;
      sa = sb;
    }
  }
  for (size_t i = 0; i < out.size(); ++i) {
    out[i].share_bytes = level_share(level, tenants[i]);
  }
  return out;
}

absl::Status ValidateTenants(const std::string& field,
                             const std::vector<CapacityTenant>& tenants) {
  if (tenants.size() > kMaxCapacityTenants) {
    return Invalid(field,
                   absl::StrCat(" has ", tenants.size(), " tenants; at most ",
                                kMaxCapacityTenants));
  }
  for (size_t i = 0; i < tenants.size(); ++i) {
    const CapacityTenant& t = tenants[i];
    const std::string f = absl::StrCat(field, "[", i, "]");
    if (t.tenant_id.empty()) return Invalid(f, ".tenant_id is empty");
    for (size_t j = 0; j < i; ++j) {
      if (tenants[j].tenant_id == t.tenant_id) {
        return Invalid(f, absl::StrCat(".tenant_id=", Quote(t.tenant_id),
                                       " repeats ", field, "[", j, "]"));
      }
    }
    if (t.floor_bytes < 0) {
      return Invalid(
          f, absl::StrCat(".floor_bytes=", t.floor_bytes, " is negative"));
    }
    if (t.ceiling_bytes < 0 ||
        (t.ceiling_bytes > 0 && t.ceiling_bytes < t.floor_bytes)) {
      return Invalid(f, absl::StrCat(".ceiling_bytes=", t.ceiling_bytes,
                                     " is negative or below floor_bytes=",
                                     t.floor_bytes, " (0: no ceiling)"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateRequest(const CapacityRequest& req) {
  if (req.gpu_memory_bytes <= 0) {
    return Invalid("gpu_memory_bytes",
                   absl::StrCat("=", req.gpu_memory_bytes, " is not positive"));
  }
  if (req.gpu_count < 1 || req.gpu_count > kMaxCapacityGpus) {
    return Invalid(
        "gpu_count",
        absl::StrCat("=", req.gpu_count, " is outside 1..", kMaxCapacityGpus));
  }
  if (req.reserve_bytes < 0 || req.reserve_bytes >= req.gpu_memory_bytes) {
    return Invalid("reserve_bytes",
                   absl::StrCat("=", req.reserve_bytes,
                                " is negative or leaves nothing of "
                                "gpu_memory_bytes=",
                                req.gpu_memory_bytes));
  }
  if (!(req.ceiling > 0 && req.ceiling <= 1)) {
    return Invalid("ceiling",
                   absl::StrCat("=", req.ceiling, " is outside (0, 1]"));
  }
  if (req.host_bytes < 0) {
    return Invalid("host_bytes",
                   absl::StrCat("=", req.host_bytes, " is negative"));
  }
  if (req.disk_bytes < 0) {
    return Invalid("disk_bytes",
                   absl::StrCat("=", req.disk_bytes, " is negative"));
  }
  if (req.frame_bytes < 0) {
    return Invalid("frame_bytes",
                   absl::StrCat("=", req.frame_bytes, " is negative"));
  }
  if (req.block_tokens < 1 || req.block_tokens > kMaxBlockTokens) {
    return Invalid("block_tokens",
                   absl::StrCat("=", req.block_tokens, " is outside 1..",
                                kMaxBlockTokens));
  }
  if (req.policies.empty() || req.policies.size() > kMaxCapacityPolicies) {
    return Invalid("policies",
                   absl::StrCat(" has ", req.policies.size(), " rows; 1..",
                                kMaxCapacityPolicies));
  }
  if (req.context_lengths.size() > kMaxCapacityContexts) {
    return Invalid("context_lengths",
                   absl::StrCat(" has ", req.context_lengths.size(),
                                " lengths; at most ", kMaxCapacityContexts));
  }
  for (size_t i = 0; i < req.context_lengths.size(); ++i) {
    if (req.context_lengths[i] <= 0 ||
        req.context_lengths[i] > (int64_t{1} << 40)) {
      return Invalid(
          absl::StrCat("context_lengths[", i, "]"),
          absl::StrCat("=", req.context_lengths[i], " is outside 1..2^40"));
    }
  }
  TRIAX_RETURN_IF_ERROR(ValidateTenants("tenants", req.tenants));
  for (size_t i = 0; i < req.tag_mix.size(); ++i) {
    const TagTokens& t = req.tag_mix[i];
    const std::string f = absl::StrCat("tag_mix[", i, "]");
    if (!IsValid(t.tag.temporal) || !IsValid(t.tag.role) ||
        !IsValid(t.tag.modality)) {
      return Invalid(f, absl::StrCat(".tag=", TagLabel(t.tag),
                                     " needs a temporal class and a role"));
    }
    if (t.tokens < 0) {
      return Invalid(f, absl::StrCat(".tokens=", t.tokens, " is negative"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (req.tag_mix[j].tag == t.tag) {
        return Invalid(f, absl::StrCat(".tag=", TagLabel(t.tag),
                                       " repeats tag_mix[", j, "]"));
      }
    }
  }
  if (req.what_ifs.size() > kMaxCapacityWhatIfs) {
    return Invalid("what_ifs", absl::StrCat(" has ", req.what_ifs.size(),
                                            "; at most ", kMaxCapacityWhatIfs));
  }
  for (size_t i = 0; i < req.what_ifs.size(); ++i) {
    const CapacityWhatIf& w = req.what_ifs[i];
    const std::string f = absl::StrCat("what_ifs[", i, "]");
    if (w.label.empty()) return Invalid(f, ".label is empty");
    if (w.add_gpus < 0 || req.gpu_count + w.add_gpus > kMaxCapacityGpus) {
      return Invalid(f, absl::StrCat(".add_gpus=", w.add_gpus,
                                     " is negative or makes more than ",
                                     kMaxCapacityGpus, " GPUs"));
    }
  }
  return absl::OkStatus();
}

// The plan without what-ifs.
absl::StatusOr<CapacityPlan> PlanOne(const CapacityRequest& req) {
  TRIAX_RETURN_IF_ERROR(ValidateRequest(req));
  CapacityPlan plan;
  if (!req.model_preset.empty()) {
    if (req.model.n_layers != 0) {
      return Invalid("model_preset",
                     absl::StrCat("=", Quote(req.model_preset),
                                  " and model.n_layers=", req.model.n_layers,
                                  " are both given; give one"));
    }
    TRIAX_ASSIGN_OR_RETURN(plan.model,
                           PresetShape("model_preset", req.model_preset));
  } else {
    TRIAX_RETURN_IF_ERROR(ValidateModelShape(req.model, "model"));
    plan.model = req.model;
  }
  const ModelShape& model = plan.model;
  const kernels::PageShape shape = PageShapeOf(model, req.block_tokens);
  std::shared_ptr<const CalibrationTable> table;
  if (req.calibration.has_value()) {
    auto built = CalibrationStore::Build(*req.calibration);
    if (!built.ok()) return Prefixed(built.status(), "calibration: ");
    table = *std::move(built);
  }
  plan.block_tokens = req.block_tokens;
  plan.gpu_count = req.gpu_count;
  plan.context_lengths = req.context_lengths;
  const double T = req.block_tokens;
  const double gpus = static_cast<double>(req.gpu_count);
  const double per_gpu_kv =
      static_cast<double>(req.gpu_memory_bytes - req.reserve_bytes);
  plan.kv_bytes = per_gpu_kv * gpus;
  plan.usable_bytes = plan.kv_bytes * req.ceiling;
  // Pages: whole bytes, then whole frames, per GPU.
  double per_gpu_usable = std::floor(per_gpu_kv * req.ceiling);
  if (req.frame_bytes > 0) {
    per_gpu_usable = std::floor(per_gpu_usable / req.frame_bytes) *
                     static_cast<double>(req.frame_bytes);
  }
  bool floors_exceed = false;
  plan.tenants = ShareOut(req.tenants, per_gpu_usable * gpus, &floors_exceed);
  plan.floors_exceed_memory = floors_exceed;
  const double layers = model.n_layers;
  const Encoding bf16(Format::kBF16);
  const double bf16_eff = EffectivePageBytes(bf16, shape, req.frame_bytes);
  const double bf16_ideal = IdealBytesPerToken(bf16, model);

  for (size_t i = 0; i < req.policies.size(); ++i) {
    TRIAX_ASSIGN_OR_RETURN(ResolvedRow r, ResolveRow(req, model, i, table));
    CapacityRow& row = r.row;
    double eff = 0, nominal = 0, ideal = 0, bits = 0, non_bf16 = 0;
    for (const Part& p : r.parts) {
      const auto page =
          static_cast<double>(kernels::PageBytes(p.encoding, shape));
      if (req.frame_bytes > 0 && page > static_cast<double>(req.frame_bytes)) {
        return Invalid(
            "frame_bytes",
            absl::StrCat("=", req.frame_bytes, " is smaller than a page of ",
                         EncodingString(p.encoding), " (", page,
                         " bytes) in policies[", i, "]"));
      }
      eff += p.weight * EffectivePageBytes(p.encoding, shape, req.frame_bytes);
      nominal += p.weight * page;
      ideal += p.weight * IdealBytesPerToken(p.encoding, model);
      bits += p.weight * kernels::EffectiveBits(p.encoding, shape);
      if (p.encoding != bf16) non_bf16 += p.weight;
    }
    row.page_bits = bits;
    row.block_bytes = layers * eff;
    row.page_bytes_per_token = row.block_bytes / T;
    row.ideal_bytes_per_token = ideal;
    row.ideal_tokens = Count(std::round(plan.usable_bytes / ideal));
    row.page_tokens =
        Count(std::floor(per_gpu_usable / row.block_bytes) * T * gpus);
    const double stored_block = layers * nominal;
    row.host_tokens = Count(
        std::floor(static_cast<double>(req.host_bytes) / stored_block) * T);
    row.disk_tokens = Count(
        std::floor(static_cast<double>(req.disk_bytes) / stored_block) * T);

    std::vector<double> session_bytes;
    for (const int64_t L : req.context_lengths) {
      CapacitySessions s;
      s.context_tokens = L;
      const int64_t blocks = (L + req.block_tokens - 1) / req.block_tokens;
      const int64_t sink_blocks = std::min<int64_t>(
          blocks, (row.sink_tokens + req.block_tokens - 1) / req.block_tokens);
      const int64_t sealed =
          std::max<int64_t>(0, L - row.window_tokens) / req.block_tokens;
      // Non-BF16 blocks not yet sealed also hold a BF16 window page.
      double window_pages =
          static_cast<double>(blocks - std::max(sealed, sink_blocks));
      window_pages = std::max(0.0, window_pages) * non_bf16;
      const double bytes =
          layers * (static_cast<double>(sink_blocks) * bf16_eff +
                    static_cast<double>(blocks - sink_blocks) * eff +
                    window_pages * bf16_eff);
      s.page_session_bytes = static_cast<uint64_t>(std::ceil(bytes));
      s.page_sessions =
          Count(std::floor(per_gpu_usable /
                           static_cast<double>(s.page_session_bytes)) *
                gpus);
      const int64_t bf16_tokens =
          std::min<int64_t>(L, int64_t{row.sink_tokens} + row.window_tokens);
      s.ideal_session_bytes = static_cast<double>(bf16_tokens) * bf16_ideal +
                              static_cast<double>(L - bf16_tokens) * ideal;
      s.ideal_sessions =
          Count(std::floor(plan.usable_bytes / s.ideal_session_bytes));
      session_bytes.push_back(static_cast<double>(s.page_session_bytes));
      row.sessions.push_back(s);
    }
    for (const CapacityTenantShare& t : plan.tenants) {
      CapacityTenantRow tr;
      tr.tenant_id = t.tenant_id;
      tr.page_tokens = Count(std::floor(t.share_bytes / row.block_bytes) * T);
      for (const double b : session_bytes) {
        tr.page_sessions.push_back(Count(std::floor(t.share_bytes / b)));
      }
      row.tenants.push_back(std::move(tr));
    }
    plan.rows.push_back(std::move(row));
  }
  return plan;
}

}  // namespace

const std::vector<ModelPreset>& ModelPresets() {
  static const auto* const kPresets = new std::vector<ModelPreset>{
      {"llama-3-8b", 32, 8, 32, 128}, {"llama-3-70b", 80, 8, 64, 128},
      {"qwen2.5-7b", 28, 4, 28, 128}, {"qwen2.5-72b", 80, 8, 64, 128},
      {"mistral-7b", 32, 8, 32, 128},
  };
  return *kPresets;
}

absl::StatusOr<ModelShape> PresetShape(absl::string_view field,
                                       absl::string_view name) {
  std::vector<std::string> names;
  for (const ModelPreset& p : ModelPresets()) {
    if (absl::EqualsIgnoreCase(name, p.name)) {
      ModelShape m;
      m.name = p.name;
      m.n_layers = p.n_layers;
      m.n_kv_heads = p.n_kv_heads;
      m.n_q_heads = p.n_q_heads;
      m.head_dim = p.head_dim;
      return m;
    }
    names.emplace_back(p.name);
  }
  return Invalid(field,
                 absl::StrCat("=", Quote(name), " is no preset; presets: ",
                              absl::StrJoin(names, ", ")));
}

double IdealBytesPerToken(const Encoding& e, const ModelShape& m) {
  const double values =
      static_cast<double>(m.n_layers) * m.n_kv_heads * m.head_dim;
  return values * (IdealTensorBytes(e.k, e, static_cast<int>(m.head_dim)) +
                   IdealTensorBytes(e.v, e, static_cast<int>(m.head_dim)));
}

absl::StatusOr<Tag> ParseTagLabel(absl::string_view field,
                                  absl::string_view label) {
  const std::vector<absl::string_view> parts = absl::StrSplit(label, '/');
  Tag tag;
  bool ok = parts.size() == 3;
  if (ok) {
    ok = false;
    for (int t = 1; t <= 4 && !ok; ++t) {
      if (TemporalLabel(static_cast<Temporal>(t)) == parts[0]) {
        tag.temporal = static_cast<Temporal>(t);
        ok = true;
      }
    }
  }
  if (ok) {
    ok = false;
    for (int m = 1; m <= 3 && !ok; ++m) {
      if (ModalityLabel(static_cast<Modality>(m)) == parts[1]) {
        tag.modality = static_cast<Modality>(m);
        ok = true;
      }
    }
  }
  if (ok) {
    ok = false;
    for (int r = 1; r < kNumRoles && !ok; ++r) {
      if (RoleLabel(static_cast<Role>(r)) == parts[2]) {
        tag.role = static_cast<Role>(r);
        ok = true;
      }
    }
  }
  if (!ok) {
    return Invalid(field, absl::StrCat("=", Quote(label),
                                       " is no tag; want "
                                       "temporal/modality/role, e.g. "
                                       "older/text/tool_result"));
  }
  return tag;
}

absl::StatusOr<CapacityPlan> PlanCapacity(const CapacityRequest& given) {
  // A tag's modality UNSPECIFIED means TEXT (types.h), so the two are one
  // tag of the mix.
  CapacityRequest req = given;
  for (TagTokens& t : req.tag_mix) {
    if (t.tag.modality == Modality::kUnspecified) {
      t.tag.modality = Modality::kText;
    }
  }
  TRIAX_ASSIGN_OR_RETURN(CapacityPlan plan, PlanOne(req));
  for (size_t i = 0; i < req.what_ifs.size(); ++i) {
    const CapacityWhatIf& w = req.what_ifs[i];
    CapacityRequest alt = req;
    alt.what_ifs.clear();
    alt.gpu_count += w.add_gpus;
    alt.tenants.insert(alt.tenants.end(), w.add_tenants.begin(),
                       w.add_tenants.end());
    if (!w.policies.empty()) alt.policies = w.policies;
    absl::StatusOr<CapacityPlan> p = PlanOne(alt);
    if (!p.ok()) {
      return Prefixed(p.status(), absl::StrCat("what_ifs[", i, "] (",
                                               Quote(w.label), "): "));
    }
    plan.what_ifs.push_back({w.label, std::move(p->rows), std::move(p->tenants),
                             p->gpu_count, p->usable_bytes,
                             p->floors_exceed_memory});
  }
  return plan;
}

}  // namespace triax::manager
