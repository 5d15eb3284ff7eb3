#include "kvmanager/block_graph.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "kvmanager/block_ranker.h"

namespace triax::manager {

namespace {

bool IsStructural(EdgeKind k) { return k != EdgeKind::kCoAttention; }

// Whether edge (sa, wa, ida) goes before (sb, wb, idb) when one must go.
bool Weaker(bool sa, double wa, uint64_t ida, bool sb, double wb,
            uint64_t idb) {
  if (sa != sb) return !sa;
  if (wa != wb) return wa < wb;
  return ida > idb;
}

double Decay(double value, int64_t since_ms, int64_t now_ms,
             double half_life_ms) {
  if (!(half_life_ms > 0) || now_ms <= since_ms) return value;
  return value *
         std::exp2(-static_cast<double>(now_ms - since_ms) / half_life_ms);
}

}  // namespace

BlockGraph::BlockGraph(const Options& options) : options_(options) {}

void BlockGraph::AddBlock(uint64_t lineage_id, int64_t now_ms) {
  auto [it, inserted] = nodes_.try_emplace(lineage_id);
  if (inserted) it->second.node.last_access_ms = now_ms;
}

void BlockGraph::RemoveBlock(uint64_t lineage_id) {
  auto it = nodes_.find(lineage_id);
  if (it == nodes_.end()) return;
  for (const Edge& e : it->second.edges) EraseEdge(e.to, lineage_id);
  edge_count_ -= it->second.edges.size();
  nodes_.erase(it);
}

void BlockGraph::EraseEdge(uint64_t from, uint64_t to) {
  auto it = nodes_.find(from);
  if (it == nodes_.end()) return;
  Entry& e = it->second;
  for (size_t i = 0; i < e.edges.size(); ++i) {
    if (e.edges[i].to != to) continue;
    e.edges[i] = e.edges.back();
    e.edges.pop_back();
    break;
  }
  double sum = 0;
  for (const Edge& x : e.edges) sum += x.weight;
  e.weighted_degree = sum;
}

bool BlockGraph::Admits(const Entry& e, EdgeKind kind, double weight,
                        int* victim) const {
  *victim = -1;
  if (e.edges.size() < options_.max_degree) return true;
  if (e.edges.empty()) return false;  // max_degree == 0
  size_t v = 0;
  for (size_t i = 1; i < e.edges.size(); ++i) {
    const Edge& a = e.edges[i];
    const Edge& b = e.edges[v];
    if (Weaker(IsStructural(a.kind), a.weight, a.to, IsStructural(b.kind),
               b.weight, b.to)) {
      v = i;
    }
  }
  const Edge& ve = e.edges[v];
  const bool s = IsStructural(kind);
  const bool vs = IsStructural(ve.kind);
  const bool stronger = s != vs ? s : static_cast<float>(weight) > ve.weight;
  if (!stronger) return false;
  *victim = static_cast<int>(v);
  return true;
}

void BlockGraph::Link(uint64_t a, uint64_t b, EdgeKind kind, double weight) {
  if (a == b || !(weight > 0) || !std::isfinite(weight)) return;
  auto ia = nodes_.find(a);
  auto ib = nodes_.find(b);
  if (ia == nodes_.end() || ib == nodes_.end()) return;
  Entry& ea = ia->second;
  Entry& eb = ib->second;
  auto strengthen = [&](Entry& e, uint64_t to) {
    double sum = 0;
    for (Edge& x : e.edges) {
      if (x.to == to) {
        x.weight += static_cast<float>(weight);
        if (x.kind == EdgeKind::kCoAttention) x.kind = kind;
      }
      sum += x.weight;
    }
    e.weighted_degree = sum;
  };
  for (const Edge& x : ea.edges) {
    if (x.to == b) {
      strengthen(ea, b);
      strengthen(eb, a);
      return;
    }
  }
  int va = -1;
  int vb = -1;
  if (!Admits(ea, kind, weight, &va) || !Admits(eb, kind, weight, &vb)) {
    return;
  }
  // No edge a-b exists, so dropping a's victim leaves b's list unchanged
  // (and vice versa): both indices stay valid.
  const uint64_t victim_b = vb >= 0 ? eb.edges[vb].to : 0;
  if (va >= 0) {
    const uint64_t t = ea.edges[va].to;
    EraseEdge(a, t);
    EraseEdge(t, a);
    --edge_count_;
  }
  if (vb >= 0) {
    EraseEdge(b, victim_b);
    EraseEdge(victim_b, b);
    --edge_count_;
  }
  ea.edges.push_back(Edge{b, kind, static_cast<float>(weight)});
  eb.edges.push_back(Edge{a, kind, static_cast<float>(weight)});
  ea.weighted_degree += ea.edges.back().weight;
  eb.weighted_degree += eb.edges.back().weight;
  ++edge_count_;
}

void BlockGraph::RecordAccess(const std::vector<uint64_t>& lineage_ids,
                              const std::vector<float>& weights,
                              int64_t now_ms) {
  const size_t n = lineage_ids.size();
  if (n == 0) return;
  const bool given = weights.size() == n;
  std::vector<std::pair<uint64_t, double>> items;
  items.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (!nodes_.contains(lineage_ids[i])) continue;
    double w = given ? static_cast<double>(weights[i]) : 1.0 / n;
    if (!(w >= 0) || !std::isfinite(w)) w = 0;
    items.emplace_back(lineage_ids[i], w);
  }
  if (items.empty()) return;
  std::sort(items.begin(), items.end());
  size_t m = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    if (m > 0 && items[m - 1].first == items[i].first) {
      items[m - 1].second += items[i].second;
    } else {
      items[m++] = items[i];
    }
  }
  items.resize(m);
  for (const auto& [id, w] : items) {
    Node& node = nodes_.find(id)->second.node;
    node.mass = Decay(node.mass, node.last_access_ms, now_ms,
                      options_.mass_half_life_ms) +
                w;
    if (node.hits < std::numeric_limits<uint32_t>::max()) ++node.hits;
    node.last_access_ms = std::max(node.last_access_ms, now_ms);
  }
  std::sort(items.begin(), items.end(), [](const auto& x, const auto& y) {
    if (x.second != y.second) return x.second > y.second;
    return x.first < y.first;
  });
  const double wmax = items[0].second;
  if (!(wmax > 0)) return;
  const size_t k = std::min<size_t>(options_.max_degree, m);
  for (size_t p = 1; p < m; ++p) {
    const double sp = items[p].second / wmax;
    if (!(sp > 0)) break;  // sorted: the rest are zero too
    for (size_t q = 0; q < std::min(p, k); ++q) {
      Link(items[p].first, items[q].first, EdgeKind::kCoAttention,
           sp * (items[q].second / wmax));
    }
  }
}

