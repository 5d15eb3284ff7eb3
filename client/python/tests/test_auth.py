"""The Python client against a kvmanager with --auth=token: its token goes
with every manager call, a tenant sees only itself, a missing or wrong token
is Unauthenticated and a tenant's operator call PermissionDenied."""

import os
import shutil
import tempfile

import time

import numpy as np
import pytest

import triaxkv
from conftest import MODEL, Process


@pytest.fixture(scope="module")
def secured():
    d = tempfile.mkdtemp(prefix="triax-py-auth-")
    admin_file = os.path.join(d, "admin.token")
    m = Process("kvmanager", "kvmanager",
                ["--listen=127.0.0.1:0", "--metadata=memory", "--auth=token",
                 f"--admin_token_file={admin_file}"], d)
    w = None
    try:
        with open(admin_file) as f:
            admin = f.read().strip()
        with triaxkv.Client(m.address, timeout=5, token=admin) as a:
            worker = a.manager.IssueToken(
                triaxkv.manager_pb2.IssueTokenRequest(role="worker"), timeout=5)
        worker_file = os.path.join(d, "worker.token")
        with open(worker_file, "w") as f:
            f.write(worker.token + "\n")
        w = Process("w0", "kvworker",
                    ["--listen=127.0.0.1:0", f"--manager={m.address}", "--worker_id=w0",
                     "--pool_mb=16", f"--token_file={worker_file}"], d)
        with triaxkv.Client(m.address, timeout=5, token=admin) as a:
            deadline = time.monotonic() + 10
            while not any(x.worker_id == "w0" for x in a.list_workers()):
                assert time.monotonic() < deadline, m.log()
                time.sleep(0.05)
        yield m.address, admin, w
    finally:
        if w is not None:
            w.stop()
        m.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_admin_issues_and_a_tenant_sees_only_itself(secured):
    address, admin, _ = secured
    with triaxkv.Client(address, timeout=5, token=admin) as a:
        a.create_tenant("py-acme")
        a.create_tenant("py-beta")
        resp = a.manager.IssueToken(triaxkv.manager_pb2.IssueTokenRequest(
            role="tenant", tenant_id="py-acme"), timeout=5)
        assert resp.info.role == "tenant" and resp.token.startswith("tkv1.")
        assert {t.tenant_id for t in a.list_tenants()} == {"py-acme", "py-beta"}
    with triaxkv.Client(address, tenant_id="py-acme", timeout=5, token=resp.token) as t:
        assert [x.tenant_id for x in t.list_tenants()] == ["py-acme"]
        with pytest.raises(triaxkv.PermissionDenied, match="CreateTenant"):
            t.create_tenant("py-evil")


def test_no_token_or_a_forged_one_is_unauthenticated(secured):
    address, admin, _ = secured
    with triaxkv.Client(address, timeout=5) as c:
        with pytest.raises(triaxkv.Unauthenticated, match="no bearer token"):
            c.list_tenants()
    forged = admin[:-1] + ("A" if admin[-1] != "A" else "B")
    with triaxkv.Client(address, timeout=5, token=forged) as c:
        with pytest.raises(triaxkv.Unauthenticated, match="does not match"):
            c.list_tenants()
    with pytest.raises(ValueError, match="token"):
        triaxkv.Client(address, token="  ")


def test_worker_calls_carry_the_managers_capabilities(secured):
    address, admin, w = secured
    with triaxkv.Client(address, timeout=5, token=admin) as a:
        a.create_tenant("py-cap")
        token = a.manager.IssueToken(triaxkv.manager_pb2.IssueTokenRequest(
            role="tenant", tenant_id="py-cap"), timeout=5).token
    with triaxkv.Client(address, tenant_id="py-cap", timeout=5, token=token) as c:
        seq = c.open_sequence(MODEL, [("system", 16)], policy="bf16", block_tokens=16)
        assert len(seq.capabilities) == 1 and seq.capabilities[0].worker_id == "w0"
        r = np.random.default_rng(5)
        k = r.standard_normal((16, MODEL.n_kv_heads, MODEL.head_dim), dtype=np.float32)
        v = r.standard_normal((16, MODEL.n_kv_heads, MODEL.head_dim), dtype=np.float32)
        for layer in range(MODEL.n_layers):
            assert c.write_kv(seq, layer, 0, k, v) == 16
        rk, _ = c.read_kv(seq, 0)
        assert np.array_equal(rk, triaxkv.bf16_to_float32(triaxkv.float32_to_bf16(k)))
        # Without its capabilities the worker refuses the same read.
        seq.capabilities = []
        with pytest.raises(triaxkv.Unauthenticated, match="no capability"):
            c.read_kv(seq, 0)
