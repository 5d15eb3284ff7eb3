"""KV events in vLLM's format (docs/kv_events.md) from a live cluster: a real
kvmanager publishing on ZeroMQ, two CPU kvworkers, traffic driven through
the Python client, and subscribers that decode every batch as vLLM's
msgspec decoder would (arrays in field order, tagged unions), check the
bytes are the canonical msgpack msgspec writes, check the hash chains
against the client's prefix_block_hashes, and fill gaps through the replay
socket. Run by ctest (kv_events_live_test); exits 77 (skipped) only when
python3-zmq, python3-msgpack or grpcio is missing."""

import os
import re
import struct
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))

try:
    import grpc  # noqa: F401
    import msgpack
    import zmq
except ImportError as e:
    print(f"kv_events_live_test: {e} (Debian: python3-zmq python3-msgpack "
          "python3-grpcio; scripts/install_deps.sh installs them); skipped")
    sys.exit(77)

import pytest  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "client", "python", "tests"))
from conftest import MODEL, Process, triaxkv  # noqa: E402

TOPIC = b"kv@triax"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
FIELDS = {  # vLLM 0.11.2's structs: (field, allowed types) in order
    "BlockStored": [("block_hashes", list), ("parent_block_hash", (bytes, type(None))),
                    ("token_ids", list), ("block_size", int),
                    ("lora_id", (int, type(None))), ("medium", (str, type(None)))],
    "BlockRemoved": [("block_hashes", list), ("medium", (str, type(None)))],
    "AllBlocksCleared": [],
}
MEDIA = {"GPU", "CPU", "DISK"}


