"""Read the live workers' pool state over NATS, as the gateway tests need it.

Worker ids come from their heartbeats; each worker answers `stats_subject(role, id)` with a
`StatsReply` (leased pages, live leases, integrity). Local to tests/gateway on purpose.
"""

from __future__ import annotations

import asyncio
import time

import nats

from pdmesh.services.protocol import messages as m
from tests.support import meshstats


class MeshWorkers:
    """A NATS connection that knows the mesh's prefill/decode workers and asks their stats."""

    def __init__(self, nc: nats.NATS, workers: dict[str, m.Role]) -> None:
        self.nc = nc
        self.workers = workers
        self._decoder = m.Decoder(m.StatsReply)

    @classmethod
    async def connect(cls, nats_url: str, timeout_s: float = 5.0) -> MeshWorkers:
        """Connect and wait for at least one prefill and one decode heartbeat."""
        nc = await meshstats.connect(nats_url)
        workers: dict[str, m.Role] = {}
        beats = m.Decoder(m.Heartbeat)

        async def on_beat(msg) -> None:
            beat = beats.decode(msg.subject, msg.data)
            if beat.role in (m.Role.PREFILL, m.Role.DECODE):
                workers[beat.worker_id] = beat.role

        sub = await nc.subscribe(m.HEARTBEAT_WILDCARD, cb=on_beat)
        deadline = time.monotonic() + timeout_s
        try:
            while {m.Role.PREFILL, m.Role.DECODE} - set(workers.values()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no prefill+decode heartbeats in {timeout_s}s: "
                                       f"{workers}")
                await asyncio.sleep(0.05)
        except BaseException:
            await nc.close()
            raise
        finally:
            await sub.unsubscribe()
        return cls(nc, workers)

    def ids(self, role: m.Role) -> list[str]:
        return sorted(w for w, r in self.workers.items() if r == role)

    async def stats(self, role: m.Role) -> list[m.StatsReply]:
        replies = []
        for worker_id in self.ids(role):
            msg = await self.nc.request(m.stats_subject(role, worker_id), b"", timeout=2.0)
            replies.append(self._decoder.decode(msg.subject, msg.data))
        return replies

    async def close(self) -> None:
        await self.nc.close()
