"""The Helm chart (compose/helm/pdmesh), offline: no cluster is reachable here, so the chart is
rendered by Helm's own Go SDK (helm_python), linted, and every object it renders is validated
against the Kubernetes API schemas (kubernetes_validate, strict: an unknown field fails) of
two Kubernetes versions. Objects of CRDs those schemas lack (KEDA's ScaledObject, Gateway
API's HTTPRoute, the Prometheus Operator's ServiceMonitor) are checked for their structure
and for what they point at: a rendered Deployment or Service and port, metrics a worker
really exports.

And in parity with what compose runs: each role's container runs topology's
`pdmesh serve <role>` with the compose role's PDMESH_* environment (but for the keys listed,
with the reason, in CHART_ONLY and DIFFERS), SIGKILL comes no sooner than compose's
stop_grace_period, the probes ask the role's own HTTP port, and every PDMESH_* name the chart
sets is a row of services/runtime/settings.py. The KV tiers (docs/KVTIERS.md): the store
runs as compose's, only prefill pods get its URL and a disk volume of their own, and the
kvTiers values reach them as the settings parse them.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

from pdmesh.services.engine import checkpoint
from pdmesh.services.ops import natsauth
from pdmesh.services.ops.launcher import STOP_MARGIN_S
from pdmesh.services.ops.topology import ServiceSpec, mesh_services
from pdmesh.services.runtime.settings import BY_ENV, BY_FIELD, TRANSPORTS
from tests.compose.test_compose_files import LAB, REPO, UCX_OVERRIDE, _load
from tests.compose.test_drain_grace import duration_s

CHART = REPO / "compose" / "helm" / "pdmesh"
README = REPO / "compose" / "helm" / "README.md"
MULTIHOST = REPO / "compose" / "multihost"
RELEASE, NAMESPACE = "pdmesh", "llm"
# Two recent Kubernetes versions whose API schemas the installed kubernetes-validate ships.
KUBE_VERSIONS = ("1.36.0", "1.37.0")
# Kinds of CRDs (no schema in kubernetes-validate): their own structural tests below.
CRD_KINDS = {"ScaledObject": "keda.sh/v1alpha1", "HTTPRoute": "gateway.networking.k8s.io/v1",
             "ServiceMonitor": "monitoring.coreos.com/v1"}
ROLES = ("admission", "prefill", "decode", "gateway")
WORKERS = ("prefill", "decode")
SPECS: dict[str, ServiceSpec] = {s.role: s for s in mesh_services()}
HOST_FILE = {"admission": "control", "gateway": "control", "prefill": "prefill",
             "decode": "decode"}
DRAIN_DEFAULT_S = float(BY_FIELD["drain_timeout_s"].default)

# -- the environment the chart and compose may legitimately disagree on ------------------------
# Keys the chart sets that the compose service does not (role: None for every role).
CHART_ONLY: dict[str, tuple[tuple[str, ...] | None, str]] = {
    "PDMESH_WORKER_ID": (None, "the pod's name (downward API); compose leaves it to the default "
                               "<role>-<container hostname>-<pid>, the hostname being the "
                               "container's own, as a pod's is its name"),
    "PDMESH_DRAIN_TIMEOUT_S": (None, "given explicitly because terminationGracePeriodSeconds "
                                     "is computed from the same value"),
    "PDMESH_DATA_PORT": (WORKERS, "a fixed, named containerPort (host networking reserves it on "
                                  "the node); compose lets the worker pick a free one"),
    "PDMESH_KV_DISK_GIB": (("prefill",), "given explicitly because the disk tier volume's size "
                                         "is computed from the same value"),
}
# Lab only: compose's bridge network resolves the container's hostname to its address, which
# the worker advertises; the chart gives the pod IP (downward API) outright.
CHART_ONLY_LAB = {"PDMESH_ADVERTISE_HOST": (WORKERS, "the pod IP (status.podIP)")}
# Production only: the node-local model cache (compose: the image's own cache, its ENV).
CHART_ONLY_PRODUCTION = {
    "PDMESH_CACHE_DIR": (("prefill", "decode", "gateway"), "model.cache.mountPath"),
    # The multi-host files run no tier 2 or 3; the chart runs them from kvTiers values.
    "PDMESH_KV_DISK_DIR": (("prefill",), "kvTiers.disk.mountPath"),
    "PDMESH_KV_REMOTE_URL": (("prefill",), "the chart's store (kvTiers.store)"),
}
# Keys both set, to values that depend on where the mesh runs (the lab compose file differs
# in the NATS and store URLs only; the multi-host files in all of them).
DIFFERS = {
    "PDMESH_NATS_URL": "the NATS StatefulSet's pods by DNS name (compose: the nats service, or "
                       "the host's own node)",
    "PDMESH_HTTP_HOST": "every interface of the pod's network (0.0.0.0), or the node's address "
                        "with host networking (multi-host compose: the host's address)",
    "PDMESH_METRICS_HOST": "the pod's network (multi-host compose: the host's address)",
    "PDMESH_ADVERTISE_HOST": "the pod IP (multi-host compose: the host's address)",
    "PDMESH_KV_REMOTE_URL": "the chart's store Service, <release>-kvstore (compose: its kvstore "
                            "service)",
}
# What hosts.env gives the multi-host files for a production mesh (compose/README.md: "For
# UCX across hosts, add PDMESH_TRANSPORT=ucx to hosts.env"); host addresses: placeholders.
HOSTS_ENV_PRODUCTION = {"PDMESH_TRANSPORT": "ucx", "PDMESH_MODEL": "smollm2"}


# -- rendering ---------------------------------------------------------------------------------
def _production_values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values-production.yaml").read_text())


FULL_VALUES: dict[str, Any] = {  # every optional object on
    "autoscaling": {"keda": {"enabled": True}},
    "tracing": {"jaeger": {"enabled": True}},
    "metrics": {"scrapeAnnotations": True, "serviceMonitor": {"enabled": True}},
    "nats": {"replicas": 3, "tls": {"enabled": True}, "jetstream": {"enabled": True}},
    "model": {"cache": {"enabled": True}},
    "gateway": {
        "preStopSleepSeconds": 5,
        "ingress": {"enabled": True, "className": "nginx",
                    "tls": [{"secretName": "pdmesh-tls", "hosts": ["pdmesh.example.com"]}]},
        "httpRoute": {"enabled": True, "parentRefs": [{"name": "edge", "namespace": "gw"}],
                      "hostnames": ["pdmesh.example.com"], "timeouts": {"request": "0s"}}},
    "workers": {"ipcLock": True, "shm": {"enabled": True}},
    "kvTiers": {
        "hostTokens": 262144,
        "disk": {"sizeGiB": 16, "sizeLimit": "20Gi"},
        "store": {"ttlS": 3600, "timeoutS": 0.25, "podAnnotations": {"team": "llm"},
                  "persistence": {"enabled": True, "storageClassName": "fast"},
                  "nodeSelector": {"pool": "cpu"},
                  "tolerations": [{"key": "pool", "operator": "Exists",
                                   "effect": "NoSchedule"}],
                  "affinity": {"nodeAffinity": {
                      "preferredDuringSchedulingIgnoredDuringExecution": [{
                          "weight": 1, "preference": {"matchExpressions": [
                              {"key": "pool", "operator": "In", "values": ["cpu"]}]}}]}}}},
}
VALUE_SETS = {"lab": lambda: {}, "production": _production_values,
              "full": lambda: copy.deepcopy(FULL_VALUES)}


def render(values: dict[str, Any] | None = None) -> dict[str, str]:
    chart = helm_python.Chart.load(str(CHART))
    return chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)


def objects(rendered: dict[str, str]) -> list[dict[str, Any]]:
    return [doc for path, text in sorted(rendered.items()) if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[str, str]]:
    return {name: render(values()) for name, values in VALUE_SETS.items()}


@pytest.fixture(scope="module")
def docs(rendered: dict[str, dict[str, str]]) -> dict[str, list[dict[str, Any]]]:
    return {name: objects(r) for name, r in rendered.items()}


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def deployment(objs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return find(objs, "Deployment", f"{RELEASE}-{role}")


def container(objs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    (main,) = [c for c in deployment(objs, role)["spec"]["template"]["spec"]["containers"]
               if c["name"] == role]
    return main


def env_of(c: dict[str, Any]) -> dict[str, str]:
    """A container's explicit env: values, or `fieldRef:<path>` for the downward API."""
    out = {}
    for e in c.get("env", []):
        assert e["name"] not in out, f"{c['name']}: {e['name']} set twice"
        out[e["name"]] = (e["value"] if "value" in e
                          else f"fieldRef:{e['valueFrom']['fieldRef']['fieldPath']}")
    return out


