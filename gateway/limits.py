"""Each tenant's limits at the gateway: requests in flight, and request and token rates.

The limits come from the tenants file (tenants.py `TenantLimits`). Each is checked before
the request's submit leaves the gateway; a request over one is answered 429
`rate_limit_error` with the limit named in its `code` (`tenant_max_concurrent`,
`tenant_requests_per_s`, `tenant_tokens_per_s`) and message, and a `Retry-After` header.
Nothing is consumed by a refused request. Each gateway replica counts for itself: behind a
load balancer spreading over G gateways, a tenant may have G times these figures. The
tenant's share of decode KV and its weight are admission's (fairqueue.py, service.py).

Rates are token buckets one second deep: a bucket refills at `rate` per second up to `rate`
and a request takes its cost from it (requests: 1; tokens: prompt + max_tokens for each
choice). A request costing more than a full bucket waits for a full one and leaves it in
debt, so no request is too large for a rate; it only waits longer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdmesh.gateway.schema import ApiError
from pdmesh.gateway.tenants import Tenant


@dataclass
class RateBucket:
    rate: float  # per second; the bucket holds one second of it
    level: float  # what is in it (negative: in debt)
    at: float  # time.monotonic() of `level`

    def wait_s(self, cost: float, now: float) -> float:
        """Seconds until `cost` may be taken (0: now)."""
        self.level = min(self.rate, self.level + max(now - self.at, 0.0) * self.rate)
        self.at = max(now, self.at)
        need = min(cost, self.rate)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, cost: float) -> None:
        self.level -= cost


class TenantLimiter:
    def __init__(self) -> None:
        self._in_flight: dict[str, int] = {}  # tenant id -> choices in flight
        self._requests: dict[str, RateBucket] = {}
        self._tokens: dict[str, RateBucket] = {}

    def in_flight(self, tenant_id: str) -> int:
        return self._in_flight.get(tenant_id, 0)

    def admit(self, tenant: Tenant, choices: int, tokens: int,
              now: float | None = None) -> None:
        """Count a request of `choices` choices and `tokens` tokens (prompt + max_tokens,
        all choices) against its tenant's limits until `release`, or raise the 429 of the
        first limit it is over (and count nothing)."""
        lim, tid = tenant.limits, tenant.tenant_id
        now = time.monotonic() if now is None else now
        held = self._in_flight.get(tid, 0)
        if held and held + choices > lim.max_concurrent:  # guard: tenant-concurrency
            raise _over(tenant, "max_concurrent", f"{lim.max_concurrent} requests in flight "
                        f"(it has {held}{'' if choices == 1 else f'; this one is {choices}'})",
                        1.0)
        buckets = []
        for key, rate, table, cost in (("requests_per_s", lim.requests_per_s, self._requests, 1),
                                       ("tokens_per_s", lim.tokens_per_s, self._tokens, tokens)):
            if rate > 0:
                bucket = table.get(tid) or table.setdefault(tid, RateBucket(rate, rate, now))
                wait = bucket.wait_s(cost, now)
                if wait > 0:  # guard: tenant-rate
                    raise _over(tenant, key, f"{rate:g} {key.removesuffix('_per_s')} per "
                                "second", wait)
                buckets.append((bucket, cost))
        for bucket, cost in buckets:
            bucket.take(cost)
        self._in_flight[tid] = held + choices

    def release(self, tenant_id: str, choices: int) -> None:
        """The request `admit` counted has ended."""
        left = self._in_flight.get(tenant_id, 0) - choices
        if left > 0:
            self._in_flight[tenant_id] = left
        else:
            self._in_flight.pop(tenant_id, None)


def _over(tenant: Tenant, key: str, what: str, retry_after_s: float) -> ApiError:
    return ApiError(429, f"tenant {tenant.tenant_id!r} is at its {key} limit ({what}); retry "
                    f"after {retry_after_s:.1f} s", type_="rate_limit_error",
                    code=f"tenant_{key}", retry_after_s=retry_after_s)
