// KV events in vLLM's format (kv_events.h).
#include "kvmanager/kv_events.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <iterator>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/log.h"
#include "msgpack.hpp"
#include "zmq.hpp"
#include "zmq_addon.hpp"

namespace triax::manager {

namespace {

// Events read from the log per round: bounds one HashedBlocks call.
constexpr size_t kMaxEventsPerRound = 4096;
// How long the thread waits for a replay request before looking at the log
// again: the delay a lifecycle event may take to reach subscribers.
constexpr std::chrono::milliseconds kPollInterval{10};

std::string SeqBytes(int64_t seq) {
  std::string out(8, '\0');
  const auto u = static_cast<uint64_t>(seq);
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<char>((u >> (56 - 8 * i)) & 0xff);
  }
  return out;
}

using Packer = msgpack::packer<msgpack::sbuffer>;

void PackStr(Packer* pk, const std::string& s) {
  pk->pack_str(static_cast<uint32_t>(s.size()));
  pk->pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

void PackBin(Packer* pk, const std::string& s) {
  pk->pack_bin(static_cast<uint32_t>(s.size()));
  pk->pack_bin_body(s.data(), static_cast<uint32_t>(s.size()));
}

void PackHashes(Packer* pk, const std::vector<std::string>& hashes) {
  pk->pack_array(static_cast<uint32_t>(hashes.size()));
  for (const std::string& h : hashes) PackBin(pk, h);
}

// msgspec's tagged array_like struct: the tag (the class name) first, then
// every field in declaration order (none of these has a default, so
// omit_defaults drops nothing).
void PackEvent(Packer* pk, const KvCacheEvent& event) {
  if (const auto* s = std::get_if<KvBlockStored>(&event)) {
    pk->pack_array(7);
    PackStr(pk, "BlockStored");
    PackHashes(pk, s->block_hashes);
    if (s->parent_block_hash.has_value()) {
      PackBin(pk, *s->parent_block_hash);
    } else {
      pk->pack_nil();
    }
    pk->pack_array(static_cast<uint32_t>(s->token_ids.size()));
    for (uint32_t t : s->token_ids) pk->pack_uint32(t);
    pk->pack_uint32(s->block_size);
    pk->pack_nil();  // lora_id: no LoRA adapters here
    PackStr(pk, s->medium);
  } else if (const auto* r = std::get_if<KvBlockRemoved>(&event)) {
    pk->pack_array(3);
    PackStr(pk, "BlockRemoved");
    PackHashes(pk, r->block_hashes);
    PackStr(pk, r->medium);
  } else {
    pk->pack_array(1);
    PackStr(pk, "AllBlocksCleared");
  }
}

// One removal per medium in a round, in the order media first appear.
void AddRemoved(std::vector<KvBlockRemoved>* removed, const std::string& hash,
                Tier tier) {
  const std::string medium = KvMedium(tier);
  for (KvBlockRemoved& r : *removed) {
    if (r.medium == medium) {
      r.block_hashes.push_back(hash);
      return;
    }
  }
  removed->push_back(KvBlockRemoved{{hash}, medium});
}

// Appends `b` to the last BlockStored when it continues that event's chain
// on the same medium with the same size (and token ids known alike), else
// starts a new one.
void AddStored(std::vector<KvBlockStored>* stored,
               const ManagerCore::HashedBlock& b) {
  const std::string medium = KvMedium(b.tier);
  if (!stored->empty()) {
    KvBlockStored& last = stored->back();
    if (last.medium == medium && last.block_size == b.num_tokens &&
        last.block_hashes.back() == b.parent_hash &&
        last.token_ids.empty() == b.token_ids.empty()) {
      last.block_hashes.push_back(b.hash);
      last.token_ids.insert(last.token_ids.end(), b.token_ids.begin(),
                            b.token_ids.end());
      return;
    }
  }
  KvBlockStored s;
  s.block_hashes.push_back(b.hash);
  if (!b.parent_hash.empty()) s.parent_block_hash = b.parent_hash;
  s.token_ids = b.token_ids;
  s.block_size = b.num_tokens;
  s.medium = medium;
  stored->push_back(std::move(s));
}

}  // namespace

const char* KvMedium(Tier tier) {
  switch (tier) {
    case Tier::kHost:
      return "CPU";
    case Tier::kDisk:
      return "DISK";
    default:
      return "GPU";
  }
}

std::string EncodeKvEventBatch(double ts, const std::vector<KvCacheEvent>& ev,
                               int64_t data_parallel_rank) {
  msgpack::sbuffer buf;
  Packer pk(&buf);
  // EventBatch(array_like): ts, events, data_parallel_rank. The rank has a
  // default (None) but the publisher always sets it, so it is always sent.
  pk.pack_array(3);
  // Always float64, as msgspec writes a float: msgpack-c's pack_double
  // would write an integral value (ts 0.0) as an int.
  uint64_t bits = 0;
  static_assert(sizeof(bits) == sizeof(ts));
  std::memcpy(&bits, &ts, sizeof(bits));
  char f64[9] = {static_cast<char>(0xcb)};
  for (int i = 0; i < 8; ++i) {
    f64[1 + i] = static_cast<char>((bits >> (56 - 8 * i)) & 0xff);
  }
  buf.write(f64, sizeof(f64));
  pk.pack_array(static_cast<uint32_t>(ev.size()));
  for (const KvCacheEvent& e : ev) PackEvent(&pk, e);
  pk.pack_int64(data_parallel_rank);
  return std::string(buf.data(), buf.size());
}

absl::StatusOr<std::string> OffsetEndpointPort(const std::string& endpoint,
                                               int64_t data_parallel_rank,
                                               const std::string& flag) {
  if (endpoint.empty() || data_parallel_rank == 0) return endpoint;
  if (absl::StrContains(endpoint, "inproc")) {
    return absl::StrCat(endpoint, "_dp", data_parallel_rank);
  }
  if (absl::StrContains(endpoint, "tcp")) {
    const size_t colon = endpoint.rfind(':');
    int64_t port = 0;
    if (colon == std::string::npos ||
        !absl::SimpleAtoi(endpoint.substr(colon + 1), &port)) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, "=", endpoint,
                       ": a tcp endpoint needs a numeric port to offset by "
                       "--data_parallel_rank=",
                       data_parallel_rank));
    }
    return absl::StrCat(endpoint.substr(0, colon), ":",
                        port + data_parallel_rank);
  }
  return absl::InvalidArgumentError(
      absl::StrCat(flag, "=", endpoint,
                   ": with --data_parallel_rank the endpoint must be tcp:// "
                   "or inproc:// (vLLM's rule)"));
}