def decode(payload):
    """KVEventBatch as msgspec decodes it: [ts, events, data_parallel_rank?],
    each event [tag, fields...]. Returns (ts, [(tag, {field: value})], rank)
    and fails on anything vLLM's decoder would refuse."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    # The bytes are the canonical encoding (minimal ints, float64, str8,
    # bin8), which is what msgspec writes: re-encoding gives them back.
    assert msgpack.packb(batch, use_bin_type=True) == payload
    assert isinstance(batch, list) and len(batch) in (2, 3), batch
    ts, events = batch[0], batch[1]
    rank = batch[2] if len(batch) == 3 else None
    assert isinstance(ts, float) and ts > 1.6e9, ts
    assert isinstance(events, list)
    assert rank is None or isinstance(rank, int)
    out = []
    for ev in events:
        assert isinstance(ev, list) and ev and isinstance(ev[0], str), ev
        tag = ev[0]
        assert tag in FIELDS, f"unknown tag {tag!r}"
        spec = FIELDS[tag]
        assert len(ev) == 1 + len(spec), f"{tag}: {len(ev) - 1} fields, want {len(spec)}"
        fields = {}
        for (name, typ), value in zip(spec, ev[1:]):
            assert isinstance(value, typ) and not isinstance(value, bool), (tag, name, value)
            fields[name] = value
        if tag != "AllBlocksCleared":
            assert fields["block_hashes"], (tag, fields)
            for h in fields["block_hashes"]:
                assert isinstance(h, bytes) and len(h) == 32, h
            assert fields["medium"] in MEDIA, fields["medium"]
        if tag == "BlockStored":
            p = fields["parent_block_hash"]
            assert p is None or len(p) == 32
            assert all(isinstance(t, int) and t >= 0 for t in fields["token_ids"])
            assert fields["block_size"] > 0 and fields["lora_id"] is None
            assert len(fields["token_ids"]) in (
                0, len(fields["block_hashes"]) * fields["block_size"]), fields
        out.append((tag, fields))
    return ts, out, rank


def free_log_endpoints(manager, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"publishing KV events\"? endpoint=(\S+) replay_endpoint=(\S+)",
                      manager.log(20000))
        if m:
            return m.group(1), m.group(2)
        time.sleep(0.02)
    raise AssertionError("no 'publishing KV events' line:\n" + manager.log())


class Subscriber:
    """A SUB socket on the topic; keeps every batch by sequence number."""

    def __init__(self, ctx, endpoint):
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sock.connect(endpoint)
        self.batches = {}

    def drain(self, timeout_ms):
        while self.sock.poll(timeout_ms):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == TOPIC and len(seq) == 8
            self.batches[int.from_bytes(seq, "big")] = payload
            timeout_ms = 0

    def close(self):
        self.sock.close(linger=0)


def replay(ctx, endpoint, start_bytes, timeout_ms=5000):
    """vLLM's replay client: a DEALER sends ["", start]; frames come back as
    [seq, payload] until the end marker. Returns {seq: payload}."""
    s = ctx.socket(zmq.DEALER)
    s.connect(endpoint)
    try:
        s.send_multipart([b"", start_bytes])
        got = {}
        while True:
            assert s.poll(timeout_ms), "no replay answer"
            frames = s.recv_multipart()
            assert len(frames) == 3 and frames[0] == b"", frames
            if frames[1] == END_SEQ:
                assert frames[2] == b""
                return got
            got[int.from_bytes(frames[1], "big")] = frames[2]
    finally:
        s.close(linger=0)


def wait_until(what, probe, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("kvev"))
    bins = os.environ.get("TRIAX_BIN_DIR", os.path.join(REPO, "build", "bin"))
    os.environ["TRIAX_BIN_DIR"] = bins
    manager = Process("kvmanager", "kvmanager", [
        "--listen=127.0.0.1:0", "--heartbeat_interval_ms=100",
        "--worker_timeout_ms=300", "--worker_down_timeout_ms=800",
        "--metadata=file:" + os.path.join(d, "metadata"),
        "--kv_events_endpoint=tcp://127.0.0.1:*",
        "--kv_events_replay_endpoint=tcp://127.0.0.1:*",
        "--kv_events_topic=" + TOPIC.decode(), "--kv_events_buffer=1000",
        "--data_parallel_rank=0"], d)
    workers = []
    try:
        for i in range(2):
            workers.append(Process(f"w{i}", "kvworker", [
                "--listen=127.0.0.1:0", f"--manager={manager.address}",
                f"--worker_id=w{i}", "--pool_mb=64", "--window_tokens=16"], d))
        with triaxkv.Client(manager.address, timeout=5) as c:
            wait_until("workers UP", lambda: {
                w.worker_id for w in c.list_workers()
                if w.state == triaxkv.types_pb2.WORKER_STATE_UP} == {"w0", "w1"})
        yield manager, workers
    finally:
        for w in workers:
            w.stop()
        manager.stop()


def apply(state, events):
    """The subscriber's view: a count per (hash, medium)."""
    for tag, f in events:
        if tag == "AllBlocksCleared":
            state.clear()
        elif tag == "BlockStored":
            for h in f["block_hashes"]:
                state[(h, f["medium"])] = state.get((h, f["medium"]), 0) + 1
        else:
            for h in f["block_hashes"]:
                key = (h, f["medium"])
                assert state.get(key, 0) > 0, f"removed {h.hex()} never stored"
                state[key] -= 1
                if state[key] == 0:
                    del state[key]


