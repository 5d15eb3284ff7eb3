#!/usr/bin/env python3
"""The Helm chart (helm/triaxkv) through a real helm 3.17.

`helm lint --strict` accepts the default and the HA values and refuses bad
ones (values.schema.json and the templates' own checks, each message naming
the value); `helm template` renders, for the default values, the manager as
a one-replica StatefulSet with --metadata=file:<dir> on a volumeClaimTemplate,
and for the HA values three replicas with --metadata=etcd://<endpoints> and
no claim; every container runs as non-root with gRPC probes; both components
have a PodDisruptionBudget that selects their pods; a node with N GPUs runs N
worker containers with distinct ports and worker ids; with tls.enabled the
Secrets are mounted, the --tls_* flags passed and the probes are HTTPS GETs. Every flag the chart
passes is one the daemons' --help lists (when the binaries are built).

helm: $TRIAX_HELM, else <repo>/.tools/bin/helm (scripts/install_helm.sh),
else helm on PATH. Without helm or PyYAML it exits 77, which ctest reports
as skipped, saying why.
"""

import os
import re
import shutil
import subprocess
import sys
import unittest

REPO = os.environ.get(
    "TRIAX_SOURCE_DIR",
    os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
CHART = os.path.join(REPO, "helm", "triaxkv")
HA_VALUES = os.path.join(CHART, "values-ha.yaml")
RELEASE = "kv"
NAMESPACE = "serving"
SKIP = 77

# Flags the chart renders ahead of the daemons (issue 17: the lead adds
# them to kvmanager); checked against --help once the binary has them.
PENDING_MANAGER_FLAGS = set()


def find_helm():
    for candidate in (os.environ.get("TRIAX_HELM"),
                      os.path.join(REPO, ".tools", "bin", "helm"),
                      shutil.which("helm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


HELM = find_helm()
try:
    import yaml
except ImportError:  # reported in main()
    yaml = None


def helm(*args):
    """Runs helm; (exit code, stdout + stderr)."""
    p = subprocess.run([HELM, *args], capture_output=True, text=True,
                       timeout=120)
    return p.returncode, p.stdout + p.stderr


def render(*args):
    """The objects `helm template` renders, by (kind, name)."""
    rc, out = helm("template", RELEASE, CHART, "--namespace", NAMESPACE, *args)
    if rc != 0:
        raise AssertionError(f"helm template {' '.join(args)} failed:\n{out}")
    objects = {}
    for doc in yaml.safe_load_all(out):
        if doc:
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in objects, f"{key} rendered twice"
            objects[key] = doc
    return objects


def of_kind(objects, kind):
    return [o for (k, _), o in sorted(objects.items()) if k == kind]


def flag(args, name):
    """The value of --name=... in args; None when absent."""
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    assert len(values) <= 1, f"--{name} given {len(values)} times: {args}"
    return values[0] if values else None


def help_flags(binary):
    """The flag names `binary --help` lists; None when it is not built."""
    bin_dir = os.environ.get("TRIAX_BIN_DIR", "")
    path = os.path.join(bin_dir, binary)
    if not bin_dir or not os.access(path, os.X_OK):
        return None
    p = subprocess.run([path, "--help"], capture_output=True, text=True,
                       timeout=30)
    return set(re.findall(r"--([a-z_0-9]+)", p.stdout + p.stderr))


class ChartTest(unittest.TestCase):
    maxDiff = None

    def assert_selects(self, selector, pod_labels, what):
        for k, v in selector["matchLabels"].items():
            self.assertEqual(pod_labels.get(k), v, f"{what}: label {k}")

    def assert_secure(self, pod, what):
        spec = pod["spec"]
        self.assertIs(spec["securityContext"]["runAsNonRoot"], True, what)
        self.assertGreater(spec["securityContext"]["runAsUser"], 0, what)
        self.assertIs(spec["automountServiceAccountToken"], False, what)
        for c in spec["containers"]:
            sc = c["securityContext"]
            self.assertIs(sc["runAsNonRoot"], True, c["name"])
            self.assertIs(sc["allowPrivilegeEscalation"], False, c["name"])
            self.assertIs(sc["readOnlyRootFilesystem"], True, c["name"])
            self.assertEqual(sc["capabilities"]["drop"], ["ALL"], c["name"])

    def assert_grpc_probes(self, container, port, ready, live):
        for probe, service in (("readinessProbe", ready),
                               ("livenessProbe", live),
                               ("startupProbe", live)):
            grpc = container[probe]["grpc"]
            self.assertEqual(grpc["port"], port, f"{container['name']} {probe}")
            self.assertEqual(grpc.get("service", ""), service,
                             f"{container['name']} {probe}")

    def manager(self, objects):
        sets = of_kind(objects, "StatefulSet")
        self.assertEqual(len(sets), 1, [o["metadata"]["name"] for o in sets])
        self.assertEqual(of_kind(objects, "Deployment"), [])
        return sets[0]

    def worker(self, objects):
        daemons = of_kind(objects, "DaemonSet")
        self.assertEqual(len(daemons), 1)
        return daemons[0]

    def pdb_for(self, objects, pod_labels, what):
        pdbs = [p for p in of_kind(objects, "PodDisruptionBudget")
                if all(pod_labels.get(k) == v for k, v in
                       p["spec"]["selector"]["matchLabels"].items())]
        self.assertEqual(len(pdbs), 1, f"one PDB selecting the {what} pods")
        self.assertIn("maxUnavailable", pdbs[0]["spec"])
        return pdbs[0]

    def manager_addresses(self, sts):
        headless = sts["spec"]["serviceName"]
        port = sts["spec"]["template"]["spec"]["containers"][0]["ports"][0][
            "containerPort"]
        name = sts["metadata"]["name"]
        return ",".join(f"{name}-{i}.{headless}.{NAMESPACE}.svc:{port}"
                        for i in range(sts["spec"]["replicas"]))

    # --- lint ----------------------------------------------------------------

    def test_lint_strict_accepts_default_ha_and_gpu_layouts(self):
        for args in ([], ["-f", HA_VALUES],
                     ["--set", "worker.gpusPerNode=8"],
                     ["--set", "worker.gpuMode=allVisible,"
                               "worker.gpusPerNode=4,"
                               "worker.runtimeClassName=nvidia"],
                     ["--set", "worker.diskTier.enabled=true"],
                     ["--set", "worker.backend=cpu,worker.poolMb=1024"]):
            with self.subTest(args=args):
                rc, out = helm("lint", "--strict", CHART, *args)
                self.assertEqual(rc, 0, out)

    def test_lint_strict_refuses_bad_values_naming_them(self):
        cases = [
            ("worker.poolMb=-1", "worker.poolMb"),
            ("worker.poolMb=0", "worker.poolMb"),
            ("worker.frameKb=100", "worker.frameKb"),
            ("worker.gpusPerNode=0", "worker.gpusPerNode"),
            ("worker.gpuMode=some", "worker.gpuMode"),
            ("worker.transferPath=carrier-pigeon", "worker.transferPath"),
            ("worker.poolMB=1024", "poolMB"),  # a misspelt key
            ("manager.replicas=3", "manager.replicas"),  # file mode: 1 only
            ("manager.metadata.mode=etcd", "endpoints"),
            ("manager.metadata.mode=sqlite", "manager.metadata.mode"),
            ("manager.pressure.highWatermark=2",
             "manager.pressure.highWatermark"),
            ("manager.pressure.mode=random", "manager.pressure.mode"),
            ("manager.pressure.protectedRoles={system,nobody}",
             "protectedRoles"),
            ("manager.defaultPolicy=fastest", "manager.defaultPolicy"),
            ("manager.port=70000", "manager.port"),
            ("podSecurityContext.runAsNonRoot=false", "runAsNonRoot"),
            ("manager.extraArgs={metadata=x}", "extraArgs"),
            ("tls.enabled=true", "managerSecret"),
            ("tls.mountPath=etc/tls", "tls.mountPath"),
            ("tls.workerNames=null", "workerNames"),
            ("worker.localSocket.hostPath=run/triaxkv", "localSocket.hostPath"),
            ("worker.localSocket.mode=999", "localSocket.mode"),
        ]
        for value, word in cases:
            with self.subTest(value=value):
                rc, out = helm("lint", "--strict", CHART, "--set", value)
                self.assertNotEqual(rc, 0, out)
                self.assertIn(word, out)

    def test_templates_check_what_the_schema_checks(self):
        # With the schema skipped, the templates' own checks still refuse
        # several managers on one file store and etcd without endpoints.
        for value, words in (
                ("manager.replicas=2", ["manager.replicas=2", "mode=file"]),
                ("manager.metadata.mode=etcd",
                 ["manager.metadata.etcd.endpoints"]),
                ("tls.enabled=true", ["tls.enabled", "Secret"]),
                ("auth.enabled=true", ["auth.enabled", "TokenSecret"])):
            with self.subTest(value=value):
                rc, out = helm("template", RELEASE, CHART,
                               "--skip-schema-validation", "--set", value)
                self.assertNotEqual(rc, 0, out)
                for word in words:
                    self.assertIn(word, out)

    # --- default values ------------------------------------------------------

    def test_default_manager_is_one_statefulset_with_a_claim(self):
        objects = render()
        sts = self.manager(objects)
        spec = sts["spec"]
        self.assertEqual(spec["replicas"], 1)
        self.assertEqual(spec["podManagementPolicy"], "OrderedReady")
        self.assertEqual(spec["updateStrategy"]["type"], "RollingUpdate")
        pod = spec["template"]
        self.assert_selects(spec["selector"], pod["metadata"]["labels"], "sts")
        (c,) = pod["spec"]["containers"]
        self.assertEqual(flag(c["args"], "metadata"), "file:/var/lib/triaxkv")
        (claim,) = spec["volumeClaimTemplates"]
        self.assertEqual(claim["spec"]["accessModes"], ["ReadWriteOnce"])
        self.assertEqual(claim["spec"]["resources"]["requests"]["storage"],
                         "10Gi")
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        self.assertEqual(mounts[claim["metadata"]["name"]], "/var/lib/triaxkv")
        self.assert_grpc_probes(c, 7070, "", "")
        self.assert_secure(pod, "manager")
        self.assertEqual(flag(c["args"], "listen"), "0.0.0.0:7070")
        # The manager's window guard follows the workers' window.
        self.assertEqual(flag(c["args"], "window_guard_tokens"), "32")
        self.assertEqual(flag(c["args"], "pressure_mode"), "demote-first")
        self.assertEqual(flag(c["args"], "high_watermark"), "0.9")

        headless = objects[("Service", spec["serviceName"])]["spec"]
        self.assertEqual(headless["clusterIP"], "None")
        self.assertIs(headless["publishNotReadyAddresses"], True)
        self.assert_selects({"matchLabels": headless["selector"]},
                            pod["metadata"]["labels"], "headless service")
        self.pdb_for(objects, pod["metadata"]["labels"], "manager")

    def test_default_worker_registers_with_the_manager(self):
        objects = render()
        sts = self.manager(objects)
        ds = self.worker(objects)
        pod = ds["spec"]["template"]
        self.assert_selects(ds["spec"]["selector"], pod["metadata"]["labels"],
                            "daemonset")
        (c,) = pod["spec"]["containers"]
        self.assertEqual(flag(c["args"], "manager"),
                         self.manager_addresses(sts))
        self.assertEqual(flag(c["args"], "manager"),
                         f"{RELEASE}-triaxkv-kvmanager-0.{RELEASE}-triaxkv-"
                         f"kvmanager-headless.{NAMESPACE}.svc:7070")
        self.assertEqual(flag(c["args"], "backend"), "cuda")
        self.assertEqual(flag(c["args"], "cuda_device"), "0")
        self.assertEqual(c["resources"]["limits"]["nvidia.com/gpu"], 1)
        self.assert_grpc_probes(c, 7071, "", "triax.v1.Worker")
        self.assert_secure(pod, "worker")
        self.assertEqual(pod["spec"]["nodeSelector"],
                         {"nvidia.com/gpu.present": "true"})
        self.assertIn("nvidia.com/gpu",
                      [t["key"] for t in pod["spec"]["tolerations"]])
        self.pdb_for(objects, pod["metadata"]["labels"], "worker")

    def test_tls_mounts_the_secrets_and_probes_over_https(self):
        objects = render("--set", "tls.enabled=true,tls.managerSecret=m-tls,"
                         "tls.workerSecret=w-tls,worker.gpusPerNode=2")
        (m,) = self.manager(objects)["spec"]["template"]["spec"]["containers"]
        wpod = self.worker(objects)["spec"]["template"]["spec"]
        for c, secret_volume, https in (
                [m, self.manager(objects)["spec"]["template"]["spec"], 9090],
                *[[w, wpod, 9100 + i]
                  for i, w in enumerate(wpod["containers"])]):
            what = c["name"]
            self.assertEqual(flag(c["args"], "tls_cert"),
                             "/etc/triaxkv/tls/tls.crt", what)
            self.assertEqual(flag(c["args"], "tls_key"),
                             "/etc/triaxkv/tls/tls.key", what)
            self.assertEqual(flag(c["args"], "tls_ca"),
                             "/etc/triaxkv/tls/ca.crt", what)
            self.assertEqual(flag(c["args"], "tls_require_client_cert"),
                             "true", what)
            self.assertEqual(flag(c["args"], "tls_worker_server_name"),
                             "kvworker.triaxkv", what)
            self.assertEqual(flag(c["args"], "http_listen"),
                             f"0.0.0.0:{https}", what)
            mounts = {v["name"]: v for v in c["volumeMounts"]}
            self.assertEqual(mounts["tls"]["mountPath"], "/etc/triaxkv/tls")
            self.assertIs(mounts["tls"]["readOnly"], True)
            for probe, path in (("readinessProbe", "/readyz"),
                                ("livenessProbe", "/healthz"),
                                ("startupProbe", "/healthz")):
                self.assertNotIn("grpc", c[probe], f"{what} {probe}")
                self.assertEqual(c[probe]["httpGet"],
                                 {"path": path, "port": https,
                                  "scheme": "HTTPS"}, f"{what} {probe}")
            volumes = {v["name"]: v for v in secret_volume["volumes"]}
            self.assertEqual(volumes["tls"]["secret"]["secretName"],
                             "m-tls" if c is m else "w-tls", what)
        self.assertEqual(flag(m["args"], "tls_worker_names"), "kvworker")
        self.assertIsNone(flag(m["args"], "tls_manager_names"))
        for w in wpod["containers"]:
            self.assertEqual(flag(w["args"], "tls_manager_names"), "kvmanager")
            self.assertEqual(flag(w["args"], "tls_worker_names"), "kvworker")

    def test_auth_mounts_the_tokens_and_requires_them(self):
        objects = render("--set", "auth.enabled=true,"
                         "auth.adminTokenSecret=admin-tok,"
                         "auth.workerTokenSecret=worker-tok,"
                         "auth.capabilityTtlSeconds=3600,worker.gpusPerNode=2")
        mpod = self.manager(objects)["spec"]["template"]["spec"]
        (m,) = mpod["containers"]
        self.assertEqual(flag(m["args"], "auth"), "token")
        self.assertEqual(flag(m["args"], "admin_token_file"),
                         "/etc/triaxkv/auth/admin.token")
        self.assertEqual(flag(m["args"], "capability_ttl_seconds"), "3600")
        self.assertIsNone(flag(m["args"], "token_file"))
        wpod = self.worker(objects)["spec"]["template"]["spec"]
        self.assertEqual(len(wpod["containers"]), 2)
        for w in wpod["containers"]:
            self.assertEqual(flag(w["args"], "token_file"),
                             "/etc/triaxkv/auth/worker.token")
            self.assertIsNone(flag(w["args"], "auth"))
        for pod, c, secret in ([mpod, m, "admin-tok"],
                               *[[wpod, w, "worker-tok"]
                                 for w in wpod["containers"]]):
            mounts = {v["name"]: v for v in c["volumeMounts"]}
            self.assertEqual(mounts["auth"]["mountPath"], "/etc/triaxkv/auth")
            self.assertIs(mounts["auth"]["readOnly"], True)
            volumes = {v["name"]: v for v in pod["volumes"]}
            self.assertEqual(volumes["auth"]["secret"]["secretName"], secret)
            # 0440: the pod's fsGroup reads it, others do not (the manager
            # refuses a token file others may read).
            self.assertEqual(volumes["auth"]["secret"]["defaultMode"], 0o440)
        # Off by default: no --auth, no token mounted.
        (plain,) = self.manager(render())["spec"]["template"]["spec"][
            "containers"]
        self.assertIsNone(flag(plain["args"], "auth"))

    def test_large_integers_render_as_integers(self):
        objects = render("--set", "manager.eventRetention=100000000,"
                         "worker.poolMb=131072,worker.hostTierMb=1048576")
        (m,) = self.manager(objects)["spec"]["template"]["spec"]["containers"]
        (w,) = self.worker(objects)["spec"]["template"]["spec"]["containers"]
        self.assertEqual(flag(m["args"], "event_retention"), "100000000")
        self.assertEqual(flag(w["args"], "pool_mb"), "131072")
        self.assertEqual(flag(w["args"], "host_tier_mb"), "1048576")

    # --- HA values -----------------------------------------------------------

    def test_ha_managers_elect_on_etcd_without_claims(self):
        objects = render("-f", HA_VALUES)
        sts = self.manager(objects)
        spec = sts["spec"]
        self.assertEqual(spec["replicas"], 3)
        self.assertEqual(spec["podManagementPolicy"], "Parallel")
        self.assertNotIn("volumeClaimTemplates", spec)
        pod = spec["template"]
        (c,) = pod["spec"]["containers"]
        self.assertEqual(
            flag(c["args"], "metadata"),
            "etcd://etcd-0.etcd:2379,etcd-1.etcd:2379,etcd-2.etcd:2379")
        self.assertNotIn("metadata", [m["name"] for m in c["volumeMounts"]])
        anti = pod["spec"]["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]
        self.assertEqual(anti[0]["topologyKey"], "kubernetes.io/hostname")
        self.assert_selects(anti[0]["labelSelector"],
                            pod["metadata"]["labels"], "anti-affinity")
        self.assert_grpc_probes(c, 7070, "", "")
        self.assert_secure(pod, "manager")
        self.pdb_for(objects, pod["metadata"]["labels"], "manager")

        (w,) = self.worker(objects)["spec"]["template"]["spec"]["containers"]
        addresses = flag(w["args"], "manager").split(",")
        self.assertEqual(addresses, [
            f"{RELEASE}-triaxkv-kvmanager-{i}.{RELEASE}-triaxkv-kvmanager-"
            f"headless.{NAMESPACE}.svc:7070" for i in range(3)])

    def test_etcd_endpoints_come_from_values(self):
        objects = render("--set", "manager.metadata.mode=etcd,"
                         "manager.replicas=2,"
                         "manager.metadata.etcd.endpoints={10.0.0.7:2379}")
        sts = self.manager(objects)
        (c,) = sts["spec"]["template"]["spec"]["containers"]
        self.assertEqual(flag(c["args"], "metadata"), "etcd://10.0.0.7:2379")
        self.assertEqual(sts["spec"]["replicas"], 2)

    # --- one worker per GPU --------------------------------------------------

    def check_workers(self, containers, n):
        self.assertEqual(len(containers), n)
        ports, ids = set(), set()
        for i, c in enumerate(containers):
            port = 7071 + i
            self.assertEqual(flag(c["args"], "listen"), f"0.0.0.0:{port}")
            self.assertEqual(flag(c["args"], "advertise"), f"$(POD_IP):{port}")
            self.assertEqual([p["containerPort"] for p in c["ports"]], [port])
            self.assert_grpc_probes(c, port, "", "triax.v1.Worker")
            ports.add(port)
            ids.add(flag(c["args"], "worker_id"))
        self.assertEqual(len(ports), n)
        self.assertEqual(ids, {f"$(NODE_NAME)-gpu{i}" for i in range(n)})
        self.assertEqual(len({c["name"] for c in containers}), n)

    def test_per_container_gpus_one_worker_each(self):
        objects = render("--set", "worker.gpusPerNode=8")
        pod = self.worker(objects)["spec"]["template"]["spec"]
        containers = pod["containers"]
        self.check_workers(containers, 8)
        for c in containers:
            # The device plugin gives each container its own GPU: device 0.
            self.assertEqual(c["resources"]["limits"]["nvidia.com/gpu"], 1)
            self.assertEqual(flag(c["args"], "cuda_device"), "0")
            self.assertNotIn("NVIDIA_VISIBLE_DEVICES",
                             [e["name"] for e in c["env"]])
        self.assertNotIn("runtimeClassName", pod)

    def test_all_visible_gpus_one_device_ordinal_each(self):
        objects = render("--set", "worker.gpusPerNode=4,"
                         "worker.gpuMode=allVisible,"
                         "worker.runtimeClassName=nvidia")
        pod = self.worker(objects)["spec"]["template"]["spec"]
        containers = pod["containers"]
        self.check_workers(containers, 4)
        self.assertEqual(pod["runtimeClassName"], "nvidia")
        for i, c in enumerate(containers):
            self.assertEqual(flag(c["args"], "cuda_device"), str(i))
            self.assertNotIn("nvidia.com/gpu", c["resources"].get("limits", {}))
            env = {e["name"]: e.get("value") for e in c["env"]}
            self.assertEqual(env["NVIDIA_VISIBLE_DEVICES"], "all")

    def test_local_sockets_one_per_worker_on_the_node(self):
        objects = render("--set", "worker.gpusPerNode=2,"
                         "worker.localSocket.enabled=true,"
                         "worker.localSocket.mode=0600")
        pod = self.worker(objects)["spec"]["template"]["spec"]
        for i, c in enumerate(pod["containers"]):
            self.assertEqual(flag(c["args"], "local_listen"),
                             f"unix:/run/triaxkv/gpu{i}.sock")
            self.assertEqual(flag(c["args"], "local_listen_mode"), "0600")
            mounts = {v["name"]: v for v in c["volumeMounts"]}
            self.assertEqual(mounts["local-socket"]["mountPath"], "/run/triaxkv")
        volumes = {v["name"]: v for v in pod["volumes"]}
        self.assertEqual(volumes["local-socket"]["hostPath"],
                         {"path": "/run/triaxkv", "type": "Directory"})
        # Off by default: no socket, no host directory.
        default = self.worker(render())["spec"]["template"]["spec"]
        for c in default["containers"]:
            self.assertIsNone(flag(c["args"], "local_listen"))
        self.assertNotIn("local-socket",
                         [v["name"] for v in default["volumes"]])

    def test_tier_and_pressure_values_reach_the_flags(self):
        objects = render(
            "--set", "worker.diskTier.enabled=true,worker.diskTier.mb=2048,"
            "worker.diskTier.hostPath=/mnt/nvme/triaxkv,worker.hostTierMb=0,"
            "worker.restoreOnAttend=false,worker.windowTokens=64,"
            "manager.pressure.mode=lru,manager.pressure.protectedRoles={system}",
            # --set leaves floats strings; --set-json gives numbers.
            "--set-json", "manager.pressure.highWatermark=0.95",
            "--set-json", "manager.pressure.lowWatermark=0.7")
        (m,) = self.manager(objects)["spec"]["template"]["spec"]["containers"]
        pod = self.worker(objects)["spec"]["template"]["spec"]
        (w,) = pod["containers"]
        self.assertEqual(flag(w["args"], "disk_tier_dir"), "/var/cache/triaxkv")
        self.assertEqual(flag(w["args"], "disk_tier_mb"), "2048")
        self.assertEqual(flag(w["args"], "host_tier_mb"), "0")
        self.assertEqual(flag(w["args"], "restore_on_attend"), "false")
        mounts = {v["name"]: v["mountPath"] for v in w["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        (name,) = [k for k, v in mounts.items() if v == "/var/cache/triaxkv"]
        self.assertEqual(volumes[name]["hostPath"]["path"], "/mnt/nvme/triaxkv")
        self.assertEqual(flag(m["args"], "pressure_mode"), "lru")
        self.assertEqual(flag(m["args"], "high_watermark"), "0.95")
        self.assertEqual(flag(m["args"], "low_watermark"), "0.7")
        self.assertEqual(flag(m["args"], "protected_roles"), "system")
        self.assertEqual(flag(m["args"], "window_guard_tokens"), "64")

    def test_scheduling_values_reach_the_pods(self):
        objects = render(
            "--set", "worker.tolerations[0].key=gpu,"
            "worker.tolerations[0].operator=Exists,"
            "worker.nodeSelector.pool=h100,"
            "manager.nodeSelector.pool=cpu,"
            "manager.resources.requests.cpu=500m")
        m = self.manager(objects)["spec"]["template"]["spec"]
        w = self.worker(objects)["spec"]["template"]["spec"]
        self.assertEqual(w["tolerations"], [{"key": "gpu",
                                             "operator": "Exists"}])
        self.assertEqual(w["nodeSelector"]["pool"], "h100")
        self.assertEqual(m["nodeSelector"], {"pool": "cpu"})
        self.assertEqual(m["containers"][0]["resources"]["requests"]["cpu"],
                         "500m")

    # --- the flags exist -----------------------------------------------------

    def test_every_rendered_flag_is_one_the_daemons_know(self):
        known = {"kvmanager": help_flags("kvmanager"),
                 "kvworker": help_flags("kvworker")}
        if None in known.values():
            self.skipTest("TRIAX_BIN_DIR has no kvmanager/kvworker")
        pending = PENDING_MANAGER_FLAGS - known["kvmanager"]
        for args in ([], ["-f", HA_VALUES],
                     ["--set", "worker.diskTier.enabled=true"],
                     ["--set", "worker.localSocket.enabled=true"],
                     ["--set", "tls.enabled=true,tls.managerSecret=m,"
                               "tls.workerSecret=w"],
                     ["--set", "auth.enabled=true,auth.adminTokenSecret=a,"
                               "auth.workerTokenSecret=w"]):
            objects = render(*args)
            for kind in ("StatefulSet", "DaemonSet"):
                for obj in of_kind(objects, kind):
                    for c in obj["spec"]["template"]["spec"]["containers"]:
                        binary = os.path.basename(c["command"][0])
                        for a in c["args"]:
                            name = re.match(r"--([a-z_0-9]+)=", a).group(1)
                            if binary == "kvmanager" and name in pending:
                                continue
                            self.assertIn(name, known[binary],
                                          f"{binary} --{name}")


def main():
    if HELM is None:
        print("SKIP: no helm (run scripts/install_helm.sh, or put helm on "
              "PATH, or set TRIAX_HELM)")
        return SKIP
    if yaml is None:
        print(f"SKIP: {sys.executable} has no PyYAML (Debian: python3-yaml)")
        return SKIP
    rc, version = helm("version", "--short")
    print(f"helm: {HELM} {version.strip()}")
    result = unittest.main(argv=[sys.argv[0], "-v"], exit=False).result
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
