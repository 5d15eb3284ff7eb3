"""Client(manager_stream=True): the sequence calls on one Manager.SequenceCalls
stream (triaxkv/calls.py) against real kvmanager / kvworker processes. The
end-to-end tests of test_client.py run again on a stream client, and the
stream's own behaviour: many threads on one stream, a call's error as the
unary call's, a deadline."""

import itertools
import threading

import grpc
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


class _OlderManager:
    """A manager without SequenceCalls (UNIMPLEMENTED, as gRPC answers for a
    method a server does not have): GetSequence only, counting calls."""

    def __init__(self):
        from triaxkv._proto import manager_pb2, manager_pb2_grpc, types_pb2

        calls = self.calls = []

        class Servicer(manager_pb2_grpc.ManagerServicer):
            def GetSequence(self, request, context):
                calls.append(request.sequence_id)
                if request.sequence_id == "gone":
                    context.abort(grpc.StatusCode.NOT_FOUND,
                                  'sequence_id "gone" is not known')
                info = types_pb2.SequenceInfo(sequence_id=request.sequence_id,
                                                num_tokens=7)
                return manager_pb2.GetSequenceResponse(sequence=info)

        from concurrent import futures
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        manager_pb2_grpc.add_ManagerServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()


def test_an_older_manager_gets_unary_calls():
    fake = _OlderManager()
    try:
        c = triaxkv.Client(f"127.0.0.1:{fake.port}", tenant_id="acme", timeout=5,
                           manager_stream=True)
        info = c.get_sequence("s1")
        assert info.sequence_id == "s1" and info.num_tokens == 7
        assert fake.calls == ["s1"]
        # The stream is given up: later calls go unary, errors included.
        assert c._sequence_calls is None
        with pytest.raises(triaxkv.NotFound, match="GetSequence.*gone"):
            c.get_sequence("gone")
        assert c.get_sequence("s2").sequence_id == "s2"
        assert fake.calls == ["s1", "gone", "s2"]
        c.close()
    finally:
        fake.server.stop(0)
