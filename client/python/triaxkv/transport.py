"""Channels of the Python client: plaintext, TLS (tls_credentials) or a
local Unix-domain socket (an address "unix:/PATH"), and
the interceptor that adds a bearer token to every call (docs/security.md)."""

import grpc

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
]


def _channel(address, credentials=None, server_name=None):
    if address.startswith("unix:"):
        # A daemon's --local_listen socket: gRPC local credentials, whatever
        # the TLS settings of TCP addresses (docs/security.md "Local socket").
        return grpc.secure_channel(
            address, grpc.local_channel_credentials(grpc.LocalConnectionType.UDS),
            options=_CHANNEL_OPTIONS)
    if credentials is None:
        return grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
    options = list(_CHANNEL_OPTIONS)
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.secure_channel(address, credentials, options=options)


def _read_pem(name, path):
    """The bytes of PEM file `path` given as argument `name`; ValueError
    naming both when it cannot be read or holds no PEM block."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{name}={path!r}: cannot read the file: {e.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{name}={path!r}: holds no PEM block")
    return data


def tls_credentials(tls_ca, tls_cert=None, tls_key=None):
    """grpc.ChannelCredentials verifying servers with the CA certificates in
    file `tls_ca`, presenting the client certificate `tls_cert` with its key
    `tls_key` (both or neither) to servers that ask for one
    (kvmanager / kvworker --tls_require_client_cert). docs/security.md."""
    if not tls_ca:
        raise ValueError(f"tls_ca: {tls_ca!r}; want the path of a PEM CA file")
    if bool(tls_cert) != bool(tls_key):
        raise ValueError(f"tls_cert={tls_cert!r}, tls_key={tls_key!r}: give both or neither")
    return grpc.ssl_channel_credentials(
        root_certificates=_read_pem("tls_ca", tls_ca),
        private_key=_read_pem("tls_key", tls_key) if tls_key else None,
        certificate_chain=_read_pem("tls_cert", tls_cert) if tls_cert else None)


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds "authorization: Bearer <token>" to every call of a channel."""

    def __init__(self, token):
        self._metadata = ("authorization", "Bearer " + token)

    def _details(self, details):
        metadata = list(details.metadata or []) + [self._metadata]
        return _CallDetails(details.method, details.timeout, metadata,
                            details.credentials, details.wait_for_ready,
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready,
                 compression):
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression
