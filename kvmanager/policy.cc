#include "kvmanager/policy.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "common/status_macros.h"

namespace triax::manager {
namespace {

bool HasInt(const Encoding& e) {
  return kernels::IsIntFormat(e.k) || kernels::IsIntFormat(e.v);
}

Rule MakeRule(Temporal t, Role r, Encoding e) {
  Rule rule;
  rule.temporal = t;
  rule.role = r;
  rule.encoding = CanonicalEncoding(e);
  return rule;
}

std::shared_ptr<const Policy> Uniform(const char* name, Format f) {
  auto p = std::make_shared<Policy>();
  p->name = name;
  p->builtin = true;
  p->rules.push_back(MakeRule(Temporal::kUnspecified, Role::kUnspecified, f));
  return p;
}

std::vector<std::shared_ptr<const Policy>> MakeBuiltins() {
  std::vector<std::shared_ptr<const Policy>> out;
  auto tri = std::make_shared<Policy>();
  tri->name = kDefaultPolicy;
  tri->builtin = true;
  tri->rules = {
      MakeRule(Temporal::kSink, Role::kUnspecified, Format::kBF16),
      MakeRule(Temporal::kUnspecified, Role::kSystem, Format::kINT4),
      MakeRule(Temporal::kUnspecified, Role::kToolSchema, Format::kINT4),
      MakeRule(Temporal::kRecentTurns, Role::kUnspecified, Format::kINT4),
      MakeRule(Temporal::kOlder, Role::kUnspecified, Format::kINT2),
      MakeRule(Temporal::kUnspecified, Role::kUnspecified, Format::kBF16),
  };
  out.push_back(std::move(tri));
  out.push_back(Uniform("bf16", Format::kBF16));
  out.push_back(Uniform("fp8", Format::kFP8));
  out.push_back(Uniform("int8", Format::kINT8));
  out.push_back(Uniform("int4", Format::kINT4));
  out.push_back(Uniform("int2", Format::kINT2));
  out.push_back(Uniform("tq4", Format::kTQ4));
  out.push_back(Uniform("tq3", Format::kTQ3));
  out.push_back(Uniform("tq2", Format::kTQ2));
  return out;
}

}  // namespace

bool Rule::Matches(const Tag& tag) const {
  if (temporal != Temporal::kUnspecified && temporal != tag.temporal) {
    return false;
  }
  if (role != Role::kUnspecified && role != tag.role) return false;
  if (modality != Modality::kUnspecified) {
    const Modality m =
        tag.modality == Modality::kUnspecified ? Modality::kText : tag.modality;
    if (modality != m) return false;
  }
  return true;
}

Encoding Policy::EncodingFor(const Tag& tag) const {
  if (rules.empty()) return Encoding(Format::kBF16);  // allocation policies
  for (const Rule& r : rules) {
    if (r.Matches(tag)) return r.encoding;
  }
  return rules.back().encoding;  // unreachable: the last rule is a catch-all
}

bool Policy::IsPinned(const Tag& tag) const {
  for (const Rule& r : rules) {
    if (!r.Matches(tag)) continue;
    return r.encoding.k == Format::kBF16 && r.encoding.v == Format::kBF16;
  }
  return tag.temporal == Temporal::kSink;
}

bool Policy::IsCandidate(const Encoding& e) const {
  if (candidates.empty()) return true;
  return std::find(candidates.begin(), candidates.end(), e) != candidates.end();
}

PolicyInfo Policy::Info() const {
  PolicyInfo info;
  info.name = name;
  info.builtin = builtin;
  info.budget_bits = budget_bits;
  info.calibration_model = calibration_model;
  info.answer_weight = answer_weight;
  info.objective = static_cast<int>(objective);
  for (const Encoding& e : candidates) info.candidates.push_back(SpecOf(e));
  info.rules.reserve(rules.size());
  for (const Rule& r : rules) {
    info.rules.push_back(
        PolicyRuleInfo{r.temporal, r.role, r.modality, SpecOf(r.encoding)});
  }
  return info;
}

Encoding CanonicalEncoding(Encoding e) {
  if (HasInt(e)) {
    e.group = e.Group();
  } else {
    e.group = 0;
    e.scale_dtype = ScaleDtype::kFP16;
  }
  return e;
}

absl::StatusOr<Encoding> ResolveEncoding(absl::string_view field,
                                         const EncodingSpec& spec) {
  if (!IsValidFormat(spec.format)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".format is ", FormatProtoName(spec.format),
                     "; a format FORMAT_BF16..FORMAT_TQ2 is required"));
  }
  if (static_cast<int>(spec.format_v) != 0 && !IsValidFormat(spec.format_v)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".format_v is ", FormatProtoName(spec.format_v),
                     "; it must be unspecified (= format) or a valid format"));
  }
  if (spec.group_size != 0 && spec.group_size != 32 && spec.group_size != 64 &&
      spec.group_size != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".group_size ", spec.group_size,
                     " is not 0 (default 32), 32, 64 or 128"));
  }
  if (spec.scale_dtype < 0 || spec.scale_dtype > 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".scale_dtype ", spec.scale_dtype,
                     " is not SCALE_DTYPE_UNSPECIFIED, _FP16 or _FP8_E4M3"));
  }
  Encoding e;
  e.k = spec.format;
  e.v = static_cast<int>(spec.format_v) == 0 ? spec.format : spec.format_v;
  e.group = static_cast<int>(spec.group_size);
  e.scale_dtype = spec.scale_dtype == 2 ? ScaleDtype::kFP8 : ScaleDtype::kFP16;
  return CanonicalEncoding(e);
}

