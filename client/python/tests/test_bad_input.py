"""Bad inputs: refused client-side with ValueError / TypeError naming the
argument, or by the servers as typed errors carrying their code and message;
unreachable or silent servers end in Unavailable / DeadlineExceeded within
the client's timeout."""

import socket
import time

import grpc
import numpy as np
import pytest

import triaxkv
from conftest import MODEL

H, HQ, D = MODEL.n_kv_heads, MODEL.n_q_heads, MODEL.head_dim


@pytest.fixture
def seq(client):
    s = client.open_sequence(MODEL, [("user", 8)], policy="bf16", block_tokens=16)
    yield s
    client.close_sequence(s)


def zeros(shape, dtype=np.float32):
    return np.zeros(shape, dtype=dtype)


@pytest.mark.parametrize("k, v, name", [
    (zeros((4, H, D + 1)), zeros((4, H, D)), "k"),        # head_dim off
    (zeros((4, H * D)), zeros((4, H * D)), "k"),          # flattened
    (zeros((4, H, D)), zeros((4, H + 1, D)), "v"),        # heads off
    (zeros((4, H, D)), zeros((3, H, D)), "v"),            # token counts differ
    (zeros((0, H, D)), zeros((0, H, D)), "k"),            # no tokens
    (zeros((4, H, D), np.float64), zeros((4, H, D)), "k"),
    (zeros((4, H, D)), zeros((4, H, D), np.int32), "v"),
])
def test_write_kv_bad_arrays_are_refused_locally(client, seq, k, v, name):
    with pytest.raises(ValueError, match=rf"^{name}: "):
        client.write_kv(seq, 0, 0, k, v)


def test_write_kv_non_array_is_a_type_error(client, seq):
    with pytest.raises(TypeError, match=r"^k: list"):
        client.write_kv(seq, 0, 0, [[0.0]], zeros((1, H, D)))


def test_attend_bad_arguments_are_refused_locally(client, seq):
    q = zeros((2, HQ, D))
    with pytest.raises(ValueError, match=r"^q: shape \(2, 2, 32\)"):
        client.attend(seq, 0, zeros((2, H, D)), [0, 0])
    with pytest.raises(ValueError, match=r"^q: dtype float16"):
        client.attend(seq, 0, q.astype(np.float16), [0, 0])
    with pytest.raises(ValueError, match=r"^positions: shape \(3,\)"):
        client.attend(seq, 0, q, [0, 1, 2])
    with pytest.raises(ValueError, match=r"^positions: -1 is negative"):
        client.attend(seq, 0, q, [0, -1])
    with pytest.raises(ValueError, match=r"^positions: dtype float64"):
        client.attend(seq, 0, q, [0.5, 1.0])
    with pytest.raises(ValueError, match=r"^append_k / append_v"):
        client.attend(seq, 0, q, append_k=zeros((1, H, D)), append_first=0)
    with pytest.raises(ValueError, match=r"^append_first"):
        client.attend(seq, 0, q, append_k=zeros((1, H, D)), append_v=zeros((1, H, D)))


def test_bad_client_arguments_are_refused_locally(client, seq):
    with pytest.raises(ValueError, match=r"^manager_address"):
        triaxkv.Client("")
    with pytest.raises(ValueError, match=r"^timeout"):
        triaxkv.Client("127.0.0.1:1", timeout=0)
    with pytest.raises(ValueError, match=r"^spans / rendered"):
        client.open_sequence(MODEL, [("user", 1)],
                             rendered=triaxkv.rendered("x", "chatml"))
    with pytest.raises(ValueError, match=r"^spans / rendered"):
        client.open_sequence(MODEL)
    with pytest.raises(ValueError, match=r"^role: unknown value 'narrator'"):
        client.open_sequence(MODEL, [("narrator", 4)])
    with pytest.raises(TypeError, match=r"^model"):
        client.open_sequence("llama", [("user", 4)])
    with pytest.raises(ValueError, match=r"^dtype"):
        client.read_kv(seq, 0, dtype="float16")
    with pytest.raises(ValueError, match=r"^format: unknown value 'int3'"):
        triaxkv.block_encoding(1, "int3")
    with pytest.raises(ValueError, match=r"^chat_template"):
        triaxkv.rendered("x", "mistral")


