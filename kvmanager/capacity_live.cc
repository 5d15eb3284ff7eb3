#include "kvmanager/capacity_live.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/ids.h"

namespace triax::manager {

std::vector<TagTokens> LiveTagMix(const ManagerCore& core) {
  std::map<std::tuple<int, int, int>, TagTokens> by_tag;
  auto sequences = core.ListSequences("", /*include_closed=*/false);
  if (!sequences.ok()) return {};
  for (const SequenceInfo& listed : *sequences) {
    if (listed.state != SequenceState::kOpen) continue;
    // A sequence closed since the listing is skipped.
    auto s = core.GetSequence("", listed.sequence_id);
    if (!s.ok()) continue;
    for (const BlockPlan& b : s->blocks) {
      if (b.evicted) continue;
      Tag tag = b.tag;
      if (tag.modality == Modality::kUnspecified)
        tag.modality = Modality::kText;
      const auto key = std::make_tuple(static_cast<int>(tag.temporal),
                                       static_cast<int>(tag.modality),
                                       static_cast<int>(tag.role));
      TagTokens& t = by_tag.try_emplace(key, TagTokens{tag, 0}).first->second;
      t.tokens += b.num_tokens;
    }
  }
  std::vector<TagTokens> out;
  out.reserve(by_tag.size());
  for (auto& [key, t] : by_tag) out.push_back(t);
  return out;
}

std::vector<CapacityTenant> LiveTenants(const ManagerCore& core) {
  std::vector<CapacityTenant> out;
  for (const TenantInfo& t : core.ListTenants()) {
    CapacityTenant c{t.tenant_id, 0, 0};
    for (const Budget& b : t.budgets) {
      if (b.tier != Tier::kDevice) continue;
      c.floor_bytes = static_cast<int64_t>(b.floor_bytes);
      c.ceiling_bytes = static_cast<int64_t>(b.ceiling_bytes);
    }
    out.push_back(std::move(c));
  }
  return out;
}

absl::StatusOr<LivePlanInput> LivePlanRequest(const ManagerCore& core) {
  LivePlanInput in;
  CapacityRequest& req = in.request;
  // Memory: the UP workers.
  uint64_t device = 0, host = 0, disk = 0;
  int64_t up = 0;
  for (const WorkerInfo& w : core.ListWorkers()) {
    if (w.state != WorkerState::kUp) continue;
    ++up;
    device += w.capacity_bytes;
    host += w.host_capacity_bytes;
    disk += w.disk_capacity_bytes;
  }
  if (up == 0) {
    return absl::FailedPreconditionError("no worker is up: nothing to plan");
  }
  const auto mean = [up](uint64_t total) {
    return static_cast<int64_t>(total / static_cast<uint64_t>(up));
  };
  req.gpu_count = up;
  req.gpu_memory_bytes = mean(device);
  req.host_bytes = mean(host);
  req.disk_bytes = mean(disk);
  req.reserve_bytes = 0;
  req.ceiling = 1;

  // The model and block size that hold the most open tokens.
  auto sequences = core.ListSequences("", /*include_closed=*/false);
  if (!sequences.ok()) return sequences.status();
  struct Group {
    ModelShape model;
    uint32_t block_tokens = 0;
    uint64_t tokens = 0;
    uint32_t sequences = 0;
    std::vector<std::string> policies;  // in order of first use
  };
  std::map<
      std::tuple<std::string, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t>,
      Group>
      groups;
  for (const SequenceInfo& s : *sequences) {
    if (s.state != SequenceState::kOpen) continue;
    const ModelShape& m = s.model;
    Group& g = groups[std::make_tuple(m.name, m.n_layers, m.n_kv_heads,
                                      m.n_q_heads, m.head_dim, s.block_tokens)];
    g.model = m;
    g.block_tokens = s.block_tokens;
    g.tokens += s.num_tokens;
    ++g.sequences;
    if (std::find(g.policies.begin(), g.policies.end(), s.policy) ==
        g.policies.end()) {
      g.policies.push_back(s.policy);
    }
  }
  const Group* best = nullptr;
  for (const auto& [key, g] : groups) {
    if (best == nullptr || g.tokens > best->tokens) best = &g;
  }
  if (best == nullptr) {
    return absl::FailedPreconditionError(
        "no sequence is open: nothing to plan from");
  }
  if (groups.size() > 1) {
    in.notes.push_back(absl::StrCat(
        "planned for model ", Quote(best->model.name), " with ",
        best->block_tokens, "-token blocks, which hold the most open tokens; ",
        groups.size() - 1, " other model / block size combination",
        groups.size() == 2 ? " is" : "s are", " left out"));
  }
  req.model = best->model;
  req.block_tokens = best->block_tokens;
  in.open_sequences = best->sequences;
  in.open_tokens = best->tokens;
  req.context_lengths.push_back(static_cast<int64_t>(
      (best->tokens + best->sequences - 1) / best->sequences));

  // Rows: three uniform formats, then the policies in use.
  std::set<std::string> labels;
  for (Format f : {Format::kBF16, Format::kFP8, Format::kINT4}) {
    CapacityPolicySpec row;
    row.encoding.format = f;
    row.label = kernels::FormatName(f);
    labels.insert(row.label);
    req.policies.push_back(row);
  }
  req.policies_known = core.ListPolicies();
  for (const std::string& name : best->policies) {
    if (!labels.insert(name).second) continue;
    if (req.policies.size() == kMaxCapacityPolicies) {
      in.notes.push_back(
          absl::StrCat("policy ", Quote(name), ": the plan's rows are full"));
      continue;
    }
    const PolicyInfo* known = nullptr;
    for (const PolicyInfo& p : req.policies_known) {
      if (p.name == name) known = &p;
    }
    if (known == nullptr) {
      in.notes.push_back(absl::StrCat("policy ", Quote(name),
                                      " is no longer stored: left out"));
      continue;
    }
    if (known->budget_bits > 0) {
      if (!req.calibration) {
        auto table = core.GetCalibration(known->calibration_model);
        if (!table.ok()) {
          in.notes.push_back(absl::StrCat("policy ", Quote(name), ": ",
                                          table.status().message(),
                                          ": left out"));
          continue;
        }
        req.calibration = *std::move(table);
      } else if (req.calibration->model != known->calibration_model) {
        in.notes.push_back(absl::StrCat(
            "policy ", Quote(name), " uses calibration table ",
            Quote(known->calibration_model), ", not ",
            Quote(req.calibration->model), " (one table a plan): left out"));
        continue;
      }
    }
    CapacityPolicySpec row;
    row.policy = name;
    row.label = name;
    req.policies.push_back(row);
  }
  std::vector<CapacityTenant> tenants = LiveTenants(core);
  if (tenants.size() > kMaxCapacityTenants) {
    in.notes.push_back(absl::StrCat("tenants: the first ", kMaxCapacityTenants,
                                    " of ", tenants.size(), " are planned"));
    tenants.resize(kMaxCapacityTenants);
  }
  req.tenants = std::move(tenants);
  req.tag_mix = LiveTagMix(core);
  return in;
}

}  // namespace triax::manager