def test_live_stream_schema_chains_replay_and_bad_requests(cluster):
    manager, workers = cluster
    pub_ep, replay_ep = free_log_endpoints(manager)
    ctx = zmq.Context()
    early = Subscriber(ctx, pub_ep)
    # The manager's first batch (AllBlocksCleared) went out before anyone
    # subscribed: replay from 0 gets it, and it opens the stream.
    first = replay(ctx, replay_ep, (0).to_bytes(8, "big"))
    assert 0 in first
    _, ev0, rank = decode(first[0])
    assert ev0 == [("AllBlocksCleared", {})] and rank == 0

    c = triaxkv.Client(manager.address, tenant_id="kvev", timeout=10)
    c.create_tenant()
    # A: four full blocks with token ids -> one BlockStored of four hashes.
    ids_a = list(range(1, 65))
    a = c.open_sequence(MODEL, [("system", 32), ("user", 32)], policy="bf16",
                        block_tokens=16, token_ids=ids_a, worker_id="w0")
    hashes_a = triaxkv.prefix_block_hashes(c.tenant_id, MODEL, 16, ids_a)
    # B: span-aligned blocks 16, 16, 8 (two sealed), then extended by a
    # 16-token span: the 8-token block is sealed (followed) and the new one
    # is full.
    ids_b = list(range(1000, 1040))
    b = c.open_sequence(MODEL, [("system", 40)], policy="bf16", block_tokens=16,
                        token_ids=ids_b, worker_id="w0", no_reuse=True)
    ids_b2 = list(range(2000, 2016))
    c.extend(b, [("user", 16)], token_ids=ids_b2)
    hashes_b = triaxkv.prefix_block_hashes(c.tenant_id, MODEL, 16, ids_b + ids_b2,
                                           block_sizes=[16, 16, 8, 16])
    assert len(hashes_b) == 4

    # A late subscriber: everything so far is only in the replay buffer.
    late = Subscriber(ctx, pub_ep)
    # C on w1, which then dies: its blocks go with it.
    ids_c = list(range(5000, 5032))
    cseq = c.open_sequence(MODEL, [("system", 32)], policy="bf16", block_tokens=16,
                           token_ids=ids_c, worker_id="w1")
    hashes_c = triaxkv.prefix_block_hashes(c.tenant_id, MODEL, 16, ids_c)
    workers[1].proc.kill()
    workers[1].proc.wait()
    with triaxkv.Client(manager.address, timeout=5) as probe:
        wait_until("w1 DOWN", lambda: any(
            w.worker_id == "w1" and w.state == triaxkv.types_pb2.WORKER_STATE_DOWN
            for w in probe.list_workers()))
    c.close_sequence(a)

    # Malformed replay requests: a ROUTER sees [id, ""] (ignored: no
    # answer in the protocol) and [id, "", 4 bytes] (the end marker alone).
    bad = ctx.socket(zmq.DEALER)
    bad.connect(replay_ep)
    bad.send_multipart([b""])
    bad.send_multipart([b"", b"", b"x"])  # 4 frames at the ROUTER: ignored
    bad.close(linger=0)
    assert replay(ctx, replay_ep, b"\x00\x01\x02\x03") == {}
    assert replay(ctx, replay_ep, (1 << 62).to_bytes(8, "big")) == {}

    # Everything published so far, as the buffer holds it; the stream ends
    # once A's removal and C's removal are in it.
    def published():
        return replay(ctx, replay_ep, (0).to_bytes(8, "big"))

    def removed(h, batches):
        return any(tag == "BlockRemoved" and h in f["block_hashes"]
                   for p in batches.values() for tag, f in decode(p)[1])

    wait_until("A's and C's removals", lambda: all(
        removed(h, published()) for h in (hashes_a[0], hashes_c[0])))
    assert manager.proc.poll() is None, manager.log()
    all_batches = published()
    seqs = sorted(all_batches)
    assert seqs == list(range(len(seqs))), seqs  # dense from 0

    # Every event of every batch, decoded; stored chains checked.
    events = []
    for s in seqs:
        _, ev, rank = decode(all_batches[s])
        assert rank == 0
        events.extend(ev)
    stored = [f for tag, f in events if tag == "BlockStored"]
    chain = {}  # hash -> parent, over every stored event
    for f in stored:
        parent = f["parent_block_hash"]
        for h in f["block_hashes"]:
            chain[h] = parent
            parent = h
    for hashes in (hashes_a, hashes_b, hashes_c):
        for i, h in enumerate(hashes):
            assert h in chain, f"block {i} ({h.hex()}) never stored"
            assert chain[h] == (hashes[i - 1] if i else None), f"block {i}'s parent"
    # A's prompt went out as one event, token ids and all.
    ev_a = [f for f in stored if f["block_hashes"][0] == hashes_a[0]]
    assert len(ev_a) == 1 and ev_a[0]["block_hashes"] == hashes_a
    assert ev_a[0]["token_ids"] == ids_a and ev_a[0]["block_size"] == 16
    assert ev_a[0]["medium"] == "GPU"
    # B's 8-token block: its own event, block_size 8, its 8 token ids.
    ev_b2 = [f for f in stored if f["block_hashes"][0] == hashes_b[2]]
    assert len(ev_b2) == 1 and ev_b2[0]["block_size"] == 8
    assert ev_b2[0]["token_ids"] == ids_b[32:40]

    # The subscriber's view: B alone is left (A closed, C lost with w1).
    state = {}
    apply(state, events)
    assert state == {(h, "GPU"): 1 for h in hashes_b}

    # Live delivery matches the buffer byte for byte; the late subscriber
    # missed the start and fills it through replay from its first number.
    early.drain(2000)
    late.drain(2000)
    for s, p in early.batches.items():
        assert all_batches.get(s, p) == p
    assert late.batches, "the late subscriber got nothing live"
    first_live = min(late.batches)
    assert first_live > 0
    filled = replay(ctx, replay_ep, (0).to_bytes(8, "big"))
    merged = {**{s: p for s, p in filled.items() if s < first_live}, **late.batches}
    assert sorted(merged)[:first_live] == list(range(first_live))
    gap = replay(ctx, replay_ep, (1).to_bytes(8, "big"))
    assert min(gap) == 1 and 0 not in gap

    c.close_sequence(b)
    c.close()
    for sub in (early, late):
        sub.close()
    ctx.term()