def port_number(c: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in c["ports"] if p["name"] == port]
    return number


def all_containers(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet"):
            spec = o["spec"]["template"]["spec"]
            for c in spec.get("initContainers", []) + spec["containers"]:
                out.append((f"{o['metadata']['name']}/{c['name']}", c))
    return out


# -- Helm and the Kubernetes API ---------------------------------------------------------------
@pytest.mark.parametrize("values", sorted(VALUE_SETS))
def test_helm_lint_finds_nothing_to_fix(values: str) -> None:
    report = helm_python.lint(str(CHART), VALUE_SETS[values](), namespace=NAMESPACE)
    assert report["errors"] == []
    # Severity 2 is a warning, 3 an error (1: info, such as "icon is recommended").
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("values", sorted(VALUE_SETS))
def test_every_object_is_valid_kubernetes(docs: dict[str, list[dict[str, Any]]], values: str,
                                          version: str) -> None:
    problems, crds = [], []
    for obj in docs[values]:
        kind = obj["kind"]
        if kind in CRD_KINDS:
            assert obj["apiVersion"] == CRD_KINDS[kind]
            crds.append(kind)
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{kind}/{obj['metadata']['name']}: {exc.caught.message} at "
                            f"{'.'.join(map(str, exc.caught.absolute_path))}")
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(f"{kind} {obj['apiVersion']}: no schema in Kubernetes {version}")
    assert problems == []
    if values == "full":  # every optional object is rendered, and checked below
        assert sorted(crds) == ["HTTPRoute", "ScaledObject", "ScaledObject", "ServiceMonitor"]


def test_the_kubernetes_versions_are_shipped() -> None:
    shipped = kubernetes_validate.utils.all_versions()
    assert {v.rsplit(".", 1)[0] for v in KUBE_VERSIONS} <= {
        v.rsplit(".", 1)[0] for v in shipped}, shipped


def test_values_schema_refuses_unknown_keys_and_bad_values() -> None:
    for bad in ({"prefill": {"replica": 2}}, {"transport": "rdma"},
                {"drainTimeoutSeconds": 0}, {"decode": {"settings": {"KV_TOKENS": "1"}}},
                {"tracing": {"otlpTracesEndpoint": "jaeger:4318"}},
                {"kvTiers": {"store": {"externalUrl": "http://redis:6379"}}},
                {"kvTiers": {"store": {"maxmemory": "2 GB"}}}, {"kvTiers": {"hostTokens": -1}},
                {"kvTiers": {"disk": {"sizeGiB": 0}}}, {"kvTiers": {"store": {"password": "x"}}}):
        with pytest.raises(helm_python.HelmError):
            render(bad)
    schema = helm_python.Chart.load(str(CHART)).schema
    assert tuple(schema["properties"]["transport"]["enum"]) == TRANSPORTS


def test_a_nats_cluster_without_tls_is_refused() -> None:
    with pytest.raises(helm_python.HelmError, match="nats.tls"):
        render({"nats": {"replicas": 3}})


def test_settings_cannot_override_what_the_chart_sets() -> None:
    with pytest.raises(helm_python.HelmError, match="the chart sets it"):
        render({"decode": {"settings": {"PDMESH_NATS_URL": "nats://elsewhere:4222"}}})
    env = env_of(container(objects(render({"decode": {"settings": {"PDMESH_MAX_BATCH": 32}}})),
                           "decode"))
    assert env["PDMESH_MAX_BATCH"] == "32"


