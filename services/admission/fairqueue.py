"""Admission's waiting line across tenants: start-time fair queueing.

Every submit enters the line with a start tag: the later of the line's virtual time and
its tenant's previous finish tag; its own finish tag is the start plus its cost over the
tenant's weight (cost: the decode KV it asks for, prompt + max_tokens for each of its
choices). The line serves the eligible waiter with the smallest start tag (arrival order
among equals), and serving one moves the virtual time up to its start tag.

So a tenant that sends ten times its share has tags ten times as far ahead, and another
tenant's next request, tagged at the virtual time, goes before all of them; a tenant idle
for a while gets no credit for it (its next tag starts at the virtual time); a weight-2
tenant's tags advance half as fast. Goyal, Vin and Cheng's SFQ: fair whatever the costs,
with no per-round quantum to tune as deficit round robin has.

Priority (vLLM's `priority`, lower first) orders a tenant's own waiters: when the line's
next is a tenant's, its eligible waiter of the best priority (then the earliest) takes that
place, the two swapping tags; the tenant's place among the others stays where its share
puts it, so a priority never buys a tenant more than its share.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Waiter:
    tenant: str
    start: float
    finish: float
    seq: int
    item: Any = field(default=None, repr=False)  # the submit it stands for
    priority: int = 0  # lower first, among its tenant's own waiters

    @property
    def order(self) -> tuple[float, int]:
        return (self.start, self.seq)


class FairQueue:
    def __init__(self) -> None:
        self.virtual_time = 0.0
        self._finish: dict[str, float] = {}  # tenant -> its last waiter's finish tag
        self._waiting: list[Waiter] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._waiting)

    def enter(self, tenant: str, cost: float, weight: float = 1.0, item: Any = None,
              priority: int = 0) -> Waiter:
        if weight <= 0 or cost < 0:
            raise ValueError(f"weight must be > 0 and cost >= 0, got {weight}, {cost}")
        start = max(self.virtual_time, self._finish.get(tenant, 0.0))
        waiter = Waiter(tenant, start, start + cost / weight, next(self._seq), item,
                        priority)
        self._finish[tenant] = waiter.finish
        self._waiting.append(waiter)
        return waiter

    def first(self, eligible: Callable[[Waiter], bool] = lambda _w: True) -> Waiter | None:
        """The eligible waiter to serve next, or None. `eligible` is asked in the line's
        order and no further than the first yes (each waiting submit asks on every wake).
        The first's tenant's eligible waiter of a better priority takes its place (their
        tags swapped: asked again, the answer is the same)."""
        line = sorted(self._waiting, key=lambda w: w.order)
        first = next((w for w in line if eligible(w)), None)
        if first is None:
            return None
        better = next((w for w in sorted(line, key=lambda w: (w.priority, w.order))
                       if w.tenant == first.tenant and w.priority < first.priority
                       and eligible(w)), None)
        if better is None:
            return first
        first.start, better.start = better.start, first.start
        first.finish, better.finish = better.finish, first.finish
        first.seq, better.seq = better.seq, first.seq
        return better

    def leave(self, waiter: Waiter, served: bool) -> None:
        """`waiter` is out of the line: admitted (`served`) or given up."""
        try:
            self._waiting.remove(waiter)
        except ValueError:
            return
        if served:
            self.virtual_time = max(self.virtual_time, waiter.start)
        elif self._finish.get(waiter.tenant) == waiter.finish:
            self._finish[waiter.tenant] = waiter.start  # its tenant's last: no charge
        waiting = {w.tenant for w in self._waiting}
        for tenant in [t for t, f in self._finish.items()
                       if t not in waiting and f <= self.virtual_time]:
            del self._finish[tenant]  # its next tag starts at the virtual time anyway
