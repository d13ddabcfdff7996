"""The one definition of which processes make a mesh.

`pdmesh up` launches exactly these, and the lab compose file is checked against them (parity
test), so the local run exercises the same commands and environment compose runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

SERVICES = ("admission", "prefill", "decode", "colocated", "gateway")
# The gateway's metrics port, by convention its API port + 100 (8100 for 8000): where
# `pdmesh up` and compose put it, and where `pdmesh loadtest` looks by default.
METRICS_PORT_OFFSET = 100


def metrics_port_for(gateway_port: int) -> int:
    """The conventional metrics port of a gateway on `gateway_port` (0: none fits)."""
    port = gateway_port + METRICS_PORT_OFFSET
    return port if gateway_port > 0 and port <= 65535 else 0


@dataclass(frozen=True)
class ServiceSpec:
    """One process of the mesh."""

    name: str  # unique process name: admission, prefill-0, decode-1, gateway
    role: str  # admission | prefill | decode | gateway
    command: tuple[str, ...]  # argv after the executable: ("serve", "<role>")
    env: dict[str, str] = field(default_factory=dict)  # PDMESH_* settings for this process
    http_port: int = 0  # where /ready answers
    metrics_port: int = 0  # the gateway: where /metrics answers (0: the HTTP port)

    @property
    def argv(self) -> tuple[str, ...]:
        """The full command line as compose runs it."""
        return ("pdmesh", *self.command)


def mesh_services(*, prefill: int = 1, decode: int = 1,
                  port_for: Callable[[str, int], int] | None = None,
                  gateway_port: int = 8000, colocated: bool = False,
                  metrics_port: int | None = None) -> list[ServiceSpec]:
    """Admission, `prefill` prefill workers, `decode` decode workers and the gateway.

    `port_for(role, index)` gives each worker's HTTP port; by default the role's fixed
    port (one worker per role per host, as in compose with its own network namespace).
    Startup order matters: admission first (it must hear the workers' first heartbeats),
    the gateway last. `colocated`: one colocated worker (prefill + decode in one process,
    no KV transfer) replaces the prefill and decode workers: the baseline mesh.
    `metrics_port`: the gateway's (default: `metrics_port_for(gateway_port)`).
    """
    defaults = {"admission": 8101, "prefill": 8102, "decode": 8103, "colocated": 8104}

    def port(role: str, i: int) -> int:
        return port_for(role, i) if port_for else defaults[role]

    specs = [ServiceSpec("admission", "admission", ("serve", "admission"),
                         {"PDMESH_HTTP_PORT": str(port("admission", 0))},
                         port("admission", 0))]
    workers = (("colocated", 1),) if colocated else (("prefill", prefill), ("decode", decode))
    for role, count in workers:
        for i in range(count):
            name = f"{role}-{i}" if count > 1 else role
            specs.append(ServiceSpec(name, role, ("serve", role),
                                     {"PDMESH_HTTP_PORT": str(port(role, i))}, port(role, i)))
    metrics = metrics_port_for(gateway_port) if metrics_port is None else metrics_port
    specs.append(ServiceSpec("gateway", "gateway", ("serve", "gateway"),
                             {"PDMESH_GATEWAY_PORT": str(gateway_port),
                              "PDMESH_METRICS_PORT": str(metrics)}, gateway_port, metrics))
    return specs
