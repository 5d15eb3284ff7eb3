// KV cache events in vLLM's wire format over ZeroMQ (docs/kv_events.md), so
// that routers and indexers that consume vLLM's stream (Dynamo's KV router,
// llm-d's indexer) consume the manager's.
//
// The format is vLLM 0.11.2's vllm/distributed/kv_events.py: a PUB socket
// sends each batch as the three frames
//
//   [topic (UTF-8), seq (8 bytes, big-endian, from 0), payload (msgpack)]
//
// where the payload is msgspec's array_like encoding of KVEventBatch:
//
//   [ts (float64, Unix seconds), [event...], data_parallel_rank (int)]
//   BlockStored      ["BlockStored", [hash (bin 32)...], parent (bin 32 | nil),
//                     [token id (int)...], block_size (int), lora_id (nil),
//                     medium (str)]
//   BlockRemoved     ["BlockRemoved", [hash (bin 32)...], medium (str)]
//   AllBlocksCleared ["AllBlocksCleared"]
//
// and a ROUTER socket answers a request [identity, "", start (8 bytes,
// big-endian)] with [identity, "", seq, payload] for every buffered batch
// with seq >= start, then the end marker [identity, "", -1 (8 bytes), ""].
//
// What the events say (the mapping from the manager's block lifecycle):
// a block is "stored" on a medium while it carries a content hash
// (prefix_index.h: sealed, with token ids) and its pages are resident on
// that tier: "GPU" (the device pool), "CPU" (host spill tier), "DISK". A
// block that gets a hash is BlockStored; one that moves tier is
// BlockRemoved from the old medium and BlockStored on the new; one that is
// freed, lost, evicted, cut or unsealed is BlockRemoved. The stream covers
// the whole cluster, so a worker going DOWN removes exactly its blocks;
// AllBlocksCleared opens the stream (and any resynchronization), followed
// by BlockStored for every block held then.
//
// How: KvEventPublisher subscribes to the manager's EventLog and, for the
// sequences and blocks each batch of lifecycle events names, reads their
// state now (ManagerCore::HashedBlocks) and diffs it against what it has
// announced (KvEventMirror). State is read, not replayed from the events,
// so the stream converges to the core's state whatever the interleaving.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvmanager/manager_core.h"

namespace triax::manager {

// --- The wire types (vLLM's msgspec structs, fields in order) --------------
struct KvBlockStored {
  std::vector<std::string> block_hashes;         // 32 bytes each
  std::optional<std::string> parent_block_hash;  // nullopt: first block
  std::vector<uint32_t> token_ids;
  uint32_t block_size = 0;
  std::string medium;
};
struct KvBlockRemoved {
  std::vector<std::string> block_hashes;
  std::string medium;
};
struct KvAllBlocksCleared {};
using KvCacheEvent =
    std::variant<KvBlockStored, KvBlockRemoved, KvAllBlocksCleared>;

// "GPU", "CPU" or "DISK".
const char* KvMedium(Tier tier);
// The msgpack payload of one KVEventBatch (see the file comment).
std::string EncodeKvEventBatch(double ts, const std::vector<KvCacheEvent>& ev,
                               int64_t data_parallel_rank);
// vLLM's offset_endpoint_port: rank 0 or no endpoint: unchanged; "inproc"
// endpoints get "_dp<rank>"; tcp endpoints get their port + rank.
// INVALID_ARGUMENT naming `flag` and the value when the port does not parse.
absl::StatusOr<std::string> OffsetEndpointPort(const std::string& endpoint,
                                               int64_t data_parallel_rank,
                                               const std::string& flag);

// --- What has been announced ----------------------------------------------
// Not thread-safe (the publisher's thread owns it).
class KvEventMirror {
 public:
  // Diffs `blocks` (as the core holds them now) and `named` (lineage ids the
  // lifecycle events named: those absent from `blocks` are gone) against
  // what was announced; returns the events that make them agree, removals
  // first. Consecutive blocks of one chain on one medium with equal sizes
  // share one BlockStored, as vLLM's do.
  std::vector<KvCacheEvent> Update(
      const std::vector<ManagerCore::HashedBlock>& blocks,
      const std::vector<uint64_t>& named);
  // Forgets everything: AllBlocksCleared, then BlockStored for every block
  // of `blocks` (hashed, resident).
  std::vector<KvCacheEvent> Reset(
      const std::vector<ManagerCore::HashedBlock>& blocks);
  size_t size() const { return announced_.size(); }

 private:
  struct Announced {
    std::string hash;
    Tier tier = Tier::kDevice;
  };
  absl::flat_hash_map<uint64_t, Announced> announced_;
};

// --- The publisher ---------------------------------------------------------
struct KvEventsOptions {
  std::string endpoint;         // PUB: bound when it has '*', "::", ipc://
                                // or inproc://, else connected (vLLM's rule)
  std::string replay_endpoint;  // ROUTER, bound; empty: no replay
  std::string topic;
  size_t buffer_steps = 10'000;  // batches kept for replay
  int hwm = 100'000;             // PUB high-water mark
  int64_t data_parallel_rank = 0;
};

// Thread contract: Start and the destructor from one thread; the work runs
// on the publisher's own thread (it owns the sockets, which ZeroMQ does not
// let threads share). `core` must outlive the publisher.
class KvEventPublisher {
 public:
  // Binds/connects the sockets (INVALID_ARGUMENT naming the flag and the
  // endpoint when ZeroMQ refuses it) and starts publishing.
  static absl::StatusOr<std::unique_ptr<KvEventPublisher>> Start(
      ManagerCore* core, const KvEventsOptions& options);
  ~KvEventPublisher();
  KvEventPublisher(const KvEventPublisher&) = delete;
  KvEventPublisher& operator=(const KvEventPublisher&) = delete;

  // The endpoints as bound (port 0 resolved to the port taken).
  const std::string& endpoint() const { return bound_endpoint_; }
  const std::string& replay_endpoint() const { return bound_replay_; }

 private:
  struct Sockets;
  KvEventPublisher(ManagerCore* core, KvEventsOptions options);
  void Run();
  void Resync();
  void Publish(const std::vector<KvCacheEvent>& events);
  void ServiceReplay();

  ManagerCore* const core_;
  const KvEventsOptions options_;
  std::unique_ptr<Sockets> sockets_;
  std::string bound_endpoint_;
  std::string bound_replay_;
  std::shared_ptr<EventSubscription> sub_;
  KvEventMirror mirror_;
  uint64_t next_seq_ = 0;
  std::deque<std::pair<uint64_t, std::string>> buffer_;  // (seq, payload)
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace triax::manager