# -- parity with compose and the topology ------------------------------------------------------
def _compose_value(value: Any, substitute: dict[str, str]) -> str:
    """compose's ${VAR:-default} / ${VAR:?} as hosts.env (`substitute`) or the default fill
    it; a host address (no default) becomes a placeholder: those keys are in DIFFERS."""
    def one(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(3) or ""
        return substitute.get(name, default or f"<{name}>")
    return re.sub(r"\$\{(\w+)(:[?-]([^}]*))?\}", one, str(value))


def _assert_env_parity(role: str, chart_env: dict[str, str], compose_env: dict[str, str],
                       chart_only: dict[str, tuple[tuple[str, ...] | None, str]],
                       differs: set[str]) -> None:
    extra = {k for k, (roles, _why) in chart_only.items() if roles is None or role in roles}
    assert set(chart_env) == set(compose_env) | extra, (
        f"{role}: only in the chart {sorted(set(chart_env) - set(compose_env) - extra)}, "
        f"only in compose {sorted(set(compose_env) - set(chart_env))}, "
        f"missing from the chart {sorted(extra - set(chart_env))}")
    assert differs <= set(DIFFERS)
    for key in sorted(set(compose_env) - differs):
        assert chart_env[key] == compose_env[key], (role, key)


@pytest.mark.parametrize("values", ["lab", "production"])
@pytest.mark.parametrize("role", ROLES)
def test_each_role_runs_topologys_command(docs: dict[str, list[dict[str, Any]]], role: str,
                                          values: str) -> None:
    c = container(docs[values], role)
    # `args` (the image's CMD), as compose's `command:` replaces it: no ENTRYPOINT override.
    assert "command" not in c
    assert c["args"] == list(SPECS[role].argv) == ["pdmesh", "serve", role]


@pytest.mark.parametrize("role", ROLES)
def test_lab_env_is_the_lab_compose_env(docs: dict[str, list[dict[str, Any]]],
                                        role: str) -> None:
    service = _load(LAB)["services"][role]
    compose_env = {k: _compose_value(v, {}) for k, v in service["environment"].items()}
    _assert_env_parity(role, env_of(container(docs["lab"], role)), compose_env,
                       {**CHART_ONLY, **CHART_ONLY_LAB},
                       {"PDMESH_NATS_URL", "PDMESH_KV_REMOTE_URL"})


@pytest.mark.parametrize("role", ROLES)
def test_production_env_is_the_multihost_compose_env(docs: dict[str, list[dict[str, Any]]],
                                                     role: str) -> None:
    service = _load(MULTIHOST / f"{HOST_FILE[role]}.yml")["services"][role]
    compose_env = {k: _compose_value(v, HOSTS_ENV_PRODUCTION)
                   for k, v in service["environment"].items()}
    if role in WORKERS:  # and the UCX lines of docker-compose.ucx.yml that the multi-host
        # walkthrough tells a UCX mesh to add (its addresses and NATS URL are single-host's)
        ucx = _load(UCX_OVERRIDE)["services"][role]["environment"]
        compose_env.update({k: _compose_value(v, HOSTS_ENV_PRODUCTION) for k, v in ucx.items()
                            if k not in compose_env})
    _assert_env_parity(role, env_of(container(docs["production"], role)), compose_env,
                       {**CHART_ONLY, **CHART_ONLY_PRODUCTION}, set(DIFFERS))


@pytest.mark.parametrize("values", ["lab", "production"])
@pytest.mark.parametrize("role", ROLES)
def test_each_role_gets_its_nats_user_and_its_key_from_its_own_secret(
        rendered: dict[str, dict[str, str]], docs: dict[str, list[dict[str, Any]]], role: str,
        values: str) -> None:
    c = container(docs[values], role)
    secret = f"{RELEASE}-{role}"  # values.yaml secrets.env.<role>
    assert c["envFrom"] == [{"secretRef": {"name": secret}}]
    held = {v for v, _roles in natsauth.KEY_FILES.values()}
    assert not (set(env_of(c)) & (held | {"PDMESH_NATS_USER", "PDMESH_NATS_PASSWORD"}))
    # The NOTES' command makes that Secret from the files compose's env_file names.
    compose_files = [Path(f).name for f in _load(LAB)["services"][role]["env_file"]]
    (line,) = [ln for ln in rendered[values][f"{RELEASE}/templates/NOTES.txt"].splitlines()
               if f"create secret generic {secret} " in ln]
    assert sorted(re.findall(r"--from-env-file=\$S/(\S+)", line)) == sorted(compose_files)
    key_files = [f for f in compose_files if f in natsauth.KEY_FILES]
    assert key_files and all(role in natsauth.KEY_FILES[f][1] for f in key_files)


@pytest.mark.parametrize("values", ["lab", "production"])
@pytest.mark.parametrize("role", ROLES)
def test_sigkill_waits_for_the_drain_as_compose(docs: dict[str, list[dict[str, Any]]],
                                                role: str, values: str) -> None:
    pod = deployment(docs[values], role)["spec"]["template"]["spec"]
    c = container(docs[values], role)
    drain = float(env_of(c)["PDMESH_DRAIN_TIMEOUT_S"])
    assert drain == DRAIN_DEFAULT_S  # neither values file changes the drain
    sleep = 0.0
    if (pre := c.get("lifecycle", {}).get("preStop")) is not None:  # the gateway's option
        assert role == "gateway" and pre["exec"]["command"][0] == "sleep"
        sleep = float(pre["exec"]["command"][1])
    compose_grace = duration_s(_load(LAB)["services"][role]["stop_grace_period"])
    assert pod["terminationGracePeriodSeconds"] == compose_grace + sleep
    assert pod["terminationGracePeriodSeconds"] == drain + STOP_MARGIN_S + sleep


def test_the_grace_period_follows_a_longer_drain() -> None:
    objs = objects(render({"decode": {"drainTimeoutSeconds": 120},
                           "drainTimeoutSeconds": 12.5}))
    assert env_of(container(objs, "decode"))["PDMESH_DRAIN_TIMEOUT_S"] == "120"
    assert deployment(objs, "decode")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"] == 120 + STOP_MARGIN_S
    assert env_of(container(objs, "prefill"))["PDMESH_DRAIN_TIMEOUT_S"] == "12.5"
    assert deployment(objs, "prefill")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"] == 23  # 12.5 + 10, rounded up: never sooner


@pytest.mark.parametrize("values", ["lab", "production"])
@pytest.mark.parametrize("role", ROLES)
def test_probes_ask_the_roles_http_port(docs: dict[str, list[dict[str, Any]]], role: str,
                                        values: str) -> None:
    c = container(docs[values], role)
    spec = SPECS[role]
    for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/health"),
                        ("startupProbe", "/health")):
        get = c[probe]["httpGet"]
        assert get["path"] == path, (probe, get)
        assert port_number(c, get["port"]) == spec.http_port, (probe, get)
    env = env_of(c)
    for key, value in spec.env.items():  # topology's ports, as the service will bind them
        assert env[key] == value
    if role == "gateway":
        assert port_number(c, "metrics") == spec.metrics_port


