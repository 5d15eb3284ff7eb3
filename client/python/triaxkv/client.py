"""triaxkv.Client: the Python counterpart of client/kv_client.h.

One object talks to the manager (plans, budgets, events) and to the worker a
sequence is placed on (K/V bytes, attention), at the worker address in the
manager's placement. Thread-safe: the worker-channel cache is locked and
request ids come from a locked counter; one Sequence must not be extended in
one thread while another uses it.

Every RPC has a deadline of `timeout` seconds (DeadlineExceeded past it).
Mutating calls carry a fresh request id and are retried once on UNAVAILABLE
with the same id (the servers are idempotent under it); reads are retried
once too; an Attend that appends K/V is not (it carries no request id).
Failures raise triaxkv.Error subclasses (errors.py); bad arguments found
before any RPC raise ValueError / TypeError naming the argument.

Compound calls undo their first half when the second fails, as the C++
client does: open_sequence and fork close the manager's new sequence when
the worker refuses; extend truncates the manager's plan back to the tokens
it had; close_sequence tells the manager even when the worker is gone
(UNAVAILABLE) or forgot the sequence (NOT_FOUND).
"""

import hashlib
import os
import struct
import threading
import time

import grpc

from . import arrays
from ._proto import manager_pb2, manager_pb2_grpc, types_pb2, worker_pb2, worker_pb2_grpc
from .calls import SequenceCalls, StreamCallError
from .errors import Unavailable, from_rpc_error, from_status, status_code
from .transport import _Bearer, _channel, tls_credentials  # noqa: F401 (re-exported)

# WriteKV chunks carry at most this many tokens and about this many bytes,
# under gRPC's default 4 MiB message limit (as the C++ client).
_MAX_CHUNK_TOKENS = 256
_MAX_CHUNK_BYTES = 1 << 20
_UINT32_MAX = 2**32 - 1

_FORMATS = {
    "bf16": types_pb2.FORMAT_BF16, "fp8": types_pb2.FORMAT_FP8_E4M3,
    "int8": types_pb2.FORMAT_INT8, "int4": types_pb2.FORMAT_INT4,
    "int2": types_pb2.FORMAT_INT2, "tq4": types_pb2.FORMAT_TQ4,
    "tq3": types_pb2.FORMAT_TQ3, "tq2": types_pb2.FORMAT_TQ2,
}
_TIERS = {"device": types_pb2.TIER_DEVICE, "host": types_pb2.TIER_HOST,
          "disk": types_pb2.TIER_DISK}
_TEMPLATES = {"chatml": types_pb2.CHAT_TEMPLATE_CHATML,
              "llama3": types_pb2.CHAT_TEMPLATE_LLAMA3,
              "generic": types_pb2.CHAT_TEMPLATE_GENERIC}
_SCALES = {"fp16": types_pb2.SCALE_DTYPE_FP16, "fp8": types_pb2.SCALE_DTYPE_FP8_E4M3}


def _enum(value, name, table, enum_type, prefix):
    """An enum number from a name in `table`, an enum value name
    ("ROLE_USER") or a number valid for `enum_type`."""
    if isinstance(value, str):
        key = value.lower()
        if key in table:
            return table[key]
        try:
            return enum_type.Value(value.upper() if value.upper().startswith(prefix)
                                   else prefix + value.upper())
        except ValueError:
            raise ValueError(f"{name}: unknown value {value!r}; want one of "
                             f"{sorted(table)}") from None
    if isinstance(value, int) and not isinstance(value, bool):
        if value not in enum_type.values():
            raise ValueError(f"{name}: {value} is not a {enum_type.DESCRIPTOR.name}")
        return value
    raise TypeError(f"{name}: {type(value).__name__}; want a name or an enum number")


_ROLES = {n[len("ROLE_"):].lower(): v for n, v in types_pb2.Role.items() if v}
_MODALITIES = {n[len("MODALITY_"):].lower(): v for n, v in types_pb2.Modality.items() if v}


def span(role, num_tokens, modality="text"):
    """A Span: role "system" | "tool_schema" | "user" | "assistant" |
    "reasoning" | "tool_call" | "tool_result" | "delimiter" (or a Role
    number), num_tokens >= 1 (the manager checks it)."""
    return types_pb2.Span(
        role=_enum(role, "role", _ROLES, types_pb2.Role, "ROLE_"),
        modality=_enum(modality, "modality", _MODALITIES, types_pb2.Modality, "MODALITY_"),
        num_tokens=num_tokens)


def rendered(text, chat_template, token_offsets=(), bos_tokens=0, continues=None):
    """A RenderedText the manager tags itself (docs/manager.md "Tagger"):
    text (str, UTF-8 encoded, or bytes), chat_template "chatml" | "llama3" |
    "generic", token_offsets (start byte of each token; empty: one token per
    byte), bos_tokens before the text, continues (a role name: the text
    continues an open message of that role)."""
    if isinstance(text, str):
        text = text.encode("utf-8")
    if not isinstance(text, (bytes, bytearray)):
        raise TypeError(f"text: {type(text).__name__}; want str or bytes")
    r = types_pb2.RenderedText(
        text=bytes(text),
        chat_template=_enum(chat_template, "chat_template", _TEMPLATES,
                            types_pb2.ChatTemplate, "CHAT_TEMPLATE_"),
        token_offsets=[int(o) for o in token_offsets], bos_tokens=bos_tokens)
    if continues is not None:
        r.continues = _enum(continues, "continues", _ROLES, types_pb2.Role, "ROLE_")
    return r


