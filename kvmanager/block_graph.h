// The block graph of the memory-pressure ranking: which blocks are used
// together, so that the ranker (block_ranker.h) keeps a block's company
// with it. No gRPC, no I/O, no locks.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace triax::manager {

struct BlockView;  // block_ranker.h

// Edges of the block graph.
enum class EdgeKind : int {
  kCoAttention = 0,     // attended together (ReportAccess), weighted
  kToolCallResult = 1,  // a tool call block -> the tool result that answers it
  kSpill = 2,           // spilled in the same batch: restored together
};

// The block graph: nodes are blocks (lineage ids), with hits and a decayed
// attention mass; explicit edges are co-attention, tool call -> tool result
// and spill links. Temporal adjacency (block i <-> i+1 of a sequence) and
// prefix sharing (refcount) are implicit: the manager's snapshot adds half
// the importance of a block's more important neighbour (index +-1) to its
// own (pressure_snapshot.cc AddTemporalAdjacency), and shared blocks
// (refcount > 1) are never candidates. Memory: O(blocks + edges), each block
// keeps at most max_degree edges (the weakest co-attention edge goes first).
//
// Edges: at most one per pair of blocks, undirected, with a weight (sum of
// the Link / co-attention increments) and a kind (a structural kind,
// kToolCallResult or kSpill, replaces kCoAttention when linked again; the
// first structural kind stays). Degree cap: when a block already has
// max_degree neighbours, the new edge replaces the block's weakest edge if
// it is stronger, else it is not added (at either end). Strength orders
// structural edges above co-attention ones, then by weight; among equal
// strengths the larger neighbour id goes first.
//
// Importance (>= 0) of a block at now_ms:
//   log1p(hits) + mass * 2^(-(now_ms - last_access_ms) / mass_half_life_ms)
//   + 0.5 * log1p(sum of its edge weights)
// (idle time clamped at 0).
//
// Thread contract: not thread-safe; the manager core's PressureCoordinator
// calls it with ManagerCore::mu_ held. Every call is O(degree^2) or O(n log n +
// n * max_degree * degree) for n lineage_ids in the call.
class BlockGraph {
 public:
  struct Options {
    uint32_t max_degree = 16;
    double mass_half_life_ms = 60'000;  // decay of attention mass
  };
  BlockGraph() : BlockGraph(Options{}) {}
  explicit BlockGraph(const Options& options);

  void AddBlock(uint64_t lineage_id, int64_t now_ms);
  // Removes the node and every edge touching it. No-op when unknown.
  void RemoveBlock(uint64_t lineage_id);
  // Adds (or strengthens by `weight`) an undirected edge; no-op when either
  // end is unknown, a == b, or weight is not a finite positive number.
  void Link(uint64_t a, uint64_t b, EdgeKind kind, double weight = 1.0);
  // A hit on every listed block (unknown ids are skipped; a repeated id
  // counts once, with its weights summed), attention mass (first decayed
  // to now_ms) += weights[i] (equal shares 1/n when weights is empty or of
  // another length; negative or non-finite weights count as 0), and
  // co-attention edges between the listed blocks: with the known blocks
  // sorted by weight descending (ties: id ascending) and share = weight /
  // largest weight, each block is linked to the first min(max_degree, n)
  // blocks before it in that order, the edge strengthened by
  // share_a * share_b (pairs with a zero share are not linked).
  // last_access_ms becomes max(last_access_ms, now_ms).
  void RecordAccess(const std::vector<uint64_t>& lineage_ids,
                    const std::vector<float>& weights, int64_t now_ms);

  struct Node {
    uint32_t hits = 0;
    double mass = 0;             // decayed to last_access_ms
    int64_t last_access_ms = 0;  // creation time until the first access
  };
  // nullptr when unknown.
  const Node* Find(uint64_t lineage_id) const;
  // Neighbours of a block (any kind), strongest first.
  std::vector<uint64_t> Neighbours(uint64_t lineage_id) const;
  // Importance >= 0 at `now_ms` (formula above); 0 when unknown.
  double Importance(uint64_t lineage_id, int64_t now_ms) const;
  // The same from a node and its weighted degree (one map probe for
  // callers that snapshot many blocks: see Snapshot).
  double Importance(const Node& node, double weighted_degree,
                    int64_t now_ms) const;
  // Fills a BlockView's importance, hits and last_access_ms from the
  // graph; returns false (and leaves `view` untouched) when unknown.
  bool Snapshot(uint64_t lineage_id, int64_t now_ms, BlockView* view) const;
  // Sum of the weights of a block's edges; 0 when unknown.
  double WeightedDegree(uint64_t lineage_id) const;
  size_t size() const;
  size_t edges() const;

 private:
  struct Edge {
    uint64_t to;
    EdgeKind kind;
    float weight;
  };
  struct Entry {
    Node node;
    std::vector<Edge> edges;
    double weighted_degree = 0;  // sum of edges[i].weight
  };
  // Whether a new edge of (kind, weight) fits at `e`, and which edge (index
  // into e.edges, or -1 when there is room) it replaces.
  bool Admits(const Entry& e, EdgeKind kind, double weight, int* victim) const;
  void EraseEdge(uint64_t from, uint64_t to);
  Options options_;
  absl::flat_hash_map<uint64_t, Entry> nodes_;
  size_t edge_count_ = 0;
};

}  // namespace triax::manager
