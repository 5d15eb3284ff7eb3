"""Compound calls undo their manager half when the worker refuses (as
client/kv_client_test.cc checks for the C++ client), against an in-process
fake manager and fake worker: the worker's error reaches the caller typed,
and the manager is told to close (open, fork) or to truncate back (extend)."""

from concurrent import futures

import grpc
import pytest

import triaxkv
from conftest import MODEL
from triax.v1 import manager_pb2_grpc, worker_pb2, worker_pb2_grpc

T = triaxkv.types_pb2
M = triaxkv.manager_pb2


class FakeManager(manager_pb2_grpc.ManagerServicer):
    def __init__(self):
        self.worker_address = ""
        self.closed, self.truncated = [], []
        self.tokens = 0

    def _info(self, sequence_id, tokens):
        blocks = [T.BlockPlan(index=i, lineage_id=100 + i, first_token=16 * i,
                              num_tokens=min(16, tokens - 16 * i), capacity=16,
                              format=T.FORMAT_BF16)
                  for i in range((tokens + 15) // 16)]
        return T.SequenceInfo(sequence_id=sequence_id, model=MODEL, worker_id="fake",
                              worker_address=self.worker_address, block_tokens=16,
                              num_tokens=tokens, blocks=blocks,
                              state=T.SEQUENCE_STATE_OPEN)

    def OpenSequence(self, req, ctx):
        self.tokens = sum(s.num_tokens for s in req.spans)
        return M.OpenSequenceResponse(sequence=self._info("s1", self.tokens))

    def ExtendSequence(self, req, ctx):
        self.tokens += sum(s.num_tokens for s in req.spans)
        return M.ExtendSequenceResponse(sequence=self._info(req.sequence_id, self.tokens))

    def ForkSequence(self, req, ctx):
        return M.ForkSequenceResponse(sequence=self._info("child", self.tokens))

    def TruncateSequence(self, req, ctx):
        self.truncated.append((req.sequence_id, req.num_tokens))
        self.tokens = req.num_tokens
        return M.TruncateSequenceResponse(sequence=self._info(req.sequence_id, self.tokens))

    def CloseSequence(self, req, ctx):
        self.closed.append(req.sequence_id)
        return M.CloseSequenceResponse()


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """Accepts AllocatePages up to `max_tokens` planned tokens; refuses
    ForkSequence."""

    def __init__(self):
        self.max_tokens = 1 << 30
        self.allocations = 0

    def AllocatePages(self, req, ctx):
        tokens = sum(b.num_tokens for b in req.blocks)
        if tokens > self.max_tokens:
            ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"pool full: {tokens} tokens planned, room for {self.max_tokens}")
        self.allocations += 1
        return worker_pb2.AllocatePagesResponse()

    def ForkSequence(self, req, ctx):
        ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, "fork refused by the fake")


@pytest.fixture
def fakes():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    manager, worker = FakeManager(), FakeWorker()
    manager_pb2_grpc.add_ManagerServicer_to_server(manager, server)
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    manager.worker_address = f"127.0.0.1:{port}"
    client = triaxkv.Client(f"127.0.0.1:{port}", tenant_id="t", timeout=5)
    yield client, manager, worker
    client.close()
    server.stop(None)


def test_open_refused_by_the_worker_closes_on_the_manager(fakes):
    client, manager, worker = fakes
    worker.max_tokens = 10
    with pytest.raises(triaxkv.ResourceExhausted) as e:
        client.open_sequence(MODEL, [("user", 20)])
    assert e.value.call == "AllocatePages"
    assert e.value.message == "pool full: 20 tokens planned, room for 10"
    assert manager.closed == ["s1"]


def test_extend_refused_by_the_worker_truncates_back(fakes):
    client, manager, worker = fakes
    seq = client.open_sequence(MODEL, [("user", 20)])
    worker.max_tokens = 30
    with pytest.raises(triaxkv.ResourceExhausted) as e:
        client.extend(seq, [("user", 12)], new_turn=True)
    assert e.value.call == "AllocatePages" and "32 tokens planned" in e.value.message
    assert manager.truncated == [("s1", 20)]
    assert seq.num_tokens == 20 and len(seq.blocks) == 2  # the handle is unchanged
    client.extend(seq, [("user", 10)], new_turn=True)  # fits: the retry works
    assert seq.num_tokens == 30 and manager.closed == []


def test_fork_refused_by_the_worker_closes_the_child(fakes):
    client, manager, _ = fakes
    seq = client.open_sequence(MODEL, [("user", 20)])
    with pytest.raises(triaxkv.FailedPrecondition) as e:
        client.fork(seq)
    assert e.value.call == "Worker.ForkSequence"
    assert e.value.message == "fork refused by the fake"
    assert manager.closed == ["child"]
