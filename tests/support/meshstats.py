"""Read the mesh's own accounting over NATS: heartbeats (who is live) and StatsReply."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import unquote, urlsplit

import nats

from pdmesh.services.protocol import messages as m


async def connect(nats_url: str, **kwargs) -> nats.NATS:
    """nats.connect with the inbox prefix of the URL's user (each NATS user may read only its
    own replies: services/ops/natsauth.py)."""
    user = unquote(urlsplit(nats_url.split(",")[0]).username or "")
    return await nats.connect(nats_url, inbox_prefix=m.inbox_prefix(user), **kwargs)


async def _heartbeats(nc: nats.NATS, listen_s: float) -> dict[str, m.Heartbeat]:
    dec = m.Decoder(m.Heartbeat)
    seen: dict[str, m.Heartbeat] = {}

    async def cb(msg) -> None:
        beat = dec.decode(msg.subject, msg.data)
        seen[beat.worker_id] = beat

    sub = await nc.subscribe(m.HEARTBEAT_WILDCARD, cb=cb)
    await asyncio.sleep(listen_s)
    await sub.unsubscribe()
    return seen


async def _heartbeats_at(nats_url: str, listen_s: float) -> dict[str, m.Heartbeat]:
    nc = await connect(nats_url)
    try:
        return await _heartbeats(nc, listen_s)
    finally:
        await nc.close()


def heartbeats(nats_url: str, listen_s: float = 1.2) -> dict[str, m.Heartbeat]:
    """The latest heartbeat of every worker heard within `listen_s` (by worker id)."""
    return asyncio.run(_heartbeats_at(nats_url, listen_s))


async def _stats(nats_url: str, listen_s: float) -> dict[str, m.StatsReply]:
    nc = await connect(nats_url)
    try:
        beats = await _heartbeats(nc, listen_s)
        out: dict[str, m.StatsReply] = {}
        dec = m.Decoder(m.StatsReply)
        for wid, beat in beats.items():
            try:
                reply = await nc.request(m.stats_subject(beat.role.value, wid), b"", timeout=2)
            except Exception:  # noqa: BLE001 - a worker that just died has no stats
                continue
            out[wid] = dec.decode("stats", reply.data)
        return out
    finally:
        await nc.close()


async def _query(nats_url: str, workers: list[tuple[m.Role, str]]) -> list[m.StatsReply]:
    nc = await connect(nats_url)
    out = []
    try:
        dec = m.Decoder(m.StatsReply)
        for role, wid in workers:
            try:
                reply = await nc.request(m.stats_subject(role.value, wid), b"", timeout=1)
            except Exception:  # noqa: BLE001 - a worker that just died has no stats
                continue
            out.append(dec.decode("stats", reply.data))
        return out
    finally:
        await nc.close()


def query_stats(nats_url: str, workers: list[tuple[m.Role, str]]) -> list[m.StatsReply]:
    """Ask known workers directly (no heartbeat listening: milliseconds, not a second)."""
    return asyncio.run(_query(nats_url, workers))


def worker_stats(nats_url: str, listen_s: float = 1.2) -> dict[str, m.StatsReply]:
    """StatsReply of every prefill/decode worker heard heartbeating within `listen_s`."""
    return asyncio.run(_stats(nats_url, listen_s))


def by_role(stats: dict[str, m.StatsReply], role: m.Role) -> list[m.StatsReply]:
    return [s for s in stats.values() if s.role is role]


def counter(stats: dict[str, m.StatsReply], role: m.Role, name: str) -> float:
    return sum(s.counters.get(name, 0.0) for s in by_role(stats, role))


def wait_pools_idle(nats_url: str, timeout_s: float = 5.0) -> dict[str, m.StatsReply]:
    """Wait until every worker holds no lease; return the last stats (raise on timeout)."""
    deadline = time.monotonic() + timeout_s
    stats: dict[str, m.StatsReply] = {}
    while time.monotonic() < deadline:
        stats = worker_stats(nats_url, listen_s=0.6)
        if stats and all(s.live_leases == 0 for s in stats.values()):
            return stats
        time.sleep(0.1)
    held = {w: (s.live_leases, s.leased_pages) for w, s in stats.items() if s.live_leases}
    raise AssertionError(f"leases still held after {timeout_s}s: {held}")


def assert_pools_clean(nats_url: str, timeout_s: float = 5.0) -> None:
    """Every lease returned and every pool's integrity check passes (nothing leaked)."""
    stats = wait_pools_idle(nats_url, timeout_s)
    for wid, s in stats.items():
        assert s.integrity_ok, f"{wid}: {s.integrity_error}"
        assert s.leased_pages == 0, (wid, s)
