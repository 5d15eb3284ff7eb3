#include "client/calibrate/allocation_check.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/calibrate/calibration_proto.h"
#include "common/model_proto.h"
#include "common/status_macros.h"

namespace triax::calibrate {
namespace {

std::string EncName(const kernels::Encoding& e) {
  char buf[96];
  return kernels::EncodingName(e, buf, sizeof(buf));
}

bool IsBf16(const kernels::Encoding& e) {
  return e.k == kernels::Format::kBF16 && e.v == kernels::Format::kBF16;
}

std::vector<double> Ranks(const std::vector<double>& x) {
  std::vector<size_t> order(x.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&x](size_t a, size_t b) { return x[a] < x[b]; });
  std::vector<double> r(x.size());
  for (size_t i = 0; i < order.size();) {
    size_t j = i;
    while (j + 1 < order.size() && x[order[j + 1]] == x[order[i]]) ++j;
    const double mean = (static_cast<double>(i) + j) / 2.0 + 1.0;
    for (size_t k = i; k <= j; ++k) r[order[k]] = mean;
    i = j + 1;
  }
  return r;
}

std::string Num(double v) { return absl::StrFormat("%.4g", v); }

}  // namespace

void EffectSums::Add(const EffectSums& o) {
  kl += o.kl;
  kl_answer += o.kl_answer;
  dnll += o.dnll;
  dnll_answer += o.dnll_answer;
  positions += o.positions;
  answer_positions += o.answer_positions;
}

double EffectSums::Mean(double sum, bool answer) const {
  const int64_t n = answer ? answer_positions : positions;
  return n > 0 ? sum / static_cast<double>(n) : 0.0;
}

absl::StatusOr<TablePredictor> TablePredictor::Create(
    const v1::CalibrationTable& table, const std::string& name,
    int block_tokens) {
  if (absl::Status s = ValidateTable(table); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("table ", name, ": ", s.message()));
  }
  if (static_cast<int>(table.block_tokens()) != block_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("table ", name, ": block_tokens ", table.block_tokens(),
                     "; the check plans blocks of ", block_tokens));
  }
  TablePredictor p;
  p.name_ = name;
  p.output_metric_ = absl::StartsWith(table.source().metric(), "output-kl");
  for (const v1::CalibrationEntry& e : table.entries()) {
    Values v;
    v.kl = e.distortion();
    v.kl_answer = p.output_metric_ ? e.distortion_answer() : e.distortion();
    v.dnll = e.dnll();
    v.dnll_answer = e.dnll_answer();
    p.values_[{FromProto(e.tag()), EncName(EntryEncoding(e))}] = v;
  }
  return p;
}

EffectSums TablePredictor::Predict(const OutputConversation& conv,
                                   const Allocation& alloc,
                                   int64_t* missing) const {
  const size_t T = conv.tags.size();
  std::vector<Values> per_tag(T);
  for (size_t t = 0; t < T; ++t) {
    auto a = alloc.find(conv.tags[t]);
    if (a == alloc.end() || IsBf16(a->second)) continue;
    auto it = values_.find({conv.tags[t], EncName(a->second)});
    if (it == values_.end()) {
      if (missing != nullptr) ++*missing;
      continue;
    }
    per_tag[t] = it->second;
  }
  EffectSums s;
  for (int64_t p = 0; p < conv.positions(); ++p) {
    const double* share = &conv.share[static_cast<size_t>(p) * T];
    double kl = 0, kla = 0, dn = 0, dna = 0;
    for (size_t t = 0; t < T; ++t) {
      kl += share[t] * per_tag[t].kl;
      dn += share[t] * per_tag[t].dnll;
      kla += share[t] * per_tag[t].kl_answer;
      dna += share[t] * per_tag[t].dnll_answer;
    }
    s.kl += kl;
    s.dnll += dn;
    ++s.positions;
    if (conv.answer[p]) {
      s.kl_answer += kla;
      s.dnll_answer += dna;
      ++s.answer_positions;
    }
  }
  return s;
}

std::vector<NamedAllocation> CheckAllocations(
    const std::vector<Tag>& tags,
    const std::vector<kernels::Encoding>& encodings, int random,
    uint64_t seed) {
  std::vector<NamedAllocation> out;
  for (const kernels::Encoding& e : encodings) {
    NamedAllocation a;
    a.name = absl::StrCat("uniform ", EncName(e));
    for (const Tag& t : tags) a.alloc[t] = e;
    out.push_back(std::move(a));
  }
  std::mt19937_64 rng(seed);
  for (int i = 0; i < random && !encodings.empty(); ++i) {
    NamedAllocation a;
    a.name = absl::StrCat("random ", i, " (seed ", seed, ")");
    for (const Tag& t : tags) {
      a.alloc[t] = encodings[rng() % encodings.size()];
    }
    out.push_back(std::move(a));
  }
  return out;
}