def block_encoding(lineage_id, format, format_v=None, group_size=0, scale_dtype=None):
    """The new encoding of one block for Client.demote: format (and format_v,
    None: same as format) "bf16" | "fp8" | "int8" | "int4" | "int2" | "tq4" |
    "tq3" | "tq2" or a Format number; group_size 0 (32), 32, 64 or 128;
    scale_dtype None (fp16), "fp16" or "fp8"."""
    e = manager_pb2.BlockEncoding(
        lineage_id=lineage_id,
        format=_enum(format, "format", _FORMATS, types_pb2.Format, "FORMAT_"),
        group_size=group_size)
    if format_v is not None:
        e.format_v = _enum(format_v, "format_v", _FORMATS, types_pb2.Format, "FORMAT_")
    if scale_dtype is not None:
        e.scale_dtype = _enum(scale_dtype, "scale_dtype", _SCALES,
                              types_pb2.ScaleDtype, "SCALE_DTYPE_")
    return e


def budget(tier, floor_bytes, ceiling_bytes):
    """A Budget of tier "device" | "host" | "disk" (or a Tier number)."""
    return types_pb2.Budget(tier=_enum(tier, "tier", _TIERS, types_pb2.Tier, "TIER_"),
                            floor_bytes=floor_bytes, ceiling_bytes=ceiling_bytes)


def prefix_block_hashes(tenant_id, model, block_tokens, token_ids,
                        prefix_salt="", block_sizes=None):
    """The manager's prefix hash chain (docs/manager.md "Prefix reuse"):
    per block, SHA-256 over the parent hash (32 zero bytes for the first
    block), the model identity "<name>/<n_layers>/<n_kv_heads>/<n_q_heads>/
    <head_dim>" and the salt ("tenant/<id>", or "shared/<prefix_salt>"),
    each u32-LE length prefixed, the block's token count and its ids as
    u32-LE. block_sizes: the blocks' token counts as the manager plans them
    (span-aligned: a span's last block may be partial); None: full blocks
    of block_tokens. Only whole blocks of token_ids are hashed, and a
    partial block only when another follows it. model: ModelShape or dict."""
    if isinstance(model, dict):
        m = model
    else:
        m = {f: getattr(model, f) for f in
             ("name", "n_layers", "n_kv_heads", "n_q_heads", "head_dim")}
    ident = (f"{m['name']}/{m['n_layers']}/{m['n_kv_heads']}/"
             f"{m['n_q_heads']}/{m['head_dim']}").encode()
    salt = (f"shared/{prefix_salt}" if prefix_salt else f"tenant/{tenant_id}").encode()
    if block_sizes is None:
        block_sizes = [block_tokens] * (len(token_ids) // block_tokens)
    out, prev, at = [], bytes(32), 0
    for i, n in enumerate(block_sizes):
        last = i + 1 == len(block_sizes)
        if at + n > len(token_ids) or (n != block_tokens and last):
            break
        h = hashlib.sha256()
        h.update(prev)
        h.update(struct.pack("<I", len(ident)) + ident)
        h.update(struct.pack("<I", len(salt)) + salt)
        h.update(struct.pack("<I", n))
        h.update(struct.pack(f"<{n}I", *token_ids[at:at + n]))
        prev = h.digest()
        out.append(prev)
        at += n
    return out


class Sequence:
    """A sequence opened through the client: its plan and where it lives
    (the C++ SequenceHandle). `blocks` are BlockPlan messages; `info` is the
    manager's SequenceInfo the handle was last filled from."""

    def __init__(self, info, window_tokens=None):
        self.window_tokens = window_tokens
        self._fill(info)

    def _fill(self, info):
        self.info = info
        self.sequence_id = info.sequence_id
        self.worker_id = info.worker_id
        self.worker_address = info.worker_address
        self.model = info.model
        self.block_tokens = info.block_tokens
        self.blocks = list(info.blocks)
        self.num_tokens = info.num_tokens
        self.policy = info.policy
        # Prefix reuse: tokens [0, prefix_tokens) were shared at open with
        # prefix_sequence_id (their KV is there: prefill from prefix_tokens).
        self.prefix_sequence_id = info.prefix_sequence_id
        self.prefix_tokens = info.prefix_tokens
        # With --auth=token: the manager's capabilities for this sequence's
        # worker calls, renewed with every refresh of the handle.
        self.capabilities = list(info.capabilities)

    def __repr__(self):
        return (f"Sequence({self.sequence_id!r}, worker={self.worker_id!r}, "
                f"tokens={self.num_tokens}, blocks={len(self.blocks)})")


class EventStream:
    """Manager events as an iterator of Event messages, ending when the
    server finishes the stream (max_events, replay_only) or after cancel().
    Past its deadline the next read raises DeadlineExceeded. Use as a
    context manager to cancel on exit."""

    def __init__(self, call):
        self._call = call
        self._cancelled = False

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._call)
        except grpc.RpcError as e:
            if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            raise from_rpc_error(e, "WatchEvents") from None

    def cancel(self):
        self._cancelled = True
        self._call.cancel()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cancel()
        return False


_CAPABILITY_KEY = "x-triax-capability-bin"


def _caps(*infos):
    """The capabilities of SequenceInfos / Sequences as call metadata
    (docs/security.md "Capabilities"); empty without --auth=token."""
    md = []
    for info in infos:
        caps = info.capabilities if hasattr(info, "capabilities") else ()
        md.extend((_CAPABILITY_KEY, c.SerializeToString()) for c in caps)
    return tuple(md)


