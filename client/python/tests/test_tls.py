"""The Python client over TLS and local sockets (docs/security.md): a kvmanager and two
kvworkers that require client certificates (--tls_require_client_cert),
certificates made at run time by tests/tls/make_certs.sh (openssl). With the
CA and a client certificate the client opens, writes, reads and attends;
without a certificate, or in plaintext, it is refused (Unavailable) and
nothing changes; bad TLS arguments raise ValueError naming them."""

import os
import subprocess
import tempfile

import numpy as np
import pytest

import triaxkv
from conftest import MODEL, REPO, Cluster


@pytest.fixture(scope="module")
def tls_cluster():
    directory = tempfile.mkdtemp(prefix="triax-py-tls-")
    certs = os.path.join(directory, "tls")
    subprocess.run(["bash", os.path.join(REPO, "tests", "tls", "make_certs.sh"), certs],
                   check=True)

    def pem(name):
        return os.path.join(certs, name)

    def daemon(who):
        return [f"--tls_cert={pem(who + '.crt')}", f"--tls_key={pem(who + '.key')}",
                f"--tls_ca={pem('ca.crt')}", "--tls_require_client_cert"]

    client = {"tls_ca": pem("ca.crt"), "tls_cert": pem("client.crt"),
              "tls_key": pem("client.key")}
    c = Cluster(manager_flags=daemon("manager"), worker_flags=daemon("worker"),
                client_kwargs=client, directory=directory)
    c.pem = pem
    yield c
    c.stop()


def _write_read_attend(c, seq, tokens, seed):
    """Writes `tokens` random tokens on every layer, reads layer 0 back bit
    for bit and attends once at the last position."""
    rng = np.random.default_rng(seed)
    shape = (tokens, MODEL.n_kv_heads, MODEL.head_dim)
    k = rng.standard_normal(shape, dtype=np.float32)
    v = rng.standard_normal(shape, dtype=np.float32)
    for layer in range(MODEL.n_layers):
        assert c.write_kv(seq, layer, 0, k, v) == tokens
    rk, rv = c.read_kv(seq, 0)
    np.testing.assert_array_equal(rk, triaxkv.round_to_bf16(k))
    np.testing.assert_array_equal(rv, triaxkv.round_to_bf16(v))
    q = rng.standard_normal((1, MODEL.n_q_heads, MODEL.head_dim), dtype=np.float32)
    out = np.asarray(c.attend(seq, 0, q, [tokens - 1]))
    assert out.shape == q.shape
    assert np.isfinite(out).all() and np.abs(out).max() > 0


def test_session_over_mutual_tls(tls_cluster):
    with triaxkv.Client(tls_cluster.address, tenant_id="tls-acme", timeout=10,
                        **tls_cluster.client_kwargs) as c:
        c.create_tenant()
        seq = c.open_sequence(MODEL, [triaxkv.span("system", 20), triaxkv.span("user", 13)],
                              policy="bf16", block_tokens=16)
        _write_read_attend(c, seq, 33, 20261125)
        assert "tls-acme" in [t.tenant_id for t in c.list_tenants()]


def test_without_a_client_certificate_or_tls_it_is_refused(tls_cluster):
    for kwargs in ({"tls_ca": tls_cluster.pem("ca.crt")}, {}):
        with triaxkv.Client(tls_cluster.address, tenant_id="tls-intruder", timeout=5,
                            **kwargs) as c:
            with pytest.raises(triaxkv.Unavailable):
                c.create_tenant()
    with triaxkv.Client(tls_cluster.address, timeout=5, **tls_cluster.client_kwargs) as c:
        assert "tls-intruder" not in [t.tenant_id for t in c.list_tenants()]


def test_bad_tls_arguments_name_themselves(tls_cluster):
    with pytest.raises(ValueError, match="tls_ca='/nonexistent/ca.crt': cannot read"):
        triaxkv.Client(tls_cluster.address, tls_ca="/nonexistent/ca.crt")
    with pytest.raises(ValueError, match="give both or neither"):
        triaxkv.Client(tls_cluster.address, tls_ca=tls_cluster.pem("ca.crt"),
                       tls_cert=tls_cluster.pem("client.crt"))
    with pytest.raises(ValueError, match="tls_ca='.*empty': holds no PEM"):
        open(tls_cluster.pem("empty"), "w").close()
        triaxkv.Client(tls_cluster.address, tls_ca=tls_cluster.pem("empty"))


@pytest.fixture(scope="module")
def local_cluster():
    """A TLS cluster (client certificates required on TCP) whose manager and
    one worker also serve on Unix-domain sockets (--local_listen)."""
    directory = tempfile.mkdtemp(prefix="triax-py-sock-")
    certs = os.path.join(directory, "tls")
    subprocess.run(["bash", os.path.join(REPO, "tests", "tls", "make_certs.sh"), certs],
                   check=True)

    def pem(name):
        return os.path.join(certs, name)

    def daemon(who, sock):
        return [f"--tls_cert={pem(who + '.crt')}", f"--tls_key={pem(who + '.key')}",
                f"--tls_ca={pem('ca.crt')}", "--tls_require_client_cert",
                f"--local_listen=unix:{os.path.join(directory, sock)}"]

    client = {"tls_ca": pem("ca.crt"), "tls_cert": pem("client.crt"),
              "tls_key": pem("client.key")}
    c = Cluster(workers=1, manager_flags=daemon("manager", "m.sock"),
                worker_flags=daemon("worker", "w.sock"), client_kwargs=client,
                directory=directory)
    c.sock = lambda name: "unix:" + os.path.join(directory, name)
    yield c
    c.stop()


def test_session_over_local_sockets_without_tls(local_cluster):
    """No CA, no certificate: over the sockets the session works; the same
    client over TCP is refused (the TCP listeners require a certificate)."""
    w0 = local_cluster.workers[0].address
    with triaxkv.Client(local_cluster.sock("m.sock"), tenant_id="sock-acme", timeout=10,
                        worker_sockets={w0: local_cluster.sock("w.sock")}) as c:
        c.create_tenant()
        seq = c.open_sequence(MODEL, [triaxkv.span("system", 20)], policy="bf16",
                              block_tokens=16)
        _write_read_attend(c, seq, 20, 20261207)
    with triaxkv.Client(local_cluster.address, tenant_id="sock-acme", timeout=5) as c:
        with pytest.raises(triaxkv.Unavailable):
            c.list_tenants()


def test_bad_worker_sockets_name_themselves(local_cluster):
    with pytest.raises(ValueError, match=r"worker_sockets\['w:1'\]: '/tmp/x.sock'; want"):
        triaxkv.Client(local_cluster.address, worker_sockets={"w:1": "/tmp/x.sock"})
    with pytest.raises(ValueError, match="worker_sockets: key ''"):
        triaxkv.Client(local_cluster.address, worker_sockets={"": "unix:/tmp/x.sock"})
