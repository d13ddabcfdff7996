"""The gateway's Prometheus series: vLLM's names and meaning under the `pdmesh:` prefix.

Every series carries `model_name` (the first served name), as vLLM's do, so a dashboard
or an autoscaler built for vLLM finds them by replacing `vllm:` with `pdmesh:`. The
gateway sees every request from arrival to last token, so it measures them for the mesh:

- queue time: the submit's arrival at admission to its dispatch, as admission measured it
  (admission holds a request that fits while every decode pool is busy, up to
  --queue-timeout-s); submit to admission's answer where admission does not say;
- prefill time: admitted to the first token (prefill compute and the KV transfer);
- decode time: first token to the last.

Where the time to first token goes, as the workers measured it (prefill's `PhaseTiming`,
sent once decode acked the KV, and decode's `TokenEvent.decode_first_token_s`):

- `pdmesh:request_prefill_queue_time_seconds`: dispatch received by prefill -> its first
  chunk started (waiting behind other prompts);
- `pdmesh:request_prefill_compute_time_seconds`: first chunk started -> last chunk computed;
- `pdmesh:request_kv_transfer_time_seconds`: the KV send's time to decode's ack, less the
  time it waited for chunks to be computed;
- `pdmesh:request_kv_transfer_exposed_time_seconds`: the part of the transfer after the
  last chunk was computed (what it adds to the TTFT when pages stream per chunk);
- `pdmesh:request_decode_first_token_time_seconds`: decode's verified commit -> first token
  published.

(Prefill exports the same figures per worker as `pdmesh:prefill_queue_time_seconds`, ...,
`pdmesh:kv_transfer_time_seconds`; the gateway's `request_` series see every request of
the mesh in one place, next to its TTFT.)

Together with `request_queue_time_seconds` (admission) they make the TTFT breakdown that
`pdmesh loadtest` prints (sums and counts scraped before and after a run).

`requests_total` / `e2e_request_latency_seconds` also carry `tenant` and the mesh's one
reason vocabulary (services/protocol/messages.py `Code`): `outcome` is the terminal state
(`finished`, `rejected`, `aborted`, `failed`) and `reason` the code's label, e.g. `stop`,
`length`, `context_length_exceeded`, `invalid` (the gateway's own validation),
`no_workers` (also when admission does not answer), `saturated`, `aborted` (client gone),
`deadline`, `transfer_failed`, `internal`.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdmesh.services.protocol import messages as m

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# Phases of a long prompt's TTFT run from milliseconds to minutes on a CPU.
PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                 60, 120, 300, 600)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)

# vLLM's finished_reason values: a finish is stop/length; anything else that ended an
# admitted request is an abort.
_FINISHED_REASON = {m.Code.STOP: "stop", m.Code.LENGTH: "length"}


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        r = registry

        def hist(name: str, doc: str, labels: list[str] | None = None,
                 buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(f"pdmesh:{name}", doc, ["model_name", *(labels or [])],
                             registry=r, buckets=buckets)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token", ["tenant"])
        self.itl = hist("inter_token_latency_seconds", "Time between token events",
                        ["tenant"])
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end latency",
                        ["tenant", "outcome", "reason"])
        self.queue_time = hist("request_queue_time_seconds",
                               "Submit's arrival at admission to its dispatch (waiting "
                               "for capacity)")
        self.prefill_time = hist("request_prefill_time_seconds",
                                 "Admitted to first token (prefill and KV transfer)")
        self.decode_time = hist("request_decode_time_seconds", "First token to last token")
        self.prefill_queue = hist("request_prefill_queue_time_seconds",
                                  "Prefill: dispatch received to first chunk started",
                                  buckets=PHASE_BUCKETS)
        self.prefill_compute = hist("request_prefill_compute_time_seconds",
                                    "Prefill: first chunk started to last chunk computed",
                                    buckets=PHASE_BUCKETS)
        self.kv_transfer = hist("request_kv_transfer_time_seconds",
                                "KV transfer: first page sent to decode's ack",
                                buckets=PHASE_BUCKETS)
        self.kv_transfer_exposed = hist("request_kv_transfer_exposed_time_seconds",
                                        "KV transfer left after the last chunk was computed",
                                        buckets=PHASE_BUCKETS)
        self.decode_first_token = hist("request_decode_first_token_time_seconds",
                                       "Decode: verified commit to first token published",
                                       buckets=PHASE_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per finished request",
                               buckets=TOKEN_BUCKETS)
        self.generation_len = hist("request_generation_tokens",
                                   "Generated tokens per finished request",
                                   buckets=TOKEN_BUCKETS)
        self.requests = Counter("pdmesh:requests_total", "Requests by tenant and outcome",
                                ["model_name", "tenant", "outcome", "reason"], registry=r)
        self.success = Counter("pdmesh:request_success_total",
                               "Admitted requests by how they ended (vLLM finished_reason)",
                               ["model_name", "finished_reason"], registry=r)
        self.tokens = Counter("pdmesh:tokens_total", "Tokens by tenant and kind",
                              ["model_name", "tenant", "kind"], registry=r)
        self.prompt_tokens = Counter("pdmesh:prompt_tokens_total", "Prefilled prompt tokens",
                                     ["model_name"], registry=r)
        self.generation_tokens = Counter("pdmesh:generation_tokens_total",
                                         "Generated tokens", ["model_name"], registry=r)
        self.running = Gauge("pdmesh:num_requests_running",
                             "Requests generating tokens (first token seen)", ["model_name"],
                             registry=r)
        self.waiting = Gauge("pdmesh:num_requests_waiting",
                             "Requests submitted and waiting for their first token "
                             "(admission queue, prefill, KV transfer)", ["model_name"],
                             registry=r)
        self.migrated = Counter(
            "pdmesh:requests_migrated_total", "Choices resumed on other workers after one "
            "serving them was lost (from_role) by cause (worker_lost: died or cut off; "
            "worker_drained: drained past its timeout)", ["model_name", "from_role", "cause"],
            registry=r)
        self.migration_failed = Counter(
            "pdmesh:request_migrations_failed_total", "Resumes that could not be made "
            "(reason: the rejection's or failure's code)", ["model_name", "reason"],
            registry=r)
        self.migration_gap = hist(
            "migration_gap_seconds", "A resumed choice's gap: its last token (or the loss, "
            "before any token) to its first token from the new workers",
            buckets=PHASE_BUCKETS)
        self.running.labels(model_name)
        self.waiting.labels(model_name)

    def request_done(self, tenant_id: str, outcome: m.Outcome, elapsed_s: float,
                     admitted: bool = False) -> None:
        labels = (tenant_id, outcome.kind.name.lower(), outcome.label)
        self.requests.labels(self.model_name, *labels).inc()
        self.e2e.labels(self.model_name, *labels).observe(elapsed_s)
        if admitted:
            reason = _FINISHED_REASON.get(outcome.code, "abort")
            self.success.labels(self.model_name, reason).inc()

    def observe_phases(self, timing: m.PhaseTiming) -> None:
        """One request's prefill-side phases (prefill's PhaseTiming)."""
        name = self.model_name
        for hist, seconds in ((self.prefill_queue, timing.queue_s),
                              (self.prefill_compute, timing.prefill_s),
                              (self.kv_transfer, timing.transfer_s),
                              (self.kv_transfer_exposed, timing.exposed_transfer_s)):
            _observe(hist.labels(name), seconds)

    def observe_decode_first_token(self, seconds: float) -> None:
        """Decode's commit -> first token of one request (TokenEvent seq 0)."""
        _observe(self.decode_first_token.labels(self.model_name), seconds)

    def tokens_done(self, tenant_id: str, prompt_tokens: int, generated: int) -> None:
        name = self.model_name
        self.tokens.labels(name, tenant_id, "prompt").inc(prompt_tokens)
        self.tokens.labels(name, tenant_id, "completion").inc(generated)
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(generated)
        self.prompt_len.labels(name).observe(prompt_tokens)
        self.generation_len.labels(name).observe(generated)


def _observe(hist: Histogram, seconds: float) -> None:
    """A worker's figure is input: only a finite, non-negative one is observed."""
    if math.isfinite(seconds) and seconds >= 0:
        hist.observe(seconds)
