"""The gateway's Prometheus series, named in the field's style (`pdmesh:` + vLLM-like names).

Outcomes of `requests_total` / `e2e_request_latency_seconds`: `finished`, `rejected`
(admission said no: context length, saturated, no workers), `invalid` (refused by the
gateway's own validation after authentication), `unavailable` (admission did not answer),
`failed` (admitted but not finished: worker failure or deadline), `client_gone`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram("pdmesh:time_to_first_token_seconds", "Time to first token",
                              ["tenant"], registry=registry, buckets=LATENCY_BUCKETS)
        self.itl = Histogram("pdmesh:inter_token_latency_seconds", "Inter-token latency",
                             ["tenant"], registry=registry, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("pdmesh:e2e_request_latency_seconds", "End-to-end latency",
                             ["tenant", "outcome"], registry=registry,
                             buckets=LATENCY_BUCKETS)
        self.requests = Counter("pdmesh:requests_total", "Requests by tenant and outcome",
                                ["tenant", "outcome"], registry=registry)
        self.tokens = Counter("pdmesh:tokens_total", "Tokens by tenant and kind",
                              ["tenant", "kind"], registry=registry)

    def request_done(self, tenant_id: str, outcome: str, elapsed_s: float) -> None:
        self.requests.labels(tenant_id, outcome).inc()
        self.e2e.labels(tenant_id, outcome).observe(elapsed_s)
