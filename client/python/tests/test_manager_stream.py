"""Client(manager_stream=True): the sequence calls on one Manager.SequenceCalls
stream (triaxkv/calls.py) against real kvmanager / kvworker processes. The
end-to-end tests of test_client.py run again on a stream client, and the
stream's own behaviour: many threads on one stream, a call's error as the
unary call's, a deadline."""

import itertools
import threading

import pytest

import test_client as unary_tests
import triaxkv
from conftest import MODEL


_tenants = itertools.count(1)


@pytest.fixture
def stream_client(cluster):
    c = triaxkv.Client(cluster.address, tenant_id=f"py-stream-{next(_tenants)}",
                       timeout=10, manager_stream=True)
    c.create_tenant()
    yield c
    c.close()


def test_open_write_read_roundtrip(stream_client):
    unary_tests.test_open_write_read_roundtrip(stream_client)
    assert stream_client._sequence_calls.streams_opened == 1


def test_attend_matches_numpy_reference(stream_client):
    unary_tests.test_attend_matches_numpy_reference(stream_client)


def test_extend_fork_share_and_close_frees(stream_client, cluster):
    unary_tests.test_extend_fork_share_and_close_frees(stream_client, cluster)
    assert stream_client._sequence_calls.streams_opened == 1


def test_errors_are_the_unary_calls(stream_client):
    with pytest.raises(triaxkv.NotFound, match="GetSequence"):
        stream_client.get_sequence("no-such-sequence")
    # A refused Open (an unknown policy) changes nothing, on the stream too.
    with pytest.raises(triaxkv.Error) as e:
        stream_client.open_sequence(MODEL, [("user", 8)], policy="no-such-policy")
    assert "OpenSequence" in str(e.value)
    assert stream_client.list_sequences() == []


def test_many_threads_share_one_stream(stream_client):
    failures = []

    def sessions():
        try:
            for _ in range(5):
                seq = stream_client.open_sequence(MODEL, [("user", 20)], block_tokens=16)
                stream_client.extend(seq, [("assistant", 8)], new_turn=True)
                assert seq.num_tokens == 28
                stream_client.close_sequence(seq)
        except Exception as e:  # reported below
            failures.append(e)

    threads = [threading.Thread(target=sessions) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert stream_client._sequence_calls.streams_opened == 1
    assert stream_client.list_sequences() == []


def test_a_call_past_its_deadline(stream_client):
    calls = stream_client._sequence_calls
    req = triaxkv.manager_pb2.GetSequenceRequest(tenant_id=stream_client.tenant_id,
                                                 sequence_id="x")
    with pytest.raises(triaxkv.calls.StreamCallError) as e:
        calls.call("get", req, 0)
    assert e.value.code().name == "DEADLINE_EXCEEDED"
    # The stream serves the next call.
    with pytest.raises(triaxkv.NotFound):
        stream_client.get_sequence("x")