std::vector<KvCacheEvent> KvEventMirror::Update(
    const std::vector<ManagerCore::HashedBlock>& blocks,
    const std::vector<uint64_t>& named) {
  std::vector<KvBlockRemoved> removed;
  std::vector<KvBlockStored> stored;
  absl::flat_hash_set<uint64_t> present;
  present.reserve(blocks.size());
  for (const auto& b : blocks) present.insert(b.lineage_id);
  for (uint64_t lineage : named) {
    if (present.contains(lineage)) continue;
    auto it = announced_.find(lineage);
    if (it == announced_.end()) continue;
    AddRemoved(&removed, it->second.hash, it->second.tier);
    announced_.erase(it);
  }
  for (const auto& b : blocks) {
    const bool want = !b.hash.empty() && !b.evicted;
    auto it = announced_.find(b.lineage_id);
    if (it != announced_.end()) {
      if (want && it->second.hash == b.hash && it->second.tier == b.tier) {
        continue;
      }
      AddRemoved(&removed, it->second.hash, it->second.tier);
      announced_.erase(it);
    }
    if (!want) continue;
    AddStored(&stored, b);
    announced_[b.lineage_id] = Announced{b.hash, b.tier};
  }
  std::vector<KvCacheEvent> out;
  out.reserve(removed.size() + stored.size());
  for (auto& r : removed) out.emplace_back(std::move(r));
  for (auto& s : stored) out.emplace_back(std::move(s));
  return out;
}

std::vector<KvCacheEvent> KvEventMirror::Reset(
    const std::vector<ManagerCore::HashedBlock>& blocks) {
  announced_.clear();
  std::vector<KvCacheEvent> out;
  out.emplace_back(KvAllBlocksCleared{});
  for (KvCacheEvent& e : Update(blocks, {})) out.push_back(std::move(e));
  return out;
}

// --- KvEventPublisher -------------------------------------------------------

