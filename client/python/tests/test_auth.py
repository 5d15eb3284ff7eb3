"""The Python client against a kvmanager with --auth=token: its token goes
with every manager call, a tenant sees only itself, a missing or wrong token
is Unauthenticated and a tenant's operator call PermissionDenied."""

import os
import shutil
import tempfile

import pytest

import triaxkv
from conftest import Process


@pytest.fixture(scope="module")
def secured():
    d = tempfile.mkdtemp(prefix="triax-py-auth-")
    admin_file = os.path.join(d, "admin.token")
    m = Process("kvmanager", "kvmanager",
                ["--listen=127.0.0.1:0", "--metadata=memory", "--auth=token",
                 f"--admin_token_file={admin_file}"], d)
    try:
        with open(admin_file) as f:
            yield m.address, f.read().strip()
    finally:
        m.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_admin_issues_and_a_tenant_sees_only_itself(secured):
    address, admin = secured
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
    address, admin = secured
    with triaxkv.Client(address, timeout=5) as c:
        with pytest.raises(triaxkv.Unauthenticated, match="no bearer token"):
            c.list_tenants()
    forged = admin[:-1] + ("A" if admin[-1] != "A" else "B")
    with triaxkv.Client(address, timeout=5, token=forged) as c:
        with pytest.raises(triaxkv.Unauthenticated, match="does not match"):
            c.list_tenants()
    with pytest.raises(ValueError, match="token"):
        triaxkv.Client(address, token="  ")