EncodingSpec SpecOf(const Encoding& e) {
  EncodingSpec s;
  s.format = e.k;
  s.format_v = e.v;
  if (HasInt(e)) {
    s.group_size = static_cast<uint32_t>(e.Group());
    s.scale_dtype = static_cast<int>(e.scale_dtype);
  }
  return s;
}

absl::StatusOr<std::shared_ptr<const Policy>> BuildPolicy(
    const PolicyInfo& info) {
  TRIAX_RETURN_IF_ERROR(ValidateId("policy.name", info.name));
  const bool allocation = info.budget_bits != 0;
  if (allocation && !(std::isfinite(info.budget_bits) && info.budget_bits > 0 &&
                      info.budget_bits <= kMaxBudgetBits)) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.budget_bits is ", info.budget_bits,
                     "; it must be 0 (a rule policy) or in (0, ",
                     kMaxBudgetBits, "] effective bits per value"));
  }
  if (!allocation && !info.calibration_model.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.calibration_model is ", Quote(info.calibration_model),
        " but policy.budget_bits is 0; set budget_bits > 0 for an allocation "
        "policy, or leave calibration_model empty"));
  }
  if (!(std::isfinite(info.answer_weight) && info.answer_weight >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.answer_weight is ", info.answer_weight,
                     "; it must be finite and >= 0"));
  }
  if (!allocation && info.answer_weight != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.answer_weight is ", info.answer_weight,
        " but policy.budget_bits is 0; answer_weight needs an allocation "
        "policy (budget_bits > 0)"));
  }
  if (info.objective != 0 && info.objective != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.objective is ", info.objective,
                     "; it must be OBJECTIVE_KL (0) or OBJECTIVE_DNLL (1)"));
  }
  if (!allocation && info.objective != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.objective is OBJECTIVE_DNLL but policy.budget_bits is 0; "
        "an objective needs an allocation policy (budget_bits > 0)"));
  }
  if (!allocation && !info.candidates.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.candidates has ", info.candidates.size(),
        " entries but policy.budget_bits is 0; candidates need an allocation "
        "policy (budget_bits > 0)"));
  }
  auto p = std::make_shared<Policy>();
  if (allocation) {
    TRIAX_RETURN_IF_ERROR(
        ValidateId("policy.calibration_model", info.calibration_model));
    if (info.candidates.size() > kMaxPolicyRules) {
      return absl::InvalidArgumentError(
          absl::StrCat("policy.candidates has ", info.candidates.size(),
                       " entries; the limit is ", kMaxPolicyRules));
    }
    for (size_t i = 0; i < info.candidates.size(); ++i) {
      const std::string field = absl::StrCat("policy.candidates[", i, "]");
      TRIAX_ASSIGN_OR_RETURN(Encoding e,
                             ResolveEncoding(field, info.candidates[i]));
      for (size_t j = 0; j < p->candidates.size(); ++j) {
        if (p->candidates[j] == e) {
          return absl::InvalidArgumentError(
              absl::StrCat(field, " encoding ", EncodingString(e),
                           " repeats policy.candidates[", j, "]"));
        }
      }
      p->candidates.push_back(e);
    }
    p->budget_bits = info.budget_bits;
    p->calibration_model = info.calibration_model;
    p->answer_weight = info.answer_weight;
    p->objective = static_cast<Policy::Objective>(info.objective);
  }
  if (info.rules.empty() && !allocation) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.rules is empty (policy ", Quote(info.name),
        "); at least one rule, the last a catch-all, is required"));
  }
  if (info.rules.size() > kMaxPolicyRules) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.rules has ", info.rules.size(),
                     " rules; the limit is ", kMaxPolicyRules));
  }
  p->name = info.name;
  p->rules.reserve(info.rules.size());
  for (size_t i = 0; i < info.rules.size(); ++i) {
    const PolicyRuleInfo& r = info.rules[i];
    const std::string field = absl::StrCat("policy.rules[", i, "]");
    const int t = static_cast<int>(r.temporal);
    if (t < 0 || t > static_cast<int>(Temporal::kOlder)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".temporal is ", TemporalName(r.temporal), "; out of range"));
    }
    const int role = static_cast<int>(r.role);
    if (role < 0 || role >= kNumRoles) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".role is ", RoleName(r.role), "; out of range"));
    }
    if (!IsValid(r.modality)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".modality is ", ModalityName(r.modality), "; out of range"));
    }
    Rule rule;
    rule.temporal = r.temporal;
    rule.role = r.role;
    rule.modality = r.modality;
    TRIAX_ASSIGN_OR_RETURN(rule.encoding, ResolveEncoding(field, r.encoding));
    p->rules.push_back(rule);
  }
  if (!allocation && !p->rules.back().IsCatchAll()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.rules[", p->rules.size() - 1, "] (the last rule of policy ",
        Quote(info.name),
        ") must match every tag: temporal, role and modality unspecified"));
  }
  return std::shared_ptr<const Policy>(std::move(p));
}

std::string EncodingString(const Encoding& e) {
  char buf[96];
  return kernels::EncodingName(e, buf, sizeof(buf));
}

const std::vector<std::shared_ptr<const Policy>>& BuiltinPolicies() {
  static const auto* const kBuiltins =
      new std::vector<std::shared_ptr<const Policy>>(MakeBuiltins());
  return *kBuiltins;
}

std::shared_ptr<const Policy> FindBuiltinPolicy(absl::string_view name) {
  for (const auto& p : BuiltinPolicies()) {
    if (p->name == name) return p;
  }
  return nullptr;
}

}  // namespace triax::manager