struct KvEventPublisher::Sockets {
  zmq::context_t context{1};
  zmq::socket_t pub{context, zmq::socket_type::pub};
  std::optional<zmq::socket_t> replay;
};

KvEventPublisher::KvEventPublisher(ManagerCore* core, KvEventsOptions options)
    : core_(core),
      options_(std::move(options)),
      sockets_(std::make_unique<Sockets>()) {}

absl::StatusOr<std::unique_ptr<KvEventPublisher>> KvEventPublisher::Start(
    ManagerCore* core, const KvEventsOptions& options) {
  if (options.buffer_steps == 0) {
    return absl::InvalidArgumentError(
        "--kv_events_buffer=0: replay needs at least one batch kept");
  }
  if (options.data_parallel_rank < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--data_parallel_rank=", options.data_parallel_rank, " must be >= 0"));
  }
  auto endpoint = OffsetEndpointPort(
      options.endpoint, options.data_parallel_rank, "--kv_events_endpoint");
  if (!endpoint.ok()) return endpoint.status();
  auto replay =
      OffsetEndpointPort(options.replay_endpoint, options.data_parallel_rank,
                         "--kv_events_replay_endpoint");
  if (!replay.ok()) return replay.status();
  std::unique_ptr<KvEventPublisher> p(new KvEventPublisher(core, options));
  Sockets& s = *p->sockets_;
  const std::string& ep = *endpoint;
  try {
    s.pub.set(zmq::sockopt::sndhwm, options.hwm);
    s.pub.set(zmq::sockopt::linger, 0);
    if (absl::StrContains(ep, "*") || absl::StrContains(ep, "::") ||
        absl::StartsWith(ep, "ipc://") || absl::StartsWith(ep, "inproc://")) {
      s.pub.bind(ep);
      p->bound_endpoint_ = s.pub.get(zmq::sockopt::last_endpoint);
    } else {
      s.pub.connect(ep);
      p->bound_endpoint_ = ep;
    }
  } catch (const zmq::error_t& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_events_endpoint=", ep, ": ZeroMQ refused it: ", e.what()));
  }
  if (!replay->empty()) {
    try {
      s.replay.emplace(s.context, zmq::socket_type::router);
      s.replay->set(zmq::sockopt::linger, 0);
      s.replay->bind(*replay);
      p->bound_replay_ = s.replay->get(zmq::sockopt::last_endpoint);
    } catch (const zmq::error_t& e) {
      return absl::InvalidArgumentError(
          absl::StrCat("--kv_events_replay_endpoint=", *replay,
                       ": ZeroMQ refused it: ", e.what()));
    }
  }
  // Subscribed before the first snapshot, so that nothing between the two
  // is missed (an event already reflected in the snapshot diffs to nothing).
  core->KeepBlockTokenIds(true);
  p->sub_ = core->events().Subscribe(EventFilter{}, 0);
  p->thread_ = std::thread([raw = p.get()] { raw->Run(); });
  return p;
}

KvEventPublisher::~KvEventPublisher() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
  if (sub_ != nullptr) sub_->Cancel();
}

void KvEventPublisher::Publish(const std::vector<KvCacheEvent>& events) {
  const double ts = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  std::string payload =
      EncodeKvEventBatch(ts, events, options_.data_parallel_rank);
  const uint64_t seq = next_seq_++;
  const std::string seq_bytes = SeqBytes(static_cast<int64_t>(seq));
  const std::array<zmq::const_buffer, 3> frames = {zmq::buffer(options_.topic),
                                                   zmq::buffer(seq_bytes),
                                                   zmq::buffer(payload)};
  try {
    // A PUB socket drops, never blocks, past its high-water mark.
    zmq::send_multipart(sockets_->pub, frames, zmq::send_flags::dontwait);
  } catch (const zmq::error_t& e) {
    Log(LogLevel::kWarn, "kv_events", "publish failed",
        absl::StrCat(Kv("seq", seq), " ", Kv("error", e.what())));
  }
  buffer_.emplace_back(seq, std::move(payload));
  while (buffer_.size() > options_.buffer_steps) buffer_.pop_front();
}

void KvEventPublisher::Resync() {
  Publish(mirror_.Reset(core_->HashedBlocks({}, {}, /*all=*/true)));
}

