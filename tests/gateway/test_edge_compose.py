"""The compose stacks keep the gateway's metrics and every service's /metrics and /health off
public interfaces: the lab exposes the metrics port inside its network only, and on host
networking (multi-host, the UCX override) nothing but the API and the data plane listens on
every interface."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from pdmesh.services.ops import natsauth
from pdmesh.services.ops.topology import mesh_services

COMPOSE = Path(__file__).resolve().parents[2] / "compose"
EVERYWHERE = ("0.0.0.0", "::", "")


def _services(path: Path) -> dict[str, dict[str, Any]]:
    return yaml.safe_load(path.read_text())["services"]


def test_the_lab_exposes_the_gateway_metrics_port_inside_its_network_only() -> None:
    gateway = _services(COMPOSE / "docker-compose.yml")["gateway"]
    spec = mesh_services()[-1]
    assert gateway["ports"] == [f"${{PDMESH_GATEWAY_PUBLISH:-8000}}:{spec.http_port}"]
    assert gateway["expose"] == [str(spec.metrics_port)]
    assert gateway["environment"]["PDMESH_METRICS_PORT"] == str(spec.metrics_port)
    prometheus = yaml.safe_load((COMPOSE / "observability/prometheus.yml").read_text())
    job = next(j for j in prometheus["scrape_configs"] if j["job_name"] == "gateway")
    assert job["dns_sd_configs"][0]["port"] == spec.metrics_port


@pytest.mark.parametrize("name", ["control", "prefill", "decode"])
def test_multihost_services_bind_their_http_port_to_the_cluster_address(name: str) -> None:
    for service, svc in _services(COMPOSE / "multihost" / f"{name}.yml").items():
        if svc.get("command", [None])[0] != "pdmesh":
            continue
        env = svc["environment"]
        if service == "gateway":  # the API is public; its metrics are not
            assert env["PDMESH_HTTP_HOST"] == "0.0.0.0"
            assert env["PDMESH_METRICS_HOST"] == "${CONTROL_HOST:?}"
            continue
        host = env.get("PDMESH_HTTP_HOST", "127.0.0.1")
        assert host not in EVERYWHERE and host.startswith("${"), (service, host)
        assert svc["healthcheck"]["test"][-1].startswith(f"http://{host}:"), service


def test_the_ucx_override_keeps_host_network_workers_http_on_loopback() -> None:
    lab, ucx = _services(COMPOSE / "docker-compose.yml"), _services(
        COMPOSE / "docker-compose.ucx.yml")
    for name in ("prefill", "decode"):
        assert ucx[name]["network_mode"] == "host"
        env = {**lab[name]["environment"], **ucx[name]["environment"]}
        assert env["PDMESH_HTTP_HOST"] == "127.0.0.1", name
        assert lab[name]["healthcheck"]["test"][-1].startswith("http://127.0.0.1:")


@pytest.mark.parametrize("name", ["control", "prefill", "decode"])
def test_multihost_nats_monitoring_listens_on_the_cluster_address_only(name: str) -> None:
    """The NATS nodes' monitoring (/routez, /connz: every connection's address and user)
    binds to the node's cluster address: the shared config reads it from each node's
    environment, and no `--http_port` flag (every interface) is given."""
    nats = _services(COMPOSE / "multihost" / f"{name}.yml")["nats"]
    assert not any(str(a).startswith(("--http_port", "-m")) for a in nats["command"])
    listen = nats["environment"][natsauth.MONITOR_ENV]
    host = f"${{{name.upper()}_HOST:?}}"
    assert listen == f"{host}:8222"
    assert nats["healthcheck"]["test"][-1] == f"http://{host}:8222/healthz"
    conf = natsauth.cluster_server_config([], ["10.0.0.1"], "pw", "/run/secrets")
    assert f"http: ${natsauth.MONITOR_ENV}\n" in conf