const BlockGraph::Node* BlockGraph::Find(uint64_t lineage_id) const {
  auto it = nodes_.find(lineage_id);
  return it == nodes_.end() ? nullptr : &it->second.node;
}

std::vector<uint64_t> BlockGraph::Neighbours(uint64_t lineage_id) const {
  auto it = nodes_.find(lineage_id);
  if (it == nodes_.end()) return {};
  std::vector<Edge> edges = it->second.edges;
  std::sort(edges.begin(), edges.end(), [](const Edge& a, const Edge& b) {
    if (a.weight != b.weight) return a.weight > b.weight;
    return a.to < b.to;
  });
  std::vector<uint64_t> out;
  out.reserve(edges.size());
  for (const Edge& e : edges) out.push_back(e.to);
  return out;
}

double BlockGraph::Importance(const Node& node, double weighted_degree,
                              int64_t now_ms) const {
  return std::log1p(static_cast<double>(node.hits)) +
         Decay(node.mass, node.last_access_ms, now_ms,
               options_.mass_half_life_ms) +
         0.5 * std::log1p(std::max(0.0, weighted_degree));
}

double BlockGraph::Importance(uint64_t lineage_id, int64_t now_ms) const {
  auto it = nodes_.find(lineage_id);
  if (it == nodes_.end()) return 0;
  return Importance(it->second.node, it->second.weighted_degree, now_ms);
}

bool BlockGraph::Snapshot(uint64_t lineage_id, int64_t now_ms,
                          BlockView* view) const {
  auto it = nodes_.find(lineage_id);
  if (it == nodes_.end()) return false;
  const Node& node = it->second.node;
  view->importance = Importance(node, it->second.weighted_degree, now_ms);
  view->hits = node.hits;
  view->last_access_ms = node.last_access_ms;
  return true;
}

double BlockGraph::WeightedDegree(uint64_t lineage_id) const {
  auto it = nodes_.find(lineage_id);
  return it == nodes_.end() ? 0 : it->second.weighted_degree;
}

size_t BlockGraph::size() const { return nodes_.size(); }
size_t BlockGraph::edges() const { return edge_count_; }

}  // namespace triax::manager