@pytest.mark.parametrize("values", sorted(VALUE_SETS))
def test_every_pdmesh_variable_set_is_a_setting(docs: dict[str, list[dict[str, Any]]],
                                                values: str) -> None:
    unknown = [(where, e["name"]) for where, c in all_containers(docs[values])
               for e in c.get("env", []) if e["name"].startswith("PDMESH_")
               and e["name"] not in BY_ENV]
    assert unknown == []


# -- data plane, placement, production ---------------------------------------------------------
@pytest.mark.parametrize("values", ["lab", "production"])
@pytest.mark.parametrize("role", WORKERS)
def test_workers_advertise_the_pod_ip_on_a_fixed_port(docs: dict[str, list[dict[str, Any]]],
                                                      role: str, values: str) -> None:
    c = container(docs[values], role)
    env = env_of(c)
    assert env["PDMESH_ADVERTISE_HOST"] == "fieldRef:status.podIP"
    assert env["PDMESH_DATA_HOST"] == "0.0.0.0"
    assert int(env["PDMESH_DATA_PORT"]) == port_number(c, "data") > 0
    assert env["PDMESH_WORKER_ID"] == "fieldRef:metadata.name"
    host_network = deployment(docs[values], role)["spec"]["template"]["spec"].get(
        "hostNetwork", False)
    assert host_network == (values == "production")
    if host_network:  # probes reach the node's address, so the HTTP port listens there
        assert env["PDMESH_HTTP_HOST"] == "fieldRef:status.podIP"