def test_bad_flags_stop_the_manager_naming_them(tmp_path):
    import subprocess
    binary = os.path.join(os.environ.get("TRIAX_BIN_DIR", os.path.join(REPO, "build", "bin")),
                          "kvmanager")
    cases = [
        (["--kv_events_endpoint=tcp://127.0.0.1:notaport"],
         "--kv_events_endpoint=tcp://127.0.0.1:notaport"),
        (["--kv_events_replay_endpoint=tcp://127.0.0.1:*"], "--kv_events_endpoint"),
        (["--kv_events_endpoint=tcp://127.0.0.1:*", "--kv_events_buffer=0"],
         "--kv_events_buffer=0"),
        (["--kv_events_endpoint=tcp://127.0.0.1:*", "--data_parallel_rank=-2"],
         "--data_parallel_rank=-2"),
        (["--kv_events_endpoint=tcp://127.0.0.1:*", "--data_parallel_rank=1"],
         "--kv_events_endpoint=tcp://127.0.0.1:*"),  # no port to offset
    ]
    for i, (flags, named) in enumerate(cases):
        r = subprocess.run([binary, "--listen=127.0.0.1:0",
                            "--metadata=file:" + str(tmp_path / f"m{i}")] + flags,
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 1, (flags, r.returncode, r.stderr)
        assert named in r.stdout + r.stderr, (flags, r.stdout + r.stderr)


MEDIUM_OF_TIER = {"TIER_DEVICE": "GPU", "TIER_HOST": "CPU", "TIER_DISK": "DISK"}


def test_spills_move_blocks_to_the_disk_medium(tmp_path):
    """Memory pressure spills idle blocks to the disk tier: each leaves GPU
    (BlockRemoved) and is stored on DISK (BlockStored, its parent still the
    chain's); the subscriber's view converges to the manager's tiers."""
    import numpy as np
    d = str(tmp_path)
    manager = Process("kvmanager", "kvmanager", [
        "--listen=127.0.0.1:0", "--heartbeat_interval_ms=100",
        "--metadata=file:" + os.path.join(d, "metadata"),
        "--pressure_interval_ms=50", "--high_watermark=0.6", "--low_watermark=0.4",
        "--window_guard_tokens=0", "--reuse_half_life_ms=100",
        "--spill_disk_penalty=0",
        "--kv_events_endpoint=tcp://127.0.0.1:*",
        "--kv_events_replay_endpoint=tcp://127.0.0.1:*"], d)
    worker = None
    ctx = zmq.Context()
    try:
        worker = Process("w0", "kvworker", [
            "--listen=127.0.0.1:0", f"--manager={manager.address}", "--worker_id=w0",
            "--pool_mb=1", "--frame_kb=16", "--window_tokens=0", "--host_tier_mb=0",
            "--disk_tier_dir=" + os.path.join(d, "disk"), "--disk_tier_mb=64"], d)
        _, replay_ep = free_log_endpoints(manager)
        c = triaxkv.Client(manager.address, tenant_id="spill", timeout=10)
        wait_until("w0 UP", lambda: any(
            w.worker_id == "w0" and w.state == triaxkv.types_pb2.WORKER_STATE_UP
            for w in c.list_workers()))
        c.create_tenant(default_policy="bf16")
        rng = np.random.default_rng(20261125)
        print("seed 20261125")
        seqs, hashes = [], {}
        # 9 x 12 BF16 blocks of 8 KiB in a 1 MiB pool: far past 60%.
        for i in range(9):
            ids = list(range(i * 1000 + 1, i * 1000 + 193))
            s = c.open_sequence(MODEL, [("system", 16), ("user", 176)],
                                block_tokens=16, window_tokens=0, token_ids=ids)
            for layer in range(MODEL.n_layers):
                k = rng.standard_normal((192, MODEL.n_kv_heads, MODEL.head_dim),
                                        dtype=np.float32)
                c.write_kv(s, layer, 0, k, k)
            seqs.append(s)
            hashes[s.sequence_id] = triaxkv.prefix_block_hashes(
                c.tenant_id, MODEL, 16, ids)
        wait_until("a spill", lambda: c.get_pressure().spills > 0, timeout=30)

        def truth():
            out = {}
            for s in seqs:
                info = c.get_sequence(s.sequence_id)
                for i, b in enumerate(info.blocks):
                    if not b.evicted:
                        key = (hashes[s.sequence_id][i],
                               MEDIUM_OF_TIER[triaxkv.types_pb2.Tier.Name(b.tier)])
                        out[key] = out.get(key, 0) + 1
            return out

        def view():
            batches = replay(ctx, replay_ep, (0).to_bytes(8, "big"))
            assert sorted(batches) == list(range(len(batches)))
            state = {}
            for seq in sorted(batches):
                apply(state, decode(batches[seq])[1])
            return state, batches

        wait_until("the stream to agree with the manager's tiers",
                   lambda: view()[0] == truth(), timeout=30)
        state, batches = view()
        assert any(m == "DISK" for _, m in state), "no block on DISK"
        events = [e for seq in sorted(batches) for e in decode(batches[seq])[1]]
        disk = [f for tag, f in events if tag == "BlockStored" and f["medium"] == "DISK"]
        gone = {h for tag, f in events if tag == "BlockRemoved" and f["medium"] == "GPU"
                for h in f["block_hashes"]}
        parents = {}
        for h_list in hashes.values():
            for i, h in enumerate(h_list):
                parents[h] = h_list[i - 1] if i else None
        for f in disk:
            assert f["parent_block_hash"] == parents[f["block_hashes"][0]]
            for h in f["block_hashes"]:
                assert h in gone, f"{h.hex()} stored on DISK but never left GPU"
            assert len(f["token_ids"]) == 16 * len(f["block_hashes"])
        for s in seqs:
            c.close_sequence(s)
        c.close()
    finally:
        ctx.destroy(linger=0)
        if worker is not None:
            worker.stop()
        manager.stop()


if __name__ == "__main__":
    sys.exit(pytest.main([os.path.abspath(__file__), "-q", "-rs",
                          "-p", "no:cacheprovider"]))
