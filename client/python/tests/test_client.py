"""The Python client end to end against real kvmanager / kvworker processes."""

import numpy as np
import pytest

import triaxkv
from conftest import MODEL

# The CPU backend computes attention in float32 over BF16 K/V; against a
# float64 oracle over the same BF16 values (tests/integration/reference.cc's
# "cpu" tolerance).
ATOL, RTOL = 1e-4, 1e-3
H, HQ, D = MODEL.n_kv_heads, MODEL.n_q_heads, MODEL.head_dim


def rng(seed):
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def kv(r, n):
    return (r.standard_normal((n, H, D), dtype=np.float32),
            r.standard_normal((n, H, D), dtype=np.float32))


def reference_attention(q, k, v, positions):
    """float64 decode attention; query i attends to tokens [0, positions[i]]."""
    k, v = k.astype(np.float64), v.astype(np.float64)
    group = HQ // H
    out = np.zeros(q.shape, dtype=np.float64)
    for i, p in enumerate(positions):
        for h in range(HQ):
            kh, vh = k[: p + 1, h // group], v[: p + 1, h // group]
            s = kh @ q[i, h].astype(np.float64) / np.sqrt(D)
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ vh
    return out


def assert_close(out, ref):
    assert out.dtype == np.float32 and out.shape == ref.shape
    assert np.all(np.isfinite(out))
    assert np.linalg.norm(out) > 0.1  # an all-zero answer cannot pass
    ratio = np.abs(out - ref) / (ATOL + RTOL * np.abs(ref))
    assert ratio.max() <= 1.0, f"worst |out-ref|/(atol+rtol|ref|) = {ratio.max()}"


def open_bf16(client, **kw):
    # system 20 + user 13 tokens, 16-token blocks -> blocks of 16 | 4 | 13.
    return client.open_sequence(MODEL, [("system", 20), ("user", 13)], policy="bf16",
                                block_tokens=16, **kw)


def write_all(client, seq, k, v, first=0):
    for layer in range(MODEL.n_layers):
        assert client.write_kv(seq, layer, first, k[layer], v[layer]) == len(k[layer])


def test_open_write_read_roundtrip(client):
    seq = open_bf16(client)
    assert seq.num_tokens == 33 and seq.block_tokens == 16
    assert [b.num_tokens for b in seq.blocks] == [16, 4, 13]
    assert seq.blocks[0].tag.temporal == triaxkv.types_pb2.TEMPORAL_SINK
    assert seq.blocks[2].tag.role == triaxkv.types_pb2.ROLE_USER
    assert all(b.format == triaxkv.types_pb2.FORMAT_BF16 for b in seq.blocks)
    assert len({b.lineage_id for b in seq.blocks}) == 3
    assert seq.worker_address and seq.worker_id in ("w0", "w1")

    r = rng(20261125)
    ks, vs = zip(*(kv(r, 33) for _ in range(MODEL.n_layers)))
    # Layer 0 in two writes (the second continues where the first ended);
    # layer 1 as BF16 bit patterns.
    client.write_kv(seq, 0, 0, ks[0][:20], vs[0][:20])
    client.write_kv(seq, 0, 20, ks[0][20:], vs[0][20:])
    client.write_kv(seq, 1, 0, triaxkv.float32_to_bf16(ks[1]), triaxkv.float32_to_bf16(vs[1]))
    for layer in range(MODEL.n_layers):
        k, v = client.read_kv(seq, layer)
        assert k.shape == (33, H, D) and k.dtype == np.float32
        np.testing.assert_array_equal(k, triaxkv.round_to_bf16(ks[layer]))
        np.testing.assert_array_equal(v, triaxkv.round_to_bf16(vs[layer]))
        kb, vb = client.read_kv(seq, layer, 5, 10, dtype="bfloat16")
        assert kb.dtype == np.uint16 and kb.shape == (10, H, D)
        np.testing.assert_array_equal(kb, triaxkv.float32_to_bf16(ks[layer][5:15]))
        np.testing.assert_array_equal(vb, triaxkv.float32_to_bf16(vs[layer][5:15]))
    client.close_sequence(seq)


def test_bf16_rounding_matches_the_worker_conversion():
    # kernels/numeric.h FloatToBf16: nearest, ties to even; NaN kept quiet.
    cases = {
        0x3F808000: 0x3F80,  # 1 + 2^-8: a tie, to the even 1.0
        0x3F818000: 0x3F82,  # a tie above an odd value: up
        0x3F80C000: 0x3F81,  # above the half: up
        0x3F804000: 0x3F80,  # below the half: down
        0xBF80FFFF: 0xBF81,  # negative values round on the magnitude
        0x7F800000: 0x7F80,  # +inf
        0x7F7FFFFF: 0x7F80,  # the largest float32 rounds to +inf
        0x7F800001: 0x7FC0,  # a signalling NaN comes back quiet
        0x00000001: 0x0000,  # the smallest subnormal flushes to +0
    }
    src = np.array(list(cases), dtype=np.uint32).view(np.float32)
    np.testing.assert_array_equal(triaxkv.float32_to_bf16(src),
                                  np.array(list(cases.values()), dtype=np.uint16))
    back = triaxkv.bf16_to_float32(np.array([0x3F80, 0xC040], dtype=np.uint16))
    np.testing.assert_array_equal(back, np.array([1.0, -3.0], dtype=np.float32))


def test_attend_matches_numpy_reference(client):
    seq = open_bf16(client)
    r = rng(7)
    ks, vs = zip(*(kv(r, 33) for _ in range(MODEL.n_layers)))
    write_all(client, seq, ks, vs)
    positions = [0, 15, 16, 19, 32]
    for layer in range(MODEL.n_layers):
        q = r.standard_normal((len(positions), HQ, D), dtype=np.float32)
        out = client.attend(seq, layer, q, positions)
        ref = reference_attention(q, triaxkv.round_to_bf16(ks[layer]),
                                  triaxkv.round_to_bf16(vs[layer]), positions)
        assert_close(out, ref)
    # No positions: every query attends to all written tokens.
    q = r.standard_normal((2, HQ, D), dtype=np.float32)
    out = client.attend(seq, 1, q)
    assert_close(out, reference_attention(q, triaxkv.round_to_bf16(ks[1]),
                                          triaxkv.round_to_bf16(vs[1]), [32, 32]))
    client.close_sequence(seq)


def test_decode_step_appends_in_attend(client):
    seq = open_bf16(client)
    r = rng(11)
    ks, vs = zip(*(kv(r, 33) for _ in range(MODEL.n_layers)))
    write_all(client, seq, ks, vs)
    client.extend(seq, [("assistant", 1)], new_turn=False)
    assert seq.num_tokens == 34
    for layer in range(MODEL.n_layers):
        k1, v1 = kv(r, 1)
        q = r.standard_normal((1, HQ, D), dtype=np.float32)
        out = client.attend(seq, layer, q, [33], append_k=k1, append_v=v1, append_first=33)
        k_all = triaxkv.round_to_bf16(np.concatenate([ks[layer], k1]))
        v_all = triaxkv.round_to_bf16(np.concatenate([vs[layer], v1]))
        assert_close(out, reference_attention(q, k_all, v_all, [33]))
        k, v = client.read_kv(seq, layer, 33, 1)
        np.testing.assert_array_equal(k, k_all[33:])
        np.testing.assert_array_equal(v, v_all[33:])
    client.close_sequence(seq)


def test_extend_fork_share_and_close_frees(client, cluster):
    seq = open_bf16(client)
    r = rng(13)
    ks, vs = zip(*(kv(r, 33) for _ in range(MODEL.n_layers)))
    write_all(client, seq, ks, vs)
    first = [b.lineage_id for b in seq.blocks]

    client.extend(seq, [("user", 5)], new_turn=True)
    assert seq.num_tokens == 38 and [b.lineage_id for b in seq.blocks[:3]] == first
    assert seq.info.turns == 2
    k5, v5 = kv(r, 5)
    for layer in range(MODEL.n_layers):
        client.write_kv(seq, layer, 33, k5, v5)

    # A whole fork shares every block; both read the same pages.
    child = client.fork(seq)
    assert child.sequence_id != seq.sequence_id
    assert child.worker_address == seq.worker_address
    assert [b.lineage_id for b in child.blocks] == [b.lineage_id for b in seq.blocks]
    client.refresh_plan(seq)
    assert all(b.refcount == 2 for b in seq.blocks)
    q = r.standard_normal((2, HQ, D), dtype=np.float32)
    np.testing.assert_array_equal(client.attend(child, 1, q, [10, 37]),
                                  client.attend(seq, 1, q, [10, 37]))

    # A fork cut inside block 1 copies that block into a new lineage.
    cut = client.fork(seq, 18)
    assert cut.num_tokens == 18 and len(cut.blocks) == 2
    assert cut.blocks[0].lineage_id == first[0] and cut.blocks[1].lineage_id != first[1]
    k, v = client.read_kv(cut, 0)
    np.testing.assert_array_equal(k, triaxkv.round_to_bf16(ks[0][:18]))
    np.testing.assert_array_equal(v, triaxkv.round_to_bf16(vs[0][:18]))

    # Closing: shared blocks are freed only with their last holder.
    assert client.close_sequence(cut) == [cut.blocks[1].lineage_id]
    assert client.close_sequence(child) == []
    freed = client.close_sequence(seq)
    assert sorted(freed) == sorted(b.lineage_id for b in seq.blocks)
    assert client.get_sequence(seq.sequence_id).state == \
        triaxkv.types_pb2.SEQUENCE_STATE_CLOSED
    assert client.list_sequences() == []
    assert len(client.list_sequences(include_closed=True)) == 3
    tenant = [t for t in client.list_tenants() if t.tenant_id == client.tenant_id][0]
    assert tenant.open_sequences == 0
    assert all(u.used_bytes == 0 for u in tenant.usage)
    with pytest.raises(triaxkv.NotFound):
        client.read_kv(seq, 0)  # the worker freed its pages


def test_rendered_chat_text_is_tagged_by_the_manager(client):
    text = ("<|im_start|>system\nYou are terse.<|im_end|>\n"
            "<|im_start|>user\nHi there<|im_end|>\n")
    seq = client.open_sequence(MODEL, rendered=triaxkv.rendered(text, "chatml", bos_tokens=1),
                               policy="bf16", block_tokens=16)
    assert seq.num_tokens == len(text.encode()) + 1
    roles = {b.tag.role for b in seq.blocks}
    assert triaxkv.types_pb2.ROLE_SYSTEM in roles and triaxkv.types_pb2.ROLE_USER in roles
    before = seq.num_tokens
    more = "<|im_start|>assistant\nHello.<|im_end|>\n"
    client.extend(seq, rendered=triaxkv.rendered(more, "chatml"))
    assert seq.num_tokens == before + len(more)
    assert triaxkv.types_pb2.ROLE_ASSISTANT in {b.tag.role for b in seq.blocks}
    client.close_sequence(seq)


def test_demote_reencodes_and_frees_bytes(client):
    seq = client.open_sequence(MODEL, [("system", 48)], policy="bf16", block_tokens=16,
                               window_tokens=0)
    r = rng(17)
    ks, vs = zip(*(kv(r, 48) for _ in range(MODEL.n_layers)))
    write_all(client, seq, ks, vs)
    target = seq.blocks[1].lineage_id
    delta = client.demote(seq, [triaxkv.block_encoding(target, "int8")])
    assert delta < 0
    assert seq.blocks[1].format == triaxkv.types_pb2.FORMAT_INT8
    assert seq.blocks[0].format == triaxkv.types_pb2.FORMAT_BF16
    k, _ = client.read_kv(seq, 0, 16, 16)
    ref = triaxkv.round_to_bf16(ks[0][16:32])
    err = np.abs(k - ref).max()
    assert 0 < err < 0.1  # re-encoded: close to, but no longer exactly, BF16
    client.close_sequence(seq)


def test_lists_follow_every_page(client):
    seqs = [open_bf16(client) for _ in range(5)]
    client.close_sequence(seqs[2])
    ids = [s.sequence_id for s in seqs]
    # Pages of 2: every open sequence once, in creation order.
    listed = [s.sequence_id for s in client.list_sequences(page_size=2)]
    assert listed == ids[:2] + ids[3:]
    listed = [s.sequence_id for s in client.list_sequences(include_closed=True,
                                                           page_size=1)]
    assert listed == ids
    assert [t.tenant_id for t in client.list_tenants(page_size=1)] == \
        [t.tenant_id for t in client.list_tenants()]
    assert client.tenant_id in [t.tenant_id for t in client.list_tenants(page_size=1)]
    workers = [w.worker_id for w in client.list_workers(page_size=1)]
    assert len(workers) >= 2 and workers == sorted(workers)
    with pytest.raises(triaxkv.InvalidArgument) as e:
        client.list_sequences(page_size=-1)
    assert "page_size -1" in e.value.message and e.value.call == "ListSequences"
    for s in seqs[:2] + seqs[3:]:
        client.close_sequence(s)


def test_watch_events_replays_and_cancels(client):
    seq = open_bf16(client)
    client.close_sequence(seq)
    kinds = [e.kind for e in client.watch_events(1, sequence_id=seq.sequence_id,
                                                  replay_only=True)]
    E = triaxkv.types_pb2
    # Blocks are planned before the sequence counts as opened.
    assert kinds[:4] == [E.EVENT_BLOCK_CREATED] * 3 + [E.EVENT_SEQUENCE_OPENED]
    assert kinds[-1] == E.EVENT_SEQUENCE_CLOSED
    assert kinds.count(E.EVENT_BLOCK_FREED) == 3
    # max_events ends the stream; all events are this tenant's.
    events = list(client.watch_events(1, max_events=2))
    assert len(events) == 2 and all(e.tenant_id == client.tenant_id for e in events)
    # A live watch with nothing to report: cancel ends it, a deadline raises.
    with client.watch_events(0, sequence_id="none-such", timeout=30) as stream:
        stream.cancel()
        assert list(stream) == []
    with pytest.raises(triaxkv.DeadlineExceeded) as e:
        next(client.watch_events(0, sequence_id="none-such", timeout=0.3))
    assert e.value.code.name == "DEADLINE_EXCEEDED" and e.value.call == "WatchEvents"


def test_transfer_moves_the_sequence(client):
    seq = open_bf16(client, worker_id="w0")
    assert seq.worker_id == "w0"
    r = rng(19)
    ks, vs = zip(*(kv(r, 33) for _ in range(MODEL.n_layers)))
    write_all(client, seq, ks, vs)
    source = seq.worker_address
    resp = client.transfer_sequence(seq, destination_worker_id="w1")
    assert resp.destination_worker_id == "w1" and resp.blocks == 3
    assert seq.worker_id == "w1" and seq.worker_address != source
    for layer in range(MODEL.n_layers):
        k, v = client.read_kv(seq, layer)
        np.testing.assert_array_equal(k, triaxkv.round_to_bf16(ks[layer]))
        np.testing.assert_array_equal(v, triaxkv.round_to_bf16(vs[layer]))
    client.close_sequence(seq)


def test_tenant_budget_and_resource_exhausted(client):
    t = client.set_budget("device", 0, 4096)
    assert [(b.tier, b.ceiling_bytes) for b in t.budgets] == [(triaxkv.types_pb2.TIER_DEVICE,
                                                               4096)]
    with pytest.raises(triaxkv.ResourceExhausted) as e:
        open_bf16(client)
    assert e.value.code.name == "RESOURCE_EXHAUSTED" and e.value.call == "OpenSequence"
    assert e.value.message and "4096" in e.value.message
    assert client.list_sequences() == []


def test_torch_tensors_in_and_out(client):
    torch = pytest.importorskip("torch")
    seq = open_bf16(client)
    r = rng(23)
    k, v = kv(r, 33)
    client.write_kv(seq, 0, 0, torch.from_numpy(k), torch.from_numpy(v).to(torch.bfloat16))
    kt, vt = client.read_kv(seq, 0, output="torch")
    assert isinstance(kt, torch.Tensor) and kt.dtype == torch.float32
    np.testing.assert_array_equal(kt.numpy(), triaxkv.round_to_bf16(k))
    kb, _ = client.read_kv(seq, 0, dtype="bfloat16", output="torch")
    assert kb.dtype == torch.bfloat16
    out = client.attend(seq, 0, torch.from_numpy(r.standard_normal((1, HQ, D),
                                                                   dtype=np.float32)), [32])
    assert isinstance(out, torch.Tensor) and out.shape == (1, HQ, D)
    client.close_sequence(seq)
