"""One Manager.SequenceCalls stream shared by a client's threads
(docs/manager.md "Call streams"; the C++ twin is
client/sequence_call_stream.h). Client(manager_stream=True) sends its
sequence calls (Open, Extend, Close, Fork, Truncate, GetSequence,
ReportAccess) on it: calls queued while the stream's sender is busy leave
together in one batch, and the manager answers each as its unary RPC.

The stream opens on the first call and again on the first call after it
ended (every call waiting then gets the stream's status; UNAVAILABLE when
it ended without one). A call past its timeout raises DEADLINE_EXCEEDED
(the manager may still apply it; mutating calls carry request ids, so a
retry is safe). Thread-safe.
"""

import itertools
import queue
import threading

import grpc

from ._proto import manager_pb2

_CODES = {c.value[0]: c for c in grpc.StatusCode}


class StreamCallError(grpc.RpcError):
    """A call's own error status, or the stream's end, as a grpc.RpcError
    (code(), details()); errors.from_rpc_error maps it like any other."""

    def __init__(self, code, details, answered):
        super().__init__(details)
        self._code = code
        self._details = details
        self.answered = answered  # False: the stream ended before a reply

    def code(self):
        return self._code

    def details(self):
        return self._details


class _Waiter:
    __slots__ = ("event", "reply", "error")

    def __init__(self):
        self.event = threading.Event()
        self.reply = None
        self.error = None


class _Stream:
    """One SequenceCalls call: a sender generator fed by a queue, a reader
    thread that hands each reply to its waiter."""

    def __init__(self, stub):
        self._queue = queue.Queue()
        self._lock = threading.Lock()
        self._waiters = {}
        self._ended = None
        self._ids = itertools.count(1)
        self._responses = stub.SequenceCalls(self._batches())
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name="triaxkv-sequence-calls")
        self._reader.start()

    def _batches(self):
        while True:
            call = self._queue.get()
            if call is None:
                return
            batch = manager_pb2.SequenceCallBatch()
            batch.calls.append(call)
            while True:  # everything queued meanwhile goes in this batch
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    yield batch
                    return
                batch.calls.append(more)
            yield batch

    def _read(self):
        try:
            for batch in self._responses:
                for reply in batch.replies:
                    with self._lock:
                        waiter = self._waiters.pop(reply.call_id, None)
                    if waiter is not None:
                        waiter.reply = reply
                        waiter.event.set()
            end = (grpc.StatusCode.UNAVAILABLE,
                   "the SequenceCalls stream ended before the reply")
        except grpc.RpcError as e:
            end = (e.code(), e.details() or "")
        with self._lock:
            self._ended = end
            waiters, self._waiters = self._waiters, {}
        for waiter in waiters.values():
            waiter.error = end
            waiter.event.set()

    def ended(self):
        with self._lock:
            return self._ended is not None

    def send(self, kind, request):
        """Queues the call; (call_id, waiter), or None when the stream ended."""
        with self._lock:
            if self._ended is not None:
                return None
            call_id = next(self._ids)
            waiter = _Waiter()
            self._waiters[call_id] = waiter
        call = manager_pb2.SequenceCall(call_id=call_id)
        getattr(call, kind).CopyFrom(request)
        self._queue.put(call)
        return call_id, waiter

    def forget(self, call_id):
        with self._lock:
            self._waiters.pop(call_id, None)

    def close(self):
        self._queue.put(None)
        self._responses.cancel()
        self._reader.join(5)


class SequenceCalls:
    """SequenceCalls(stub): call(kind, request, timeout) -> the response
    (kind: "open", "extend", "close", "fork", "truncate", "get",
    "report_access"); raises StreamCallError with the call's status."""

    def __init__(self, stub):
        self._stub = stub
        self._lock = threading.Lock()
        self._stream = None
        self.streams_opened = 0

    def _current(self):
        with self._lock:
            if self._stream is None or self._stream.ended():
                self._stream = _Stream(self._stub)
                self.streams_opened += 1
            return self._stream

    def call(self, kind, request, timeout):
        sent = None
        for _ in range(2):  # a stream that ended as it was picked: a new one
            stream = self._current()
            sent = stream.send(kind, request)
            if sent is not None:
                break
        if sent is None:
            raise StreamCallError(grpc.StatusCode.UNAVAILABLE,
                                  "the SequenceCalls stream ended as it opened",
                                  False)
        call_id, waiter = sent
        if not waiter.event.wait(timeout):
            stream.forget(call_id)
            if not waiter.event.is_set():
                raise StreamCallError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                      "Deadline Exceeded", False)
        if waiter.error is not None:
            raise StreamCallError(waiter.error[0], waiter.error[1], False)
        reply = waiter.reply
        if reply.code != 0:
            raise StreamCallError(_CODES.get(reply.code, grpc.StatusCode.UNKNOWN),
                                  reply.message, True)
        if reply.WhichOneof("reply") != kind:
            raise StreamCallError(grpc.StatusCode.INTERNAL,
                                  "SequenceCalls: the reply is not of the call's kind",
                                  True)
        return getattr(reply, kind)

    def close(self):
        with self._lock:
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