absl::StatusOr<std::vector<EffectSums>> MeasureAllocations(
    const frontend::Model& model, const std::vector<OutputConversation>& convs,
    const std::vector<NamedAllocation>& allocs, int threads,
    const std::function<void(const std::string&)>& progress) {
  if (threads < 1 || threads > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("threads ", threads, " is outside 1..64"));
  }
  const int vocab = model.config.vocab_size;
  struct Ref {
    std::unique_ptr<FakeQuantKvStore> store;
    std::vector<float> logits;
  };
  std::vector<Ref> refs(convs.size());
  std::vector<std::pair<size_t, size_t>> jobs;  // (alloc, conv)
  for (size_t a = 0; a < allocs.size(); ++a) {
    for (size_t c = 0; c < convs.size(); ++c) jobs.emplace_back(a, c);
  }
  std::vector<EffectSums> sums(jobs.size());
  std::mutex mu;
  absl::Status failure;
  auto fail = [&](const absl::Status& s, const std::string& where) {
    std::lock_guard<std::mutex> l(mu);
    if (failure.ok()) {
      failure = absl::Status(s.code(), absl::StrCat(where, ": ", s.message()));
    }
  };
  const auto run_threads =
      [threads](size_t n, const std::function<void(std::atomic<size_t>*)>& f) {
        std::atomic<size_t> next{0};
        const int T = std::max(1, std::min<int>(threads, static_cast<int>(n)));
        std::vector<std::thread> pool;
        for (int t = 1; t < T; ++t) pool.emplace_back(f, &next);
        f(&next);
        for (std::thread& t : pool) t.join();
      };
  run_threads(convs.size(), [&](std::atomic<size_t>* next) {
    frontend::Transformer tf(&model, 1);
    for (size_t c = (*next)++; c < convs.size(); c = (*next)++) {
      absl::StatusOr<PassResult> r =
          RunPass(&tf, convs[c], {}, nullptr, nullptr, &refs[c].store);
      if (!r.ok()) return fail(r.status(), convs[c].id);
      refs[c].logits = std::move(r->logits);
      if (progress) {
        progress(absl::StrFormat("%s: reference pass, %zu tokens, %.1f s",
                                 convs[c].id, convs[c].tokens.size(),
                                 r->seconds));
      }
    }
  });
  if (!failure.ok()) return failure;
  std::atomic<int> done{0};
  run_threads(jobs.size(), [&](std::atomic<size_t>* next) {
    frontend::Transformer tf(&model, 1);
    std::unique_ptr<FakeQuantKvStore> store;
    for (size_t j = (*next)++; j < jobs.size(); j = (*next)++) {
      const auto [a, c] = jobs[j];
      absl::StatusOr<PassResult> r =
          RunPass(&tf, convs[c], allocs[a].alloc, refs[c].store.get(),
                  &refs[c].logits, &store);
      if (!r.ok()) return fail(r.status(), convs[c].id);
      const PositionEffects fx =
          CompareLogits(convs[c], vocab, refs[c].logits, r->logits);
      EffectSums& s = sums[j];
      for (int64_t p = 0; p < convs[c].positions(); ++p) {
        s.kl += fx.kl[p];
        s.dnll += fx.dnll[p];
        ++s.positions;
        if (convs[c].answer[p]) {
          s.kl_answer += fx.kl[p];
          s.dnll_answer += fx.dnll[p];
          ++s.answer_positions;
        }
      }
      if (progress) {
        progress(absl::StrFormat("[%d/%zu] %s on %s: %.1f s (from token %lld)",
                                 ++done, jobs.size(), allocs[a].name,
                                 convs[c].id, r->seconds,
                                 static_cast<long long>(r->first_computed)));
      }
    }
  });
  if (!failure.ok()) return failure;
  std::vector<EffectSums> out(allocs.size());
  for (size_t j = 0; j < jobs.size(); ++j) out[jobs[j].first].Add(sums[j]);
  return out;
}

double Spearman(const std::vector<double>& x, const std::vector<double>& y) {
  if (x.size() != y.size() || x.size() < 2) return 0.0;
  const std::vector<double> rx = Ranks(x), ry = Ranks(y);
  const double n = static_cast<double>(x.size());
  double mx = 0, my = 0;
  for (size_t i = 0; i < rx.size(); ++i) {
    mx += rx[i];
    my += ry[i];
  }
  mx /= n;
  my /= n;
  double sxy = 0, sxx = 0, syy = 0;
  for (size_t i = 0; i < rx.size(); ++i) {
    sxy += (rx[i] - mx) * (ry[i] - my);
    sxx += (rx[i] - mx) * (rx[i] - mx);
    syy += (ry[i] - my) * (ry[i] - my);
  }
  if (sxx <= 0 || syy <= 0) return 0.0;
  return sxy / std::sqrt(sxx * syy);
}