@pytest.mark.parametrize("role", WORKERS)
def test_prefill_and_decode_prefer_different_nodes(docs: dict[str, list[dict[str, Any]]],
                                                   role: str) -> None:
    other = "decode" if role == "prefill" else "prefill"
    anti = deployment(docs["lab"], role)["spec"]["template"]["spec"]["affinity"][
        "podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    top = max(anti, key=lambda t: t["weight"])["podAffinityTerm"]
    assert top["topologyKey"] == "kubernetes.io/hostname"
    assert top["labelSelector"]["matchLabels"] == deployment(docs["lab"], other)["spec"][
        "selector"]["matchLabels"]


@pytest.mark.parametrize("role", WORKERS)
def test_production_workers_get_rdma_gpus_and_ucx(docs: dict[str, list[dict[str, Any]]],
                                                  role: str) -> None:
    c = container(docs["production"], role)
    assert env_of(c)["PDMESH_TRANSPORT"] in ("ucx", "nixl")
    assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
    limits = c["resources"]["limits"]
    assert limits["rdma/hca_shared_devices_a"] >= 1 and limits["nvidia.com/gpu"] >= 1
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    lab = container(docs["lab"], role)  # the lab needs none of it
    assert "add" not in lab["securityContext"]["capabilities"]
    assert "limits" not in lab.get("resources", {})


def test_the_model_is_fetched_once_per_node_into_the_cache(
        docs: dict[str, list[dict[str, Any]]]) -> None:
    mount = _production_values()["model"]["cache"]["mountPath"]
    for role in ("prefill", "decode", "gateway"):
        pod = deployment(docs["production"], role)["spec"]["template"]["spec"]
        (fetch,) = [c for c in pod["initContainers"] if c["name"] == "fetch-model"]
        assert env_of(fetch)["PDMESH_CACHE_DIR"] == mount
        code = fetch["command"][-1]
        name = re.fullmatch(r"from (\S+) import (\w+); print\(\w+\(\)\)", code)
        assert name and name.group(1) == checkpoint.__name__
        assert callable(getattr(checkpoint, name.group(2)))
        (volume,) = [v for v in pod["volumes"] if v["name"] == "model-cache"]
        assert volume["hostPath"]["type"] == "DirectoryOrCreate"
        c = container(docs["production"], role)
        assert env_of(c)["PDMESH_CACHE_DIR"] == mount
        assert {"name": "model-cache", "mountPath": mount, "readOnly": True} in c["volumeMounts"]
    for role in ROLES:  # the lab image carries the model: no cache, no fetch
        pod = deployment(docs["lab"], role)["spec"]["template"]["spec"]
        assert [c["name"] for c in pod.get("initContainers", [])] == ["wait-for-nats"]
        assert "PDMESH_CACHE_DIR" not in env_of(container(docs["lab"], role))


@pytest.mark.parametrize("values", ["lab", "production"])
def test_a_roll_keeps_serving(docs: dict[str, list[dict[str, Any]]], values: str) -> None:
    for role in ROLES:
        d = deployment(docs[values], role)["spec"]
        rolling = d["strategy"]["rollingUpdate"]
        assert d["strategy"]["type"] == "RollingUpdate"
        assert rolling["maxUnavailable"] == 0 or d["replicas"] >= 2, role  # others serve on
        assert rolling["maxSurge"] + rolling["maxUnavailable"] == 1, role  # one pod at a time


# -- NATS and the secrets ----------------------------------------------------------------------
def _nats_hosts(replicas: int) -> list[str]:
    return [f"{RELEASE}-nats-{i}.{RELEASE}-nats.{NAMESPACE}.svc" for i in range(replicas)]


@pytest.mark.parametrize("values", ["lab", "production"])
def test_nats_is_a_statefulset_behind_a_headless_service(
        docs: dict[str, list[dict[str, Any]]], values: str) -> None:
    objs = docs[values]
    sts = find(objs, "StatefulSet", f"{RELEASE}-nats")
    headless = find(objs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert {p["port"] for p in headless["spec"]["ports"]} == {4222, natsauth.ROUTE_PORT, 8222}
    (nats,) = sts["spec"]["template"]["spec"]["containers"]
    assert nats["image"] == _load(LAB)["services"]["nats"]["image"]  # nats:2.10-alpine
    replicas = sts["spec"]["replicas"]
    hosts = _nats_hosts(replicas)
    tls = values == "production"
    scheme = "tls" if tls else "nats"
    for role in ROLES:
        env = env_of(container(objs, role))
        assert env["PDMESH_NATS_URL"] == ",".join(f"{scheme}://{h}:4222" for h in hosts)
        assert ("PDMESH_NATS_TLS_CA" in env) == tls
    config = "nats-cluster.conf" if tls else "nats.conf"
    assert f"--config=/run/secrets/{config}" in nats["args"]
    assert replicas == (3 if tls else 1)


def _secret_files(pod: dict[str, Any], mount: str) -> dict[str, tuple[str, str]]:
    """{path in the container: (secret, key)} of the projected volume mounted at `mount`."""
    (c,) = [c for c in pod["containers"]]
    (vm,) = [m for m in c["volumeMounts"] if m["mountPath"] == mount]
    (vol,) = [v for v in pod["volumes"] if v["name"] == vm["name"]]
    return {f"{mount}/{item['path']}": (src["secret"]["name"], item["key"])
            for src in vol["projected"]["sources"] for item in src["secret"]["items"]}


def test_the_secrets_pdmesh_secrets_writes_are_what_the_pods_mount(
        docs: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    """`pdmesh secrets --hosts <the NOTES' hosts>`, for real: every key the chart mounts from
    the files Secret is a file it writes (or tenants.toml, the operator's), at the path the
    configs name; the cluster config routes to exactly the StatefulSet's pods."""
    objs = docs["production"]
    hosts = _nats_hosts(3)
    natsauth.write_secrets(tmp_path, hosts=hosts)
    written = {p.name for p in tmp_path.iterdir() if p.is_file()} | {"tenants.toml"}
    sts = find(objs, "StatefulSet", f"{RELEASE}-nats")
    files = _secret_files(sts["spec"]["template"]["spec"], "/run/secrets")
    gateway = _secret_files(deployment(objs, "gateway")["spec"]["template"]["spec"],
                            "/run/secrets")
    for path, (secret, key) in {**files, **gateway}.items():
        assert secret == f"{RELEASE}-secrets" and key in written, (path, key)
    conf = (tmp_path / "nats-cluster.conf").read_text()
    for path in re.findall(r'"(/run/secrets/[^"]+)"', conf):
        assert path in files, path
    routes = re.search(r"routes: (\[.*\])", conf)
    assert routes
    assert [re.sub(r"//[^@]*@", "//", r) for r in yaml.safe_load(routes.group(1))] == [
        f"tls://{h}:{natsauth.ROUTE_PORT}" for h in hosts]
    (nats,) = sts["spec"]["template"]["spec"]["containers"]
    assert f"http: ${natsauth.MONITOR_ENV}" in conf and natsauth.MONITOR_ENV in env_of(nats)
    assert gateway["/run/secrets/tenants.toml"][1] == "tenants.toml"
    assert env_of(container(objs, "gateway"))["PDMESH_TENANTS_FILE"] == \
        "/run/secrets/tenants.toml"
    for role in ROLES:
        pod = deployment(objs, role)["spec"]["template"]["spec"]
        ca = env_of(container(objs, role))["PDMESH_NATS_TLS_CA"]
        assert _secret_files(pod, "/run/secrets")[ca] == (f"{RELEASE}-secrets",
                                                          "nats-ca.crt")


# -- tracing -----------------------------------------------------------------------------------
def _pdmesh_containers(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [container(objs, role) for role in ROLES]


def test_tracing_is_off_unless_an_endpoint_is_given(
        docs: dict[str, list[dict[str, Any]]]) -> None:
    for values in ("lab", "production"):
        for c in _pdmesh_containers(docs[values]):
            assert "PDMESH_OTLP_TRACES_ENDPOINT" not in env_of(c)
    url = "http://tempo.observability:4318/v1/traces"
    objs = objects(render({"tracing": {"otlpTracesEndpoint": url}}))
    for c in _pdmesh_containers(objs):
        assert env_of(c)["PDMESH_OTLP_TRACES_ENDPOINT"] == url
    assert BY_FIELD["otlp_traces_endpoint"].check(url) is None
    assert not [o for o in objs if o["metadata"]["name"].endswith("-jaeger")]


def test_the_labs_jaeger_receives_every_pods_traces(docs: dict[str, list[dict[str, Any]]]) -> None:
    objs = docs["full"]
    svc = find(objs, "Service", f"{RELEASE}-jaeger")
    ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    assert ports["otlp-http"] == 4318 and ports["ui"] == 16686
    jaeger = find(objs, "Deployment", f"{RELEASE}-jaeger")["spec"]["template"]["spec"]
    assert jaeger["containers"][0]["image"].startswith("jaegertracing/all-in-one:")
    for c in _pdmesh_containers(objs):
        assert env_of(c)["PDMESH_OTLP_TRACES_ENDPOINT"] == \
            f"http://{RELEASE}-jaeger:4318/v1/traces"


# -- CRDs: KEDA, Gateway API, Prometheus Operator (structure and references) -------------------
def _exported_metric(name: str, where: tuple[str, ...]) -> bool:
    """Whether a worker module under `where` names the gauge `name`: literally, or as an
    f-string such as f"pdmesh:decode_requests_{state}", whose placeholder stands for one
    lower-case word here (a check of names in the source, not of a running worker)."""
    for rel in where:
        base = REPO / rel
        for path in [base] if base.is_file() else sorted(base.rglob("*.py")):
            for pattern in re.findall(r"pdmesh:[a-z_{}]+", path.read_text()):
                regex = re.sub(r"\\\{[^}]*\\\}", "[a-z]+", re.escape(pattern))
                if re.fullmatch(regex, name):
                    return True
    return False


# Where each role's gauges are made (its service, and the worker base both roles run).
METRIC_SOURCES = {"prefill": ("services/prefill", "services/runtime/worker.py"),
                  "decode": ("services/decode", "services/runtime/worker.py")}
SCALED_ON = {"prefill": {"pdmesh:prefill_queued_prompt_tokens"},
             "decode": {"pdmesh:kv_cache_usage_perc", "pdmesh:decode_requests_running"}}


@pytest.mark.parametrize("role", WORKERS)
def test_keda_scales_each_worker_role_on_its_own_metrics(
        docs: dict[str, list[dict[str, Any]]], role: str) -> None:
    objs = docs["full"]
    so = find(objs, "ScaledObject", f"{RELEASE}-{role}")
    spec = so["spec"]
    target = spec["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
    scaled = find(objs, "Deployment", target["name"])
    assert scaled["metadata"]["labels"]["app.kubernetes.io/component"] == role
    assert "replicas" not in scaled["spec"]  # KEDA's; a helm upgrade must not reset it
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    metrics = set()
    for trigger in spec["triggers"]:
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        meta = trigger["metadata"]
        assert set(meta) >= {"serverAddress", "query", "threshold"}
        assert meta["serverAddress"].startswith(("http://", "https://"))
        assert float(meta["threshold"]) > 0 and isinstance(meta["threshold"], str)
        assert f'pod=~"{RELEASE}-{role}-.*"' in meta["query"]  # this role's pods only
        assert f'namespace="{NAMESPACE}"' in meta["query"]
        names = re.findall(r"pdmesh:[a-z_]+", meta["query"])
        assert names and all(_exported_metric(n, METRIC_SOURCES[role]) for n in names), names
        metrics.update(names)
    assert metrics == SCALED_ON[role]
    # Without KEDA the chart keeps its replica counts.
    assert deployment(docs["lab"], role)["spec"]["replicas"] == 1


def test_the_metric_check_can_tell_a_missing_metric() -> None:
    assert _exported_metric("pdmesh:decode_requests_running", METRIC_SOURCES["decode"])
    assert not _exported_metric("pdmesh:decode_requests_queued_tokens", METRIC_SOURCES["decode"])
    assert not _exported_metric("pdmesh:prefill_queued_prompt_tokens", METRIC_SOURCES["decode"])


def test_the_httproute_and_ingress_reach_the_gateways_api(
        docs: dict[str, list[dict[str, Any]]]) -> None:
    objs = docs["full"]
    svc = find(objs, "Service", f"{RELEASE}-gateway")
    (api,) = svc["spec"]["ports"]  # the API alone: never the metrics port, whatever the type
    assert port_number(container(objs, "gateway"), api["targetPort"]) == SPECS["gateway"].http_port
    route = find(objs, "HTTPRoute", f"{RELEASE}-gateway")["spec"]
    assert route["parentRefs"] and all(ref.get("name") for ref in route["parentRefs"])
    assert route["hostnames"] == ["pdmesh.example.com"]
    (rule,) = route["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert rule["backendRefs"] == [{"name": svc["metadata"]["name"], "port": api["port"]}]
    assert set(rule["timeouts"]) <= {"request", "backendRequest"}
    ingress = find(objs, "Ingress", f"{RELEASE}-gateway")["spec"]
    for rule in ingress["rules"]:
        for path in rule["http"]["paths"]:
            assert path["backend"]["service"] == {"name": svc["metadata"]["name"],
                                                  "port": {"name": "http"}}
    with pytest.raises(helm_python.HelmError, match="parentRefs"):
        render({"gateway": {"httpRoute": {"enabled": True}}})


def test_the_servicemonitor_scrapes_every_roles_metrics(
        docs: dict[str, list[dict[str, Any]]]) -> None:
    objs = docs["full"]
    monitor = find(objs, "ServiceMonitor", RELEASE)["spec"]
    assert monitor["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["endpoints"]
    assert endpoint["path"] == "/metrics"
    selector = monitor["selector"]["matchLabels"]
    selected = [o for o in objs if o["kind"] == "Service"
                and selector.items() <= o["metadata"]["labels"].items()]
    assert {o["spec"]["selector"]["app.kubernetes.io/component"] for o in selected} == set(ROLES)
    for svc in selected:
        role = svc["spec"]["selector"]["app.kubernetes.io/component"]
        (port,) = [p for p in svc["spec"]["ports"] if p["name"] == endpoint["port"]]
        spec = SPECS[role]
        assert port_number(container(objs, role), port["targetPort"]) == (
            spec.metrics_port or spec.http_port), role
        pod = deployment(objs, role)["spec"]["template"]
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(
            spec.metrics_port or spec.http_port)


# -- KV tiers: the disk volume and the store (docs/KVTIERS.md) --------------------------------
KV_TIER_ENV = ("PDMESH_KV_HOST_TOKENS", "PDMESH_KV_DISK_DIR", "PDMESH_KV_DISK_GIB",
               "PDMESH_KV_REMOTE_URL", "PDMESH_KV_REMOTE_TTL_S", "PDMESH_KV_REMOTE_TIMEOUT_S")
STORE = f"{RELEASE}-kvstore"
_UNITS = {"": 1, "k": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
          "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4}
_REDIS_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1024, "m": 1000**2, "mb": 1024**2,
                "g": 1000**3, "gb": 1024**3}


def _bytes(quantity: str | int, units: dict[str, int] = _UNITS) -> float:
    """A Kubernetes quantity (or, with _REDIS_UNITS, a Redis memory size) in bytes."""
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(quantity))
    assert match, quantity
    number, unit = match.groups()
    return float(number) * units[unit if units is _UNITS else unit.lower()]


def _validate(obj: dict[str, Any]) -> None:
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


def _store_objects(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if o["metadata"].get("labels", {}).get(
        "app.kubernetes.io/component") == "kvstore" or o["metadata"]["name"] == STORE]


def _args(c: dict[str, Any]) -> dict[str, str]:
    """redis-server's `--flag value` pairs."""
    argv = c["command"]
    assert argv[0] == "redis-server" and len(argv) % 2 == 1
    return dict(zip(argv[1::2], argv[2::2], strict=True))


def _pod_labels(d: dict[str, Any]) -> dict[str, str]:
    return d["spec"]["template"]["metadata"]["labels"]


def _kv_disk(objs: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The prefill container's PDMESH_KV_DISK_DIR and the volume mounted there."""
    pod = deployment(objs, "prefill")["spec"]["template"]["spec"]
    directory = env_of(container(objs, "prefill"))["PDMESH_KV_DISK_DIR"]
    (mount,) = [m for m in container(objs, "prefill")["volumeMounts"]
                if m["mountPath"] == directory]
    assert not mount.get("readOnly") and "subPath" not in mount
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return directory, volume


@pytest.mark.parametrize("values", ["lab", "production"])
def test_the_kv_store_is_a_redis_beside_the_prefill_pods(
        docs: dict[str, list[dict[str, Any]]], values: str) -> None:
    objs = docs[values]
    store = find(objs, "Deployment", STORE)
    svc = find(objs, "Service", STORE)
    for obj in (store, svc):
        _validate(obj)
    spec = store["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    (redis,) = pod["containers"]
    args = _args(redis)
    assert args["--maxmemory-policy"] == "allkeys-lru"
    assert (args["--appendonly"], args["--protected-mode"], args["--port"]) == ("no", "no", "6379")
    production = values == "production"
    assert args["--save"] == ("300 1" if production else "")  # snapshots only with a claim
    for probe in ("readinessProbe", "livenessProbe"):
        assert "redis-cli -p 6379 ping" in redis[probe]["exec"]["command"][-1], probe
    assert "PONG" in redis["readinessProbe"]["exec"]["command"][-1]
    # The official image's user, never root; nothing written outside /data.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == pod["securityContext"]["fsGroup"] == 999
    assert redis["securityContext"]["readOnlyRootFilesystem"] is True
    assert redis["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert args["--dir"] == "/data"
    (data,) = [v for v in pod["volumes"]
               if v["name"] == next(m["name"] for m in redis["volumeMounts"]
                                    if m["mountPath"] == "/data")]
    if production:
        claim = find(objs, "PersistentVolumeClaim", data["persistentVolumeClaim"]["claimName"])
        _validate(claim)
        assert _bytes(claim["spec"]["resources"]["requests"]["storage"]) >= 2 * _bytes(
            args["--maxmemory"], _REDIS_UNITS)  # a snapshot and the next one
    else:
        assert data == {"name": "data", "emptyDir": {}}
    # Memory: the limit leaves room above maxmemory (buffers, fragmentation, copy-on-write).
    maxmemory = _bytes(args["--maxmemory"], _REDIS_UNITS)
    resources = redis["resources"]
    assert _bytes(resources["requests"]["memory"]) >= maxmemory
    assert _bytes(resources["limits"]["memory"]) >= 1.25 * maxmemory
    # The Service reaches the pod's port, and prefill's URL names the Service.
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["selector"].items() <= _pod_labels(store).items()
    (port,) = svc["spec"]["ports"]
    assert port["port"] == 6379 and port_number(redis, port["targetPort"]) == 6379
    url = env_of(container(objs, "prefill"))["PDMESH_KV_REMOTE_URL"]
    assert url == f"redis://{STORE}:{port['port']}/0"
    assert BY_ENV["PDMESH_KV_REMOTE_URL"].check(url) is None


def test_the_kv_store_runs_as_composes(docs: dict[str, list[dict[str, Any]]]) -> None:
    service = _load(LAB)["services"]["kvstore"]
    (redis,) = find(docs["lab"], "Deployment", STORE)["spec"]["template"]["spec"]["containers"]
    assert redis["image"] == _compose_value(service["image"], {})  # redis:7.4-bookworm
    compose_args = _args({"command": [_compose_value(a, {}) for a in service["command"]]})
    chart_args = _args(redis)
    for flag in ("--maxmemory", "--maxmemory-policy", "--protected-mode", "--appendonly"):
        assert chart_args[flag] == compose_args[flag], flag
    assert service["healthcheck"]["test"][-2:] == ["redis-cli", "ping"]


@pytest.mark.parametrize("values", ["lab", "production", "full"])
def test_prefill_keeps_the_disk_tier_on_its_own_volume(
        docs: dict[str, list[dict[str, Any]]], values: str) -> None:
    objs = docs[values]
    env = env_of(container(objs, "prefill"))
    directory, volume = _kv_disk(objs)
    assert directory == "/var/lib/pdmesh/kv"
    size_gib = float(env["PDMESH_KV_DISK_GIB"])
    assert BY_ENV["PDMESH_KV_DISK_GIB"].check(size_gib) is None
    if values == "production":  # a per-pod claim, deleted with the pod
        assert "emptyDir" not in volume
        claim = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
        size = claim["resources"]["requests"]["storage"]
        assert claim["accessModes"] == ["ReadWriteOnce"]
    else:
        size = volume["emptyDir"]["sizeLimit"]
    # Room for what the tier keeps, and a little more (temporary files, file-system blocks):
    # the kubelet evicts a pod whose emptyDir outgrows its limit.
    assert 1.05 * size_gib * 2**30 <= _bytes(size) <= 1.5 * size_gib * 2**30, size


@pytest.mark.parametrize("values", sorted(VALUE_SETS))
def test_only_prefill_pods_get_the_kv_tiers(docs: dict[str, list[dict[str, Any]]],
                                            values: str) -> None:
    objs = docs[values]
    prefill = container(objs, "prefill")
    assert {"PDMESH_KV_DISK_DIR", "PDMESH_KV_REMOTE_URL"} <= set(env_of(prefill))
    for where, c in all_containers(objs):
        if c is prefill:
            continue
        names = [e["name"] for e in c.get("env", [])]
        assert not [n for n in names if n.startswith(("PDMESH_KV_REMOTE", "PDMESH_KV_DISK"))
                    or n == "PDMESH_KV_HOST_TOKENS"], where
    for role in ("admission", "decode", "gateway"):
        pod = deployment(objs, role)["spec"]["template"]["spec"]
        assert "kv-disk" not in [v["name"] for v in pod.get("volumes", [])], role


def test_the_kv_values_become_prefills_settings() -> None:
    objs = objects(render({"kvTiers": {"hostTokens": 1048576, "disk": {"sizeGiB": 7.5},
                                       "store": {"ttlS": 1000000, "timeoutS": 0.25}}}))
    env = env_of(container(objs, "prefill"))
    assert {k: env[k] for k in KV_TIER_ENV} == {
        "PDMESH_KV_HOST_TOKENS": "1048576", "PDMESH_KV_DISK_DIR": "/var/lib/pdmesh/kv",
        "PDMESH_KV_DISK_GIB": "7.5", "PDMESH_KV_REMOTE_URL": f"redis://{STORE}:6379/0",
        "PDMESH_KV_REMOTE_TTL_S": "1000000", "PDMESH_KV_REMOTE_TIMEOUT_S": "0.25"}
    for key in KV_TIER_ENV:  # each as the setting parses and checks it
        setting = BY_ENV[key]
        assert setting.check is None or setting.check(setting.kind(env[key])) is None, key
    # Unset: the program's defaults (docs/KVTIERS.md), not the chart's copy of them.
    lab = env_of(container(objects(render()), "prefill"))
    assert not {"PDMESH_KV_HOST_TOKENS", "PDMESH_KV_REMOTE_TTL_S",
                "PDMESH_KV_REMOTE_TIMEOUT_S"} & set(lab)


@pytest.mark.parametrize("enabled", [False, True])
def test_an_external_store_replaces_the_charts(enabled: bool) -> None:
    url = "rediss://:s3cret@redis.example.internal:6380/2"
    objs = objects(render({"kvTiers": {"store": {"enabled": enabled, "externalUrl": url,
                                                 "ttlS": 3600}}}))
    assert _store_objects(objs) == []
    env = env_of(container(objs, "prefill"))
    assert env["PDMESH_KV_REMOTE_URL"] == url
    assert env["PDMESH_KV_REMOTE_TTL_S"] == "3600"
    assert BY_ENV["PDMESH_KV_REMOTE_URL"].check(url) is None
    for obj in objs:
        if obj["kind"] not in CRD_KINDS:
            _validate(obj)


def test_without_a_store_prefill_has_no_remote_tier() -> None:
    rendered = render({"kvTiers": {"store": {"enabled": False, "ttlS": 3600, "timeoutS": 1}}})
    objs = objects(rendered)
    assert _store_objects(objs) == []
    env = env_of(container(objs, "prefill"))
    assert not [k for k in env if k.startswith("PDMESH_KV_REMOTE")]
    assert "PDMESH_KV_DISK_DIR" in env  # the disk tier is still there
    objs = objects(render({"kvTiers": {"disk": {"enabled": False}}}))
    env = env_of(container(objs, "prefill"))
    assert not [k for k in env if k.startswith("PDMESH_KV_DISK")]
    pod = deployment(objs, "prefill")["spec"]["template"]["spec"]
    assert "kv-disk" not in [v["name"] for v in pod.get("volumes", [])]
    assert "PDMESH_KV_REMOTE_URL" in env


def test_existing_claims_for_the_disk_and_the_store() -> None:
    objs = objects(render({"kvTiers": {"disk": {"existingClaim": "kv-disk-0"},
                                       "store": {"persistence": {"enabled": True,
                                                                 "existingClaim": "kvstore"}}}}))
    _directory, volume = _kv_disk(objs)
    assert volume["persistentVolumeClaim"] == {"claimName": "kv-disk-0"}
    pod = find(objs, "Deployment", STORE)["spec"]["template"]["spec"]
    (data,) = pod["volumes"]
    assert data["persistentVolumeClaim"] == {"claimName": "kvstore"}
    assert [o for o in objs if o["kind"] == "PersistentVolumeClaim"] == []  # the chart makes none
    for obj in (deployment(objs, "prefill"), find(objs, "Deployment", STORE)):
        _validate(obj)
    # One claim cannot be the directory of several workers: each tier's index is its own.
    for values in ({"prefill": {"replicas": 2}}, {"autoscaling": {"keda": {"enabled": True}}}):
        with pytest.raises(helm_python.HelmError, match="existingClaim"):
            render({**values, "kvTiers": {"disk": {"existingClaim": "kv-disk-0"}}})


@pytest.mark.parametrize("role", ROLES)
def test_kv_tier_settings_come_only_from_kvtiers(role: str) -> None:
    for key in KV_TIER_ENV:
        with pytest.raises(helm_python.HelmError, match="kvTiers"):
            render({role: {"settings": {key: "1"}}})


# -- the docs ----------------------------------------------------------------------------------
# Values that are Kubernetes objects as they are (documented as one row each).
OBJECT_VALUES = {"resources", "podSecurityContext", "securityContext", "strategy", "startup",
                 "readiness", "liveness"}
# The README's table writes a key of every role once: <role>.replicas, <worker>.dataPort.
TABLE_PLACEHOLDERS = {"<role>": ROLES, "<worker>": WORKERS}


def _leaf_keys(values: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and key not in OBJECT_VALUES:
            keys += _leaf_keys(value, f"{path}.")
        else:
            keys.append(path)
    return keys


def _table_keys(text: str) -> set[str]:
    keys = set()
    for match in re.finditer(r"^\| `([^`]+)` \|", text, re.M):
        key = match.group(1)
        for placeholder, names in TABLE_PLACEHOLDERS.items():
            if key.startswith(placeholder + "."):
                keys.update(key.replace(placeholder, name, 1) for name in names)
                break
        else:
            keys.add(key)
    return keys


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_the_readmes_hpa_example_is_valid(version: str) -> None:
    blocks = re.findall(r"```yaml\n(.*?)```", README.read_text(), re.S)
    (hpa,) = [yaml.safe_load(b) for b in blocks if "kind: HorizontalPodAutoscaler" in b]
    kubernetes_validate.validate(hpa, version, strict=True)
    assert hpa["spec"]["scaleTargetRef"]["name"] == f"{RELEASE}-prefill"


def test_the_readme_documents_every_value() -> None:
    table = _table_keys(README.read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    leaves = _leaf_keys(values)
    assert [k for k in leaves if k not in table] == []
    assert sorted(table - set(leaves)) == []  # and no value that the chart does not have
    assert "helm/README.md" in (REPO / "compose" / "README.md").read_text()
