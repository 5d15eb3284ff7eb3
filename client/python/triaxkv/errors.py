"""Typed errors: one exception class per gRPC status code.

Every failed RPC (and every Attend item a worker refuses) raises a subclass of
Error carrying the status code (grpc.StatusCode), the server's message
verbatim, and the client call that failed ("OpenSequence", "AllocatePages",
...). Bad arguments found before any RPC raise ValueError or TypeError naming
the argument instead.
"""

import grpc


class Error(Exception):
    """A gRPC call failed. `code` is a grpc.StatusCode, `message` the server's
    message, `call` the failing call ("OpenSequence", "Worker.ForkSequence")."""

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, message, call="", code=None):
        if code is not None:
            self.code = code
        self.message = message
        self.call = call
        prefix = f"{call}: " if call else ""
        super().__init__(f"{prefix}{self.code.name}: {message}")


class Cancelled(Error):
    code = grpc.StatusCode.CANCELLED


class Unknown(Error):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(Error):
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(Error):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(Error):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(Error):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(Error):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(Error):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(Error):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(Error):
    code = grpc.StatusCode.ABORTED


class OutOfRange(Error):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(Error):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(Error):
    code = grpc.StatusCode.INTERNAL


class Unavailable(Error):
    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(Error):
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(Error):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE = {
    cls.code: cls
    for cls in (Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound,
                AlreadyExists, PermissionDenied, ResourceExhausted,
                FailedPrecondition, Aborted, OutOfRange, Unimplemented, Internal,
                Unavailable, DataLoss, Unauthenticated)
}
_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def status_code(number):
    """The grpc.StatusCode of a google.rpc.Code number (UNKNOWN if none)."""
    return _BY_NUMBER.get(int(number), grpc.StatusCode.UNKNOWN)


def from_status(code, message, call=""):
    """The Error subclass instance for `code` (a grpc.StatusCode)."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return Error(message, call, code=code)
    return cls(message, call)


def from_rpc_error(e, call):
    """An Error for a grpc.RpcError raised by a stub call."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    return from_status(code, details or "", call)