def expect_server_error(cls, call, fn, *words):
    with pytest.raises(cls) as e:
        fn()
    err = e.value
    assert err.code == cls.code and err.call == call
    assert err.message, "the server's message is carried"
    for w in words:
        assert w in err.message, err.message
    assert str(err).startswith(f"{call}: {cls.code.name}: {err.message}")
    return err


def test_server_refusals_arrive_typed(client, seq, cluster):
    expect_server_error(triaxkv.InvalidArgument, "OpenSequence",
                        lambda: client.open_sequence(MODEL, [("user", 0)]), "num_tokens")
    bad_model = triaxkv.ModelShape(name="odd", n_layers=2, n_kv_heads=2, n_q_heads=3,
                                   head_dim=32)
    expect_server_error(triaxkv.InvalidArgument, "OpenSequence",
                        lambda: client.open_sequence(bad_model, [("user", 4)]), "n_q_heads")
    expect_server_error(triaxkv.InvalidArgument, "OpenSequence",
                        lambda: client.open_sequence(MODEL, [("user", 4)], policy="nope"),
                        '"nope" is not a known policy')
    expect_server_error(triaxkv.NotFound, "GetSequence",
                        lambda: client.get_sequence("no-such-seq"), "no-such-seq")
    stranger = triaxkv.Client(cluster.address, tenant_id="py-nobody", timeout=5)
    expect_server_error(triaxkv.NotFound, "OpenSequence",
                        lambda: stranger.open_sequence(MODEL, [("user", 4)]), "py-nobody")
    stranger.close()
    expect_server_error(triaxkv.AlreadyExists, "CreateTenant",
                        lambda: client.create_tenant(budgets=[triaxkv.budget("device", 0, 1)]))
    # Worker refusals: out-of-order write, unwritten position, a layer past the model.
    k = np.ones((2, H, D), dtype=np.float32)
    err = expect_server_error(triaxkv.FailedPrecondition, "WriteKV",
                              lambda: client.write_kv(seq, 0, 4, k, k))
    assert "first_token" in err.message or "written" in err.message
    client.write_kv(seq, 0, 0, k, k)
    expect_server_error(triaxkv.OutOfRange, "Attend",
                        lambda: client.attend(seq, 0, zeros((1, HQ, D)), [5]),
                        "positions[0]=5 is not written")
    expect_server_error(triaxkv.InvalidArgument, "WriteKV",
                        lambda: client.write_kv(seq, 7, 0, k, k), "layer")
    expect_server_error(triaxkv.InvalidArgument, "DemoteBlocks",
                        lambda: client.demote(seq, [triaxkv.block_encoding(
                            seq.blocks[0].lineage_id, "int4", group_size=48)]), "48")


def test_closed_sequence_is_refused(client):
    s = client.open_sequence(MODEL, [("user", 8)], policy="bf16")
    client.close_sequence(s)
    expect_server_error(triaxkv.FailedPrecondition, "ExtendSequence",
                        lambda: client.extend(s, [("user", 1)]), s.sequence_id)
    assert client.get_sequence(s.sequence_id).num_tokens == 8


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_manager_is_unavailable_within_the_timeout():
    c = triaxkv.Client(f"127.0.0.1:{free_port()}", tenant_id="t", timeout=2.0)
    start = time.monotonic()
    with pytest.raises(triaxkv.Unavailable) as e:
        c.open_sequence(MODEL, [("user", 4)])
    elapsed = time.monotonic() - start
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.call == "OpenSequence"
    # One retry (the same request id) at most: two deadlines bound it.
    assert elapsed < 2 * 2.0 + 1.0, elapsed
    c.close()


def test_silent_manager_ends_in_deadline_exceeded():
    # A socket that listens but never speaks HTTP/2: only the deadline ends it.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        c = triaxkv.Client(f"127.0.0.1:{s.getsockname()[1]}", timeout=0.5)
        start = time.monotonic()
        with pytest.raises(triaxkv.DeadlineExceeded) as e:
            c.list_workers()
        assert time.monotonic() - start < 0.5 + 1.0
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        c.close()