std::string PredictionReport(
    const std::vector<NamedAllocation>& allocs,
    const std::vector<EffectSums>& measured,
    const std::vector<TablePredictor>& tables,
    const std::vector<std::vector<EffectSums>>& predicted) {
  std::string out = "| allocation | KL | KL answer | dNLL | dNLL answer |";
  for (const TablePredictor& t : tables) {
    absl::StrAppend(&out, " ", t.name(), " predicted |");
    if (t.output_metric()) {
      absl::StrAppend(&out, " ", t.name(), " predicted dNLL |");
    }
  }
  absl::StrAppend(&out, "\n|---|---:|---:|---:|---:|");
  for (const TablePredictor& t : tables) {
    absl::StrAppend(&out, t.output_metric() ? "---:|---:|" : "---:|");
  }
  absl::StrAppend(&out, "\n");
  for (size_t a = 0; a < allocs.size(); ++a) {
    const EffectSums& m = measured[a];
    absl::StrAppend(&out, "| ", allocs[a].name, " | ", Num(m.Mean(m.kl, false)),
                    " | ", Num(m.Mean(m.kl_answer, true)), " | ",
                    Num(m.Mean(m.dnll, false)), " | ",
                    Num(m.Mean(m.dnll_answer, true)), " |");
    for (size_t t = 0; t < tables.size(); ++t) {
      const EffectSums& p = predicted[t][a];
      absl::StrAppend(&out, " ", Num(p.Mean(p.kl, false)), " |");
      if (tables[t].output_metric()) {
        absl::StrAppend(&out, " ", Num(p.Mean(p.dnll, false)), " |");
      }
    }
    absl::StrAppend(&out, "\n");
  }
  absl::StrAppend(
      &out,
      "\n| table | ρ(pred, KL) | ρ(pred, dNLL) | ρ(pred answer, KL answer) | "
      "ρ(pred answer, dNLL answer) | MAE | mean rel. error | "
      "ρ(pred dNLL, dNLL) | dNLL MAE |\n|---|---:|---:|---:|---:|---:|---:|"
      "---:|---:|\n");
  auto column = [&](auto get) {
    std::vector<double> v;
    for (size_t a = 0; a < allocs.size(); ++a) v.push_back(get(a));
    return v;
  };
  const std::vector<double> kl =
      column([&](size_t a) { return measured[a].Mean(measured[a].kl, false); });
  const std::vector<double> kla = column(
      [&](size_t a) { return measured[a].Mean(measured[a].kl_answer, true); });
  const std::vector<double> dn = column(
      [&](size_t a) { return measured[a].Mean(measured[a].dnll, false); });
  const std::vector<double> dna = column([&](size_t a) {
    return measured[a].Mean(measured[a].dnll_answer, true);
  });
  for (size_t t = 0; t < tables.size(); ++t) {
    const auto& pr = predicted[t];
    const std::vector<double> p =
        column([&](size_t a) { return pr[a].Mean(pr[a].kl, false); });
    const std::vector<double> pa =
        column([&](size_t a) { return pr[a].Mean(pr[a].kl_answer, true); });
    const std::vector<double> pd =
        column([&](size_t a) { return pr[a].Mean(pr[a].dnll, false); });
    double mae = 0, rel = 0, dmae = 0;
    int rel_n = 0;
    for (size_t a = 0; a < allocs.size(); ++a) {
      mae += std::abs(p[a] - kl[a]);
      dmae += std::abs(pd[a] - dn[a]);
      if (kl[a] > 0) {
        rel += std::abs(p[a] - kl[a]) / kl[a];
        ++rel_n;
      }
    }
    const double n = static_cast<double>(std::max<size_t>(1, allocs.size()));
    const bool out_metric = tables[t].output_metric();
    absl::StrAppend(&out, "| ", tables[t].name(), " | ", Num(Spearman(p, kl)),
                    " | ", Num(Spearman(p, dn)), " | ", Num(Spearman(pa, kla)),
                    " | ", Num(Spearman(pa, dna)), " | ",
                    out_metric ? Num(mae / n) : "n/a (attention units)", " | ",
                    out_metric ? Num(rel_n ? rel / rel_n : 0.0) : "n/a", " | ",
                    out_metric ? Num(Spearman(pd, dn)) : "n/a", " | ",
                    out_metric ? Num(dmae / n) : "n/a", " |\n");
  }
  return out;
}

}  // namespace triax::calibrate
