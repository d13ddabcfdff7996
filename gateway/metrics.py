"""The gateway's Prometheus series, named in the field's style (`pdmesh:` + vLLM-like names).

`requests_total` / `e2e_request_latency_seconds` are labelled with the mesh's one reason
vocabulary (services/messages.py `Code`): `outcome` is the terminal state (`finished`,
`rejected`, `aborted`, `failed`) and `reason` the code's label, e.g. `stop`, `length`,
`context_length_exceeded`, `invalid` (the gateway's own validation), `no_workers` (also when
admission does not answer), `saturated`, `aborted` (client gone), `deadline`,
`transfer_failed`, `internal`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from pdmesh.services import messages as m

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram("pdmesh:time_to_first_token_seconds", "Time to first token",
                              ["tenant"], registry=registry, buckets=LATENCY_BUCKETS)
        self.itl = Histogram("pdmesh:inter_token_latency_seconds", "Inter-token latency",
                             ["tenant"], registry=registry, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("pdmesh:e2e_request_latency_seconds", "End-to-end latency",
                             ["tenant", "outcome", "reason"], registry=registry,
                             buckets=LATENCY_BUCKETS)
        self.requests = Counter("pdmesh:requests_total", "Requests by tenant and outcome",
                                ["tenant", "outcome", "reason"], registry=registry)
        self.tokens = Counter("pdmesh:tokens_total", "Tokens by tenant and kind",
                              ["tenant", "kind"], registry=registry)

    def request_done(self, tenant_id: str, outcome: m.Outcome, elapsed_s: float) -> None:
        labels = (tenant_id, outcome.kind.name.lower(), outcome.label)
        self.requests.labels(*labels).inc()
        self.e2e.labels(*labels).observe(elapsed_s)
