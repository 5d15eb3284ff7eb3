"""Python client of triaxkv: plans and budgets on kvmanager, K/V and
attention on the kvworker a sequence is placed on. See docs/python.md."""

from ._proto import manager_pb2, types_pb2, worker_pb2
from .arrays import bf16_to_float32, float32_to_bf16, round_to_bf16
from .client import (Client, EventStream, Sequence, block_encoding, budget,
                     prefix_block_hashes, rendered, span, tls_credentials)
from .errors import (Aborted, AlreadyExists, Cancelled, DataLoss, DeadlineExceeded,
                     Error, FailedPrecondition, Internal, InvalidArgument, NotFound,
                     OutOfRange, PermissionDenied, ResourceExhausted, Unauthenticated,
                     Unavailable, Unimplemented, Unknown)

ModelShape = types_pb2.ModelShape
Span = types_pb2.Span

__all__ = [
    "Client", "Sequence", "EventStream", "ModelShape", "Span", "span", "rendered",
    "block_encoding", "budget", "prefix_block_hashes", "tls_credentials", "float32_to_bf16", "bf16_to_float32", "round_to_bf16",
    "types_pb2", "manager_pb2", "worker_pb2",
    "Error", "Cancelled", "Unknown", "InvalidArgument", "DeadlineExceeded", "NotFound",
    "AlreadyExists", "PermissionDenied", "ResourceExhausted", "FailedPrecondition",
    "Aborted", "OutOfRange", "Unimplemented", "Internal", "Unavailable", "DataLoss",
    "Unauthenticated",
]