void KvEventPublisher::ServiceReplay() {
  std::vector<zmq::message_t> frames;
  try {
    if (!zmq::recv_multipart(*sockets_->replay, std::back_inserter(frames),
                             zmq::recv_flags::dontwait)) {
      return;
    }
  } catch (const zmq::error_t& e) {
    Log(LogLevel::kWarn, "kv_events", "replay receive failed",
        Kv("error", e.what()));
    return;
  }
  // ROUTER prepends the identity: [identity, "", start]. Anything else has
  // no one to answer in vLLM's protocol and is dropped, as vLLM does.
  if (frames.size() != 3) {
    Log(LogLevel::kWarn, "kv_events", "replay request ignored",
        absl::StrCat(Kv("frames", frames.size()), " ",
                     Kv("expected", "[identity, \"\", start (8 bytes)]")));
    return;
  }
  const std::string identity = frames[0].to_string();
  const std::string start_bytes = frames[2].to_string();
  auto send = [&](const std::string& seq, const std::string& payload) {
    const std::array<zmq::const_buffer, 4> reply = {
        zmq::buffer(identity), zmq::const_buffer(nullptr, 0), zmq::buffer(seq),
        zmq::buffer(payload)};
    // A ROUTER drops messages to a peer that left or fell behind.
    zmq::send_multipart(*sockets_->replay, reply, zmq::send_flags::dontwait);
  };
  try {
    if (start_bytes.size() != 8) {
      // vLLM reads any length as a number; a start that is not 8 bytes is
      // a client bug, answered with the end marker alone so it does not
      // wait forever.
      Log(LogLevel::kWarn, "kv_events", "replay start is not 8 bytes",
          Kv("start_bytes", start_bytes.size()));
    } else {
      uint64_t start = 0;
      for (char c : start_bytes) {
        start = (start << 8) | static_cast<unsigned char>(c);
      }
      for (const auto& [seq, payload] : buffer_) {
        if (seq >= start) send(SeqBytes(static_cast<int64_t>(seq)), payload);
      }
    }
    send(SeqBytes(-1), "");
  } catch (const zmq::error_t& e) {
    Log(LogLevel::kWarn, "kv_events", "replay send failed",
        Kv("error", e.what()));
  }
}

void KvEventPublisher::Run() {
  Resync();
  std::vector<zmq::pollitem_t> items;
  if (sockets_->replay.has_value()) {
    items.push_back({sockets_->replay->handle(), 0, ZMQ_POLLIN, 0});
  }
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
    }
    try {
      zmq::poll(items.data(), items.size(), kPollInterval);
    } catch (const zmq::error_t& e) {
      Log(LogLevel::kWarn, "kv_events", "poll failed", Kv("error", e.what()));
    }
    if (!items.empty() && (items[0].revents & ZMQ_POLLIN) != 0) {
      ServiceReplay();
    }
    std::vector<std::string> sequences;
    std::vector<uint64_t> lineages;
    absl::flat_hash_set<std::string> seen_sequences;
    bool ended = false;
    Event e;
    absl::Status end;
    for (size_t n = 0; n < kMaxEventsPerRound; ++n) {
      const auto r = sub_->Next(&e, &end);
      if (r == EventSubscription::Result::kEmpty) break;
      if (r == EventSubscription::Result::kEnded) {
        ended = true;
        break;
      }
      if (!e.sequence_id.empty() &&
          seen_sequences.insert(e.sequence_id).second) {
        sequences.push_back(e.sequence_id);
      }
      if (e.lineage_id != 0) lineages.push_back(e.lineage_id);
      lineages.insert(lineages.end(), e.lineage_ids.begin(),
                      e.lineage_ids.end());
    }
    if (ended) {
      // Fell behind the log: what was missed is unknown, so start over
      // from the core's state, as a restart would.
      Log(LogLevel::kWarn, "kv_events", "resynchronizing",
          Kv("reason", end.ToString()));
      sub_->Cancel();
      sub_ = core_->events().Subscribe(EventFilter{}, 0);
      Resync();
      continue;
    }
    if (sequences.empty() && lineages.empty()) continue;
    std::vector<KvCacheEvent> events = mirror_.Update(
        core_->HashedBlocks(sequences, lineages, false), lineages);
    if (!events.empty()) Publish(events);
  }
}

}  // namespace triax::manager
