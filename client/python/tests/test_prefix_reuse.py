"""Prefix reuse by content hash through the Python client (docs/python.md):
a second open with the same prompt prefix shares the first sequence's pages
and reads its K/V back bit for bit; another tenant does not reuse; client
hashes match the manager's; bad token ids are refused naming the field."""

import numpy as np
import pytest

import triaxkv
from conftest import MODEL

H, D = MODEL.n_kv_heads, MODEL.head_dim
SPANS = [("system", 32), ("user", 32)]


def write_all(client, seq, first, n, seed):
    r = np.random.default_rng(seed)
    for layer in range(MODEL.n_layers):
        k = r.standard_normal((n, H, D), dtype=np.float32)
        v = r.standard_normal((n, H, D), dtype=np.float32)
        client.write_kv(seq, layer, first, k, v)


def indexed(client):
    req = triaxkv.manager_pb2.GetPressureRequest()
    return client.manager.GetPressure(req, timeout=10).prefix_index_blocks


def test_second_open_reuses_the_prefix_and_reads_it_back(client, cluster):
    ids = list(range(1, 65))
    a = client.open_sequence(MODEL, SPANS, policy="bf16", block_tokens=16, token_ids=ids)
    assert a.prefix_tokens == 0
    write_all(client, a, 0, 64, 7)
    b_ids = ids[:48] + list(range(9000, 9016))
    b = client.open_sequence(MODEL, SPANS, policy="bf16", block_tokens=16, token_ids=b_ids)
    assert b.prefix_sequence_id == a.sequence_id and b.prefix_tokens == 48
    assert [x.lineage_id for x in b.blocks[:3]] == [x.lineage_id for x in a.blocks[:3]]
    write_all(client, b, 48, 16, 8)
    for layer in range(MODEL.n_layers):
        ka, va = client.read_kv(a, layer, 0, 48, dtype="bfloat16")
        kb, vb = client.read_kv(b, layer, 0, 48, dtype="bfloat16")
        np.testing.assert_array_equal(ka, kb)
        np.testing.assert_array_equal(va, vb)

    # The client's hashes are the manager's: hashes alone reuse too.
    hashes = triaxkv.prefix_block_hashes(client.tenant_id, MODEL, 16, ids)
    assert len(hashes) == 4 and all(len(h) == 32 for h in hashes)
    c = client.open_sequence(MODEL, SPANS, policy="bf16", block_tokens=16,
                             block_hashes=hashes)
    # (all but the block holding the prompt's last token)
    assert c.prefix_sequence_id == a.sequence_id and c.prefix_tokens == 48

    # Span-aligned blocks (16, 4, 16, 16): the client's hashes with the
    # blocks' sizes match the manager's, partial block included.
    spans2 = [("system", 20), ("user", 32)]
    ids2 = list(range(500, 552))
    e = client.open_sequence(MODEL, spans2, policy="bf16", block_tokens=16, token_ids=ids2)
    assert [x.num_tokens for x in e.blocks] == [16, 4, 16, 16]
    write_all(client, e, 0, 52, 9)
    hashes2 = triaxkv.prefix_block_hashes(client.tenant_id, MODEL, 16, ids2,
                                          block_sizes=[16, 4, 16, 16])
    f = client.open_sequence(MODEL, spans2, policy="bf16", block_tokens=16,
                             block_hashes=hashes2)
    assert f.prefix_sequence_id == e.sequence_id and f.prefix_tokens == 36

    # Another tenant with the same tokens: nothing shared.
    other = triaxkv.Client(cluster.address, tenant_id=client.tenant_id + "-other", timeout=10)
    other.create_tenant()
    d = other.open_sequence(MODEL, SPANS, policy="bf16", block_tokens=16, token_ids=ids)
    assert d.prefix_tokens == 0 and d.prefix_sequence_id == ""
    other.close_sequence(d)
    other.close()
    for s in (a, b, c, e, f):
        client.close_sequence(s)


def test_bad_token_ids_and_hashes_name_the_field(client):
    with pytest.raises(triaxkv.InvalidArgument, match="token_ids has 3 ids"):
        client.open_sequence(MODEL, SPANS, block_tokens=16, token_ids=[1, 2, 3])
    with pytest.raises(triaxkv.InvalidArgument, match=r"block_hashes\[0\] has 5 bytes"):
        client.open_sequence(MODEL, SPANS, block_tokens=16, block_hashes=[b"short"])
    with pytest.raises(triaxkv.InvalidArgument, match="prefix_salt"):
        client.create_tenant(client.tenant_id + "-x", prefix_salt="bad salt")


def test_shared_salt_hashes_differ_from_private_ones():
    ids = list(range(32))
    private = triaxkv.prefix_block_hashes("t1", MODEL, 16, ids)
    shared1 = triaxkv.prefix_block_hashes("t1", MODEL, 16, ids, prefix_salt="team")
    shared2 = triaxkv.prefix_block_hashes("t2", MODEL, 16, ids, prefix_salt="team")
    assert shared1 == shared2 and private != shared1
    assert len(triaxkv.prefix_block_hashes("t1", MODEL, 16, ids[:31])) == 1
    # Span-aligned blocks: 16, 4 (sealed by the next), 12 (partial, last).
    sized = triaxkv.prefix_block_hashes("t1", MODEL, 16, ids, block_sizes=[16, 4, 12])
    assert len(sized) == 2 and sized[0] == private[0] and sized[1] != private[1]