class Client:
    """Client(manager_address, tenant_id="", timeout=30.0, attend_retries=50,
    tls_ca=None, tls_cert=None, tls_key=None, tls_worker_server_name=None,
    token=None).

    manager_address: "host:port". tenant_id: the tenant sequences are opened
    for (created with create_tenant, or by an operator). timeout: the
    deadline of every RPC in seconds. attend_retries: how often an Attend
    answered UNAVAILABLE with retry_after_ms (spilled blocks being restored)
    is sent again, never past `timeout` from the first attempt.
    tls_ca: path of the PEM CA certificates that verify the manager and the
    workers: TLS on every channel (None: plaintext); tls_cert / tls_key: the
    client certificate and its key, for servers that require one
    (tls_credentials); tls_worker_server_name: the name workers'
    certificates are verified against instead of their address (workers
    that advertise pod IPs; kvworker --tls_worker_server_name).
    token: the bearer token of a manager with --auth=token (a str; issued
    by an admin with kvctl token-issue), sent with every manager call;
    None: none.
    worker_sockets: workers on this host to reach on their --local_listen
    sockets, {worker address as the manager gives it: "unix:/PATH"} (no
    TCP, no TLS to them; docs/security.md "Local socket"). manager_address
    may be a "unix:/PATH" too.
    manager_stream: send the sequence calls (open, extend, fork, close,
    truncate, get_sequence, report_access) on one Manager.SequenceCalls
    stream shared by this client's threads instead of one unary RPC each
    (triaxkv/calls.py; docs/manager.md "Call streams"): same answers,
    deadlines and retries; a manager without the stream (Unimplemented)
    gets unary calls from then on.
    Channels connect lazily: an unreachable manager surfaces as Unavailable
    (or DeadlineExceeded) on the first call that needs it."""

    def __init__(self, manager_address, tenant_id="", timeout=30.0, attend_retries=50,
                 tls_ca=None, tls_cert=None, tls_key=None, tls_worker_server_name=None,
                 token=None, worker_sockets=None, manager_stream=False):
        if not isinstance(manager_address, str) or not manager_address:
            raise ValueError(f"manager_address: {manager_address!r}; want host:port")
        if not isinstance(tenant_id, str):
            raise TypeError(f"tenant_id: {type(tenant_id).__name__}; want str")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout: {timeout!r}; want seconds > 0")
        if not (isinstance(attend_retries, int) and attend_retries >= 0):
            raise ValueError(f"attend_retries: {attend_retries!r}; want an int >= 0")
        self.manager_address = manager_address
        self.tenant_id = tenant_id
        self.timeout = float(timeout)
        self.attend_retries = attend_retries
        if tls_ca is None and (tls_cert or tls_key):
            raise ValueError(f"tls_cert={tls_cert!r}: a client certificate needs tls_ca")
        if token is not None and (not isinstance(token, str) or not token.strip()):
            raise ValueError("token: want a non-empty str (kvctl token-issue prints one)")
        self._credentials = (tls_credentials(tls_ca, tls_cert, tls_key)
                             if tls_ca is not None else None)
        self._worker_server_name = tls_worker_server_name
        worker_sockets = dict(worker_sockets or {})
        for address, socket in worker_sockets.items():
            if not isinstance(address, str) or not address:
                raise ValueError(f"worker_sockets: key {address!r}; want a worker address")
            if not isinstance(socket, str) or not socket.startswith("unix:/"):
                raise ValueError(f"worker_sockets[{address!r}]: {socket!r}; want 'unix:/PATH'")
        self._worker_sockets = worker_sockets
        self._manager_channel = _channel(manager_address, self._credentials)
        channel = self._manager_channel
        if token is not None:
            channel = grpc.intercept_channel(channel, _Bearer(token.strip()))
        self.manager = manager_pb2_grpc.ManagerStub(channel)
        self._sequence_calls = SequenceCalls(self.manager) if manager_stream else None
        self._lock = threading.Lock()
        self._workers = {}  # address -> (channel, stub)
        self._request_prefix = "p" + os.urandom(8).hex()
        self._next_request = 0

    # -- plumbing ------------------------------------------------------------

    def close(self):
        """Closes every channel; the client is unusable afterwards."""
        if self._sequence_calls is not None:
            self._sequence_calls.close()
        with self._lock:
            workers, self._workers = self._workers, {}
        for channel, _ in workers.values():
            channel.close()
        self._manager_channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def new_request_id(self):
        """A fresh request id, unique across clients: "p<16 hex>-<counter>"."""
        with self._lock:
            self._next_request += 1
            return f"{self._request_prefix}-{self._next_request}"

    def worker(self, address):
        """The Worker stub for `address` (cached). FailedPrecondition for ""."""
        if not address:
            raise from_status(grpc.StatusCode.FAILED_PRECONDITION,
                              "the sequence has no worker address", "worker")
        with self._lock:
            entry = self._workers.get(address)
            if entry is None:
                channel = _channel(self._worker_sockets.get(address, address),
                                   self._credentials, self._worker_server_name)
                entry = (channel, worker_pb2_grpc.WorkerStub(channel))
                self._workers[address] = entry
            return entry[1]

    def _call(self, what, method, request, retry, timeout=None):
        """method(request) with a deadline; once more on UNAVAILABLE when
        `retry` is set. Raises the typed Error named after `what`."""
        timeout = self.timeout if timeout is None else timeout
        for attempt in range(2 if retry else 1):
            try:
                return method(request, timeout=timeout)
            except grpc.RpcError as e:
                if retry and attempt == 0 and e.code() == grpc.StatusCode.UNAVAILABLE:
                    continue
                raise from_rpc_error(e, what) from None
        raise AssertionError("unreachable")

    def _manager_call(self, kind, unary):
        """The manager's sequence call `kind` as method(request, timeout):
        on the SequenceCalls stream with manager_stream, else `unary`."""
        calls = self._sequence_calls
        if calls is None:
            return unary

        def call(request, timeout):
            try:
                return calls.call(kind, request, timeout)
            except StreamCallError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED or e.answered:
                    raise
            self._sequence_calls = None  # a manager without the stream
            calls.close()
            return unary(request, timeout=timeout)
        return call

    def _tenant(self, tenant_id):
        return self.tenant_id if tenant_id is None else tenant_id

    # -- tenants and workers -------------------------------------------------

    def create_tenant(self, tenant_id=None, budgets=(), default_policy="",
                      prefix_salt=""):
        """Creates a tenant (this client's when tenant_id is None) with
        `budgets` (see budget(); tiers without one are unlimited). Returns
        TenantInfo. Idempotent for the same settings; AlreadyExists for a
        tenant with other ones. prefix_salt: a shared salt for prefix reuse
        (tenants with the same one reuse each other's prefixes); "" keeps
        the tenant's prefixes private."""
        req = manager_pb2.CreateTenantRequest(
            request_id=self.new_request_id(), tenant_id=self._tenant(tenant_id),
            budgets=list(budgets), default_policy=default_policy,
            prefix_salt=prefix_salt)
        return self._call("CreateTenant", self.manager.CreateTenant, req, True).tenant

    def set_budget(self, tier, floor_bytes, ceiling_bytes, tenant_id=None):
        """Sets one tier's budget of a tenant; returns TenantInfo."""
        req = manager_pb2.SetBudgetRequest(
            request_id=self.new_request_id(), tenant_id=self._tenant(tenant_id),
            budget=budget(tier, floor_bytes, ceiling_bytes))
        return self._call("SetBudget", self.manager.SetBudget, req, True).tenant

    def _all_pages(self, what, method, request, field):
        """Every item of a paged List RPC (docs/manager.md "Paging"):
        follows next_page_token until the last page; each page is a call of
        its own (deadline, one retry on UNAVAILABLE)."""
        items = []
        while True:
            resp = self._call(what, method, request, True)
            items.extend(getattr(resp, field))
            if not resp.next_page_token:
                return items
            if resp.next_page_token == request.page_token:
                raise from_status(
                    grpc.StatusCode.INTERNAL,
                    "the manager answered page_token %r with the same "
                    "next_page_token" % request.page_token, what)
            request.page_token = resp.next_page_token

    def list_tenants(self, page_size=0):
        """Every tenant, by id (pages of page_size; 0: the manager's
        default)."""
        req = manager_pb2.ListTenantsRequest(page_size=page_size)
        return self._all_pages("ListTenants", self.manager.ListTenants, req,
                               "tenants")

    def list_workers(self, page_size=0):
        """Every worker, by id (pages of page_size; 0: the manager's
        default)."""
        req = manager_pb2.ListWorkersRequest(page_size=page_size)
        return self._all_pages("ListWorkers", self.manager.ListWorkers, req,
                               "workers")

    # -- sequences -----------------------------------------------------------

    @staticmethod
    def _model(model):
        if isinstance(model, types_pb2.ModelShape):
            return model
        if isinstance(model, dict):
            return types_pb2.ModelShape(**model)
        raise TypeError(f"model: {type(model).__name__}; want triaxkv.ModelShape or a dict")

    @staticmethod
    def _spans(spans):
        out = []
        for i, s in enumerate(spans):
            if isinstance(s, types_pb2.Span):
                out.append(s)
            elif isinstance(s, tuple) and len(s) in (2, 3):
                out.append(span(*s))
            else:
                raise TypeError(f"spans[{i}]: {s!r}; want triaxkv.Span or "
                                "(role, num_tokens[, modality])")
        return out

    @classmethod
    def _prompt(cls, req, spans, rendered_text):
        if (spans is None) == (rendered_text is None):
            raise ValueError("spans / rendered: give exactly one of them")
        if spans is not None:
            req.spans.extend(cls._spans(spans))
        else:
            if not isinstance(rendered_text, types_pb2.RenderedText):
                raise TypeError(f"rendered: {type(rendered_text).__name__}; want "
                                "triaxkv.rendered(...)")
            req.rendered.CopyFrom(rendered_text)

    def _allocate_on_worker(self, info, window_tokens):
        req = worker_pb2.AllocatePagesRequest(
            request_id=self.new_request_id(), tenant_id=self.tenant_id,
            sequence_id=info.sequence_id, model=info.model,
            block_tokens=info.block_tokens, blocks=list(info.blocks))
        if window_tokens is not None:
            req.window_tokens = window_tokens
        w = self.worker(info.worker_address)
        md = _caps(info)
        self._call("AllocatePages",
                   lambda r, timeout: w.AllocatePages(r, timeout=timeout, metadata=md),
                   req, True)

    def _close_on_manager_quietly(self, sequence_id):
        req = manager_pb2.CloseSequenceRequest(
            request_id=self.new_request_id(), tenant_id=self.tenant_id,
            sequence_id=sequence_id)
        try:
            self._call("CloseSequence",
                       self._manager_call("close", self.manager.CloseSequence), req, True)
        except Exception:  # best effort: the caller raises the first error
            pass

    def open_sequence(self, model, spans=None, *, rendered=None, policy="",
                      block_tokens=0, window_tokens=None, worker_id="",
                      token_ids=None, block_hashes=None, no_reuse=False):
        """Manager OpenSequence, then AllocatePages on the placed worker.

        model: ModelShape (or a dict of its fields). Exactly one of spans (a
        list of Span or (role, num_tokens[, modality]) tuples) and rendered
        (triaxkv.rendered(...): the manager tags the text). policy: a policy
        name ("" the tenant's default); block_tokens 0: the manager's
        default; window_tokens: the BF16 recent window on the worker (None:
        the worker's --window_tokens); worker_id: open there instead of the
        placement's choice. Returns a Sequence.

        Prefix reuse (docs/python.md): token_ids (one per prompt token)
        and/or block_hashes (32-byte hashes of the leading full blocks, see
        prefix_block_hashes) let the manager share the longest cached prefix
        of the tenant's open sequences; the worker's pages of it are then
        forked instead of allocated and seq.prefix_tokens says where the
        prefill starts. When the worker refuses the fork (the prefix not
        written yet), the sequence is opened again with no_reuse."""
        if window_tokens is not None and not (
                isinstance(window_tokens, int) and 0 <= window_tokens <= _UINT32_MAX):
            raise ValueError(f"window_tokens: {window_tokens!r}; want None or 0..2^32-1")
        req = manager_pb2.OpenSequenceRequest(
            request_id=self.new_request_id(), tenant_id=self.tenant_id,
            model=self._model(model), block_tokens=block_tokens, policy=policy,
            worker_id=worker_id)
        self._prompt(req, spans, rendered)
        if window_tokens is not None:
            req.window_tokens = window_tokens
        if token_ids:
            req.token_ids.extend(token_ids)
        if block_hashes:
            req.block_hashes.extend(block_hashes)
        req.no_reuse = no_reuse
        info = self._call("OpenSequence",
                          self._manager_call("open", self.manager.OpenSequence), req, True).sequence
        if info.prefix_blocks > 0:
            wreq = worker_pb2.WorkerForkRequest(
                request_id=self.new_request_id(), tenant_id=self.tenant_id,
                parent_sequence_id=info.prefix_sequence_id,
                parent_tenant_id=(info.prefix_tenant_id
                                  if info.prefix_tenant_id != self.tenant_id else ""),
                child_sequence_id=info.sequence_id,
                num_tokens=info.prefix_tokens, blocks=list(info.blocks))
            try:
                w = self.worker(info.worker_address)
                md = _caps(info)
                self._call("Worker.ForkSequence",
                           lambda r, timeout: w.ForkSequence(r, timeout=timeout,
                                                             metadata=md),
                           wreq, True)
            except Exception:
                # The manager's view of the prefix can be ahead of the
                # worker's: open again without reuse.
                self._close_on_manager_quietly(info.sequence_id)
                return self.open_sequence(
                    model, spans, rendered=rendered, policy=policy,
                    block_tokens=block_tokens, window_tokens=window_tokens,
                    worker_id=worker_id, token_ids=token_ids,
                    block_hashes=block_hashes, no_reuse=True)
            return Sequence(info, window_tokens)
        try:
            self._allocate_on_worker(info, window_tokens)
        except Exception:
            # Undo the plan so the tenant is not charged for pages that do not exist.
            self._close_on_manager_quietly(info.sequence_id)
            raise
        return Sequence(info, window_tokens)

    def extend(self, seq, spans=None, *, rendered=None, new_turn=False,
               continue_last_span=False, token_ids=None):
        """Plans more tokens (a new turn, or decoded tokens) and allocates
        them on the worker; seq is updated only when both succeed. When the
        worker refuses, the manager's plan is truncated back to seq's tokens
        and the worker's error raised (the call can be retried)."""
        req = manager_pb2.ExtendSequenceRequest(
            request_id=self.new_request_id(), tenant_id=self.tenant_id,
            sequence_id=seq.sequence_id, new_turn=new_turn,
            continue_last_span=continue_last_span)
        if token_ids:  # grow the sequence's prefix hash chain
            req.token_ids.extend(token_ids)
        self._prompt(req, spans, rendered)
        info = self._call("ExtendSequence",
                          self._manager_call("extend", self.manager.ExtendSequence),
                          req, True).sequence
        try:
            self._allocate_on_worker(info, seq.window_tokens)
        except Exception as alloc_error:
            # The worker allocates all or nothing: take the manager's plan
            # back to what the worker holds.
            treq = manager_pb2.TruncateSequenceRequest(
                request_id=self.new_request_id(), tenant_id=self.tenant_id,
                sequence_id=seq.sequence_id, num_tokens=seq.num_tokens)
            try:
                self._call("TruncateSequence",
                           self._manager_call("truncate", self.manager.TruncateSequence),
                           treq, True)
            except Exception as undo:
                alloc_error.args = (f"{alloc_error}; undoing the manager's extend of "
                                    f"{seq.sequence_id!r} failed too ({undo}): close "
                                    "the sequence",)
            raise
        seq._fill(info)

    def fork(self, parent, num_tokens=0):
        """Manager ForkSequence, then the worker's ForkSequence on the
        parent's worker: the child keeps the parent's first num_tokens
        tokens (0: all), sharing whole blocks. Returns the child Sequence."""
        req = manager_pb2.ForkSequenceRequest(
            request_id=self.new_request_id(), tenant_id=self.tenant_id,
            parent_sequence_id=parent.sequence_id, num_tokens=num_tokens)
        child = self._call("ForkSequence",
                           self._manager_call("fork", self.manager.ForkSequence),
                           req, True).sequence
        try:
            if child.worker_address and child.worker_address != parent.worker_address:
                raise from_status(
                    grpc.StatusCode.INTERNAL,
                    f"manager placed child {child.sequence_id!r} on "
                    f"{child.worker_address!r} but the parent lives on "
                    f"{parent.worker_address!r}", "ForkSequence")
            wreq = worker_pb2.WorkerForkRequest(
                request_id=self.new_request_id(), tenant_id=self.tenant_id,
                parent_sequence_id=parent.sequence_id,
                child_sequence_id=child.sequence_id, num_tokens=child.num_tokens,
                blocks=list(child.blocks))
            w = self.worker(parent.worker_address)
            md = _caps(child, parent)
            self._call("Worker.ForkSequence",
                       lambda r, timeout: w.ForkSequence(r, timeout=timeout, metadata=md),
                       wreq, True)
        except Exception:
            self._close_on_manager_quietly(child.sequence_id)
            raise
        h = Sequence(child, parent.window_tokens)
        if not h.worker_address:
            h.worker_address = parent.worker_address
        return h

    def close_sequence(self, seq):
        """Worker FreePages, then manager CloseSequence (also when the worker
        is gone or forgot the sequence). Returns the freed lineage ids."""
        try:
            w = self.worker(seq.worker_address)
            freq = worker_pb2.FreePagesRequest(
                request_id=self.new_request_id(), tenant_id=self.tenant_id,
                sequence_id=seq.sequence_id)
            md = _caps(seq)
            self._call("FreePages",
                       lambda r, timeout: w.FreePages(r, timeout=timeout, metadata=md),
                       freq, True)
        except Exception as e:
            gone = getattr(e, "code", None) in (grpc.StatusCode.UNAVAILABLE,
                                                grpc.StatusCode.NOT_FOUND)
            if not gone:
                raise
        req = manager_pb2.CloseSequenceRequest(
            request_id=self.new_request_id(), tenant_id=self.tenant_id,
            sequence_id=seq.sequence_id)
        resp = self._call("CloseSequence",
                          self._manager_call("close", self.manager.CloseSequence), req, True)
        return list(resp.freed_lineage_ids)

    def get_sequence(self, sequence_id):
        """The manager's SequenceInfo of a sequence of this tenant."""
        req = manager_pb2.GetSequenceRequest(tenant_id=self.tenant_id,
                                             sequence_id=sequence_id)
        return self._call("GetSequence",
                          self._manager_call("get", self.manager.GetSequence), req, True).sequence

    def list_sequences(self, include_closed=False, page_size=0):
        """This tenant's sequences (every tenant's when tenant_id is ""),
        without blocks, in creation order; follows the manager's pages of
        page_size (0: its default)."""
        req = manager_pb2.ListSequencesRequest(tenant_id=self.tenant_id,
                                               include_closed=include_closed,
                                               page_size=page_size)
        return self._all_pages("ListSequences", self.manager.ListSequences,
                               req, "sequences")

    def refresh_plan(self, seq):
        """Replaces seq's plan with the manager's current one (the manager
        demotes, spills and evicts on its own under memory pressure)."""
        seq._fill(self.get_sequence(seq.sequence_id))

    def demote(self, seq, encodings):
        """Re-encodes blocks of seq in place through the manager (entries
        from block_encoding()); refreshes seq's plan. Returns the change of
        the tenant's device bytes (negative: freed)."""
        encodings = list(encodings)
        for i, e in enumerate(encodings):
            if not isinstance(e, manager_pb2.BlockEncoding):
                raise TypeError(f"encodings[{i}]: {type(e).__name__}; want "
                                "triaxkv.block_encoding(...)")
        req = manager_pb2.DemoteBlocksRequest(
            request_id=self.new_request_id(), tenant_id=self.tenant_id,
            sequence_id=seq.sequence_id, blocks=encodings)
        resp = self._call("DemoteBlocks", self.manager.DemoteBlocks, req, True)
        seq._fill(resp.sequence)
        return resp.bytes_delta

    def transfer_sequence(self, seq, destination_worker_id="", destination_policy="",
                          timeout_ms=0, follow_writes=False, first_block=0,
                          destination_prefix_sequence_id=""):
        """Moves a sequence (a Sequence or a sequence id) to another worker
        through the manager (docs/manager.md "Transfers"). The deadline is
        the transfer's bound (timeout_ms, 10000 when 0) plus 5 s, at least
        the client's timeout. Returns TransferSequenceResponse; a Sequence
        passed in takes the destination's plan and worker address."""
        handle = seq if isinstance(seq, Sequence) else None
        sequence_id = seq.sequence_id if handle else seq
        if not isinstance(sequence_id, str):
            raise TypeError(f"seq: {type(seq).__name__}; want a Sequence or a sequence id")
        req = manager_pb2.TransferSequenceRequest(
            request_id=self.new_request_id(), tenant_id=self.tenant_id,
            sequence_id=sequence_id, destination_worker_id=destination_worker_id,
            destination_policy=destination_policy, timeout_ms=timeout_ms,
            follow_writes=follow_writes, first_block=first_block,
            destination_prefix_sequence_id=destination_prefix_sequence_id)
        deadline = max((timeout_ms or 10000) / 1000.0 + 5.0, self.timeout)
        resp = self._call("TransferSequence", self.manager.TransferSequence, req, True,
                          timeout=deadline)
        if handle is not None:
            handle._fill(resp.sequence)
        return resp

    # -- K/V and attention ---------------------------------------------------

    def write_kv(self, seq, layer, first_token, k, v):
        """Writes K/V of tokens [first_token, first_token + n) of `layer`.
        k, v: [n, n_kv_heads, head_dim], float32 (rounded to BF16) or uint16
        BF16 bits (numpy, or torch float32 / bfloat16). Tokens are written in
        order per layer. Returns the tokens written."""
        m = seq.model
        kb, n = arrays.kv_to_bf16_bytes(k, "k", m.n_kv_heads, m.head_dim)
        vb, nv = arrays.kv_to_bf16_bytes(v, "v", m.n_kv_heads, m.head_dim)
        if nv != n:
            raise ValueError(f"v: {nv} tokens; k has {n}")
        token_bytes = m.n_kv_heads * m.head_dim * 2
        chunk = max(1, min(_MAX_CHUNK_BYTES // (2 * token_bytes), _MAX_CHUNK_TOKENS))
        msgs = []
        for done in range(0, n, chunk):
            cnt = min(chunk, n - done)
            lo, hi = done * token_bytes, (done + cnt) * token_bytes
            msgs.append(worker_pb2.WriteKVRequest(
                tenant_id=self.tenant_id, sequence_id=seq.sequence_id,
                chunk=worker_pb2.KvChunk(layer=layer, first_token=first_token + done,
                                         num_tokens=cnt, dtype=worker_pb2.KV_DTYPE_BF16,
                                         k=kb[lo:hi], v=vb[lo:hi])))
        msgs[0].request_id = self.new_request_id()
        w = self.worker(seq.worker_address)
        md = _caps(seq)
        resp = self._call("WriteKV",
                          lambda it, timeout: w.WriteKV(iter(it), timeout=timeout,
                                                        metadata=md),
                          msgs, True)
        return resp.tokens_written

    def read_kv(self, seq, layer, first_token=0, num_tokens=0, *, dtype="float32",
                output="numpy"):
        """Reads back K/V of tokens [first_token, first_token + num_tokens)
        of `layer` (num_tokens 0: to the end of what is written) as (k, v),
        each [n, n_kv_heads, head_dim]: dtype "float32" (dequantized) or
        "bfloat16" (uint16 BF16 bits; torch.bfloat16 with output="torch")."""
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype: {dtype!r}; want 'float32' or 'bfloat16'")
        if output not in ("numpy", "torch"):
            raise ValueError(f"output: {output!r}; want 'numpy' or 'torch'")
        wire = worker_pb2.KV_DTYPE_F32 if dtype == "float32" else worker_pb2.KV_DTYPE_BF16
        np_dtype = "<f4" if dtype == "float32" else "<u2"
        req = worker_pb2.ReadKVRequest(
            tenant_id=self.tenant_id, sequence_id=seq.sequence_id, layer=layer,
            first_token=first_token, num_tokens=num_tokens, dtype=wire)
        w = self.worker(seq.worker_address)

        def read(request, timeout):
            ks, vs, nxt = [], [], first_token
            for c in w.ReadKV(request, timeout=timeout, metadata=_caps(seq)):
                if c.first_token != nxt or c.dtype != wire:
                    raise from_status(grpc.StatusCode.INTERNAL,
                                      f"chunk at token {c.first_token} dtype {c.dtype}; "
                                      f"want token {nxt} dtype {wire}", "ReadKV")
                nxt += c.num_tokens
                ks.append(c.k)
                vs.append(c.v)
            return b"".join(ks), b"".join(vs), nxt - first_token

        kb, vb, n = self._call("ReadKV", read, req, True)
        import numpy as np

        shape = (n, seq.model.n_kv_heads, seq.model.head_dim)
        want = n * seq.model.n_kv_heads * seq.model.head_dim * np.dtype(np_dtype).itemsize
        if len(kb) != want or len(vb) != want or (num_tokens and n != num_tokens):
            raise from_status(grpc.StatusCode.INTERNAL,
                              f"got {n} tokens in {len(kb)} K and {len(vb)} V bytes; "
                              f"want {num_tokens or n} tokens of {want} bytes", "ReadKV")
        k = np.frombuffer(kb, dtype=np_dtype).reshape(shape).astype(np_dtype[1:])
        v = np.frombuffer(vb, dtype=np_dtype).reshape(shape).astype(np_dtype[1:])
        torch_out = output == "torch"
        return arrays.to_output(k, torch_out), arrays.to_output(v, torch_out)

    def attend(self, seq, layer, q, positions=None, *, append_k=None, append_v=None,
               append_first=None, scale=0.0):
        """Decode attention for the queries q [num_queries, n_q_heads,
        head_dim] float32 of `layer`; query i attends to tokens [0,
        positions[i]] (None: all written tokens). With append_k / append_v
        ([n, n_kv_heads, head_dim], as write_kv) tokens [append_first,
        append_first + n) are written first in the same RPC. scale 0:
        1/sqrt(head_dim). Returns out [num_queries, n_q_heads, head_dim]
        float32 (a torch tensor when q is one). Spilled blocks: waits
        retry_after_ms and resends (see Client)."""
        return self.attend_batch([dict(
            seq=seq, layer=layer, q=q, positions=positions, append_k=append_k,
            append_v=append_v, append_first=append_first, scale=scale)])[0]

    @staticmethod
    def _attend_item(i, seq, layer, q, positions=None, append_k=None, append_v=None,
                     append_first=None, scale=0.0):
        """(AttendItem, num_queries, appends, torch_out) of attend_batch's
        item i; argument errors name the item when there are several."""
        if getattr(seq, "model", None) is None:
            raise TypeError(f"{i}seq: {type(seq).__name__}; want a triaxkv.Sequence")
        m = seq.model
        torch_out = arrays.is_torch(q)
        qb, nq = arrays.queries_to_bytes(q, f"{i}q", m.n_q_heads, m.head_dim)
        item = worker_pb2.AttendItem(sequence_id=seq.sequence_id, layer=layer,
                                     num_queries=nq, queries=qb, scale=scale)
        if positions is not None:
            item.positions.extend(arrays.positions_list(positions, f"{i}positions", nq))
        append = append_k is not None or append_v is not None
        if append:
            if append_k is None or append_v is None:
                raise ValueError(f"{i}append_k / append_v: give both or neither")
            if not (isinstance(append_first, int) and append_first >= 0):
                raise ValueError(f"{i}append_first: {append_first!r}; want the first "
                                 "appended token's position (int >= 0)")
            kb, n = arrays.kv_to_bf16_bytes(append_k, f"{i}append_k", m.n_kv_heads,
                                            m.head_dim)
            vb, nv = arrays.kv_to_bf16_bytes(append_v, f"{i}append_v", m.n_kv_heads,
                                             m.head_dim)
            if nv != n:
                raise ValueError(f"{i}append_v: {nv} tokens; append_k has {n}")
            item.append.CopyFrom(worker_pb2.KvChunk(
                layer=layer, first_token=append_first, num_tokens=n,
                dtype=worker_pb2.KV_DTYPE_BF16, k=kb, v=vb))
        elif append_first is not None:
            raise ValueError(f"{i}append_first: given without append_k / append_v")
        return item, nq, append, torch_out

    def attend_batch(self, items):
        """Attention for several items in one Attend RPC, which the worker
        runs as one batch (docs/worker.md "Attend"). items: dicts with the
        keys of attend()'s arguments (seq, layer, q, positions, append_k,
        append_v, append_first, scale); every item's sequence must live on
        the same worker. Returns the outputs in item order. Items answered
        UNAVAILABLE with retry_after_ms (spilled blocks) are resent alone
        after that delay, as attend() does; the first failing item raises
        its Error, whose message starts with "item <i>: " when there are
        several."""
        items = list(items)
        if not items:
            raise ValueError("items: empty; want at least one attend item")
        built = []
        for i, it in enumerate(items):
            if not isinstance(it, dict):
                raise TypeError(f"items[{i}]: {type(it).__name__}; want a dict of "
                                "attend() arguments")
            unknown = set(it) - {"seq", "layer", "q", "positions", "append_k",
                                 "append_v", "append_first", "scale"}
            if unknown or "seq" not in it or "layer" not in it or "q" not in it:
                raise ValueError(f"items[{i}]: keys {sorted(it)}; want seq, layer, q "
                                 "and optionally positions, append_k, append_v, "
                                 "append_first, scale")
            built.append(self._attend_item("" if len(items) == 1 else f"items[{i}].",
                                           **it))
        address = items[0]["seq"].worker_address
        for i, it in enumerate(items):
            if it["seq"].worker_address != address:
                raise ValueError(f"items[{i}].seq: on worker {it['seq'].worker_address!r}; "
                                 f"items[0] is on {address!r} (one Attend RPC per worker)")
        w = self.worker(address)
        prefix = (lambda i: f"item {i}: ") if len(items) > 1 else (lambda i: "")
        results = [None] * len(items)
        pending = list(range(len(items)))
        start = time.monotonic()
        give_up = start + self.timeout
        retries = 0
        while pending:
            req = worker_pb2.AttendRequest(tenant_id=self.tenant_id,
                                           items=[built[i][0] for i in pending])
            # A transport-level retry of an appending Attend could land after
            # the first attempt's write, so only read-only ones are retried.
            appends = any(built[i][2] for i in pending)
            md = _caps(*[items[i]["seq"] for i in pending])
            resp = self._call("Attend",
                              lambda r, timeout: w.Attend(r, timeout=timeout, metadata=md),
                              req, not appends)
            if len(resp.results) != len(pending):
                raise from_status(grpc.StatusCode.INTERNAL,
                                  f"worker returned {len(resp.results)} results for "
                                  f"{len(pending)} items", "Attend")
            again, wait, why = [], 0.0, ""
            for i, r in zip(pending, resp.results):
                code = status_code(r.status.code)
                if code == grpc.StatusCode.UNAVAILABLE and r.retry_after_ms:
                    # Spilled blocks are being restored (nothing was written).
                    again.append(i)
                    wait = max(wait, r.retry_after_ms / 1000.0)
                    why = f"{prefix(i)}{r.status.message} (retry after {r.retry_after_ms} ms"
                elif code != grpc.StatusCode.OK:
                    raise from_status(code, prefix(i) + r.status.message, "Attend")
                else:
                    results[i] = r
            if again and (retries >= self.attend_retries
                          or time.monotonic() + wait > give_up):
                raise Unavailable(
                    f"{why}; gave up after {retries} retries in "
                    f"{int((time.monotonic() - start) * 1000)} ms)", "Attend")
            if again:
                time.sleep(wait)
                retries += 1
            pending = again
        import numpy as np

        outs = []
        for i, r in enumerate(results):
            m = items[i]["seq"].model
            nq, torch_out = built[i][1], built[i][3]
            want = nq * m.n_q_heads * m.head_dim * 4
            if len(r.output) != want:
                raise from_status(grpc.StatusCode.INTERNAL,
                                  f"{prefix(i)}output has {len(r.output)} bytes; want "
                                  f"{want}", "Attend")
            out = np.frombuffer(r.output, dtype="<f4").reshape(nq, m.n_q_heads, m.head_dim)
            outs.append(arrays.to_output(out.astype(np.float32), torch_out))
        return outs

    # -- events and pressure -------------------------------------------------

    def watch_events(self, from_id=0, *, sequence_id="", lineage_id=0, tenant_id=None,
                     max_events=0, replay_only=False, timeout=None):
        """Manager events as an EventStream (an iterator of Event). from_id:
        replay retained events with id >= from_id first (0: live only);
        filters: sequence_id, lineage_id, tenant_id (None: this client's
        tenant; "": all); max_events: end after that many (0: until
        cancelled); replay_only: end once the retained ones are sent.
        timeout: the stream's deadline in seconds (None: the client's)."""
        req = manager_pb2.WatchEventsRequest(
            from_id=from_id, tenant_id=self._tenant(tenant_id), sequence_id=sequence_id,
            lineage_id=lineage_id, max_events=max_events, replay_only=replay_only)
        t = self.timeout if timeout is None else timeout
        if not (isinstance(t, (int, float)) and t > 0):
            raise ValueError(f"timeout: {timeout!r}; want seconds > 0")
        return EventStream(self.manager.WatchEvents(req, timeout=t))

    def report_access(self, seq, lineage_ids=(), weights=(), active=False):
        """Manager ReportAccess (memory pressure): the blocks were attended
        together (weights: empty, or one share in [0, 1] per id); active:
        the sequence is about to be used (prefetch its spilled blocks).
        Returns the restores started. Not retried (it has no request id)."""
        lineage_ids, weights = list(lineage_ids), list(weights)
        if weights and len(weights) != len(lineage_ids):
            raise ValueError(f"weights: {len(weights)} entries; want 0 or "
                             f"len(lineage_ids) = {len(lineage_ids)}")
        req = manager_pb2.ReportAccessRequest(
            tenant_id=self.tenant_id, sequence_id=seq.sequence_id,
            lineage_ids=lineage_ids, weights=weights, active=active)
        return self._call("ReportAccess",
                          self._manager_call("report_access", self.manager.ReportAccess), req,
                          False).blocks_prefetching

    def get_pressure(self, top=0):
        """The manager's pressure view (GetPressureResponse)."""
        req = manager_pb2.GetPressureRequest(top=top)
        return self._call("GetPressure", self.manager.GetPressure, req, True)
