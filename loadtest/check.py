"""`pdmesh check`: each live worker's configured context vs its real KV pool (invariant I5).

Listens to the workers' heartbeats for `--listen-s` seconds (they carry live pool figures,
never configuration), optionally asks each worker for its stats (leases, pool integrity),
and prints one row per worker. A worker whose configured context exceeds its real pool is
shown as CLAMPED (or OVER POOL if it serves more than its pool holds: that would be the
2026 incident's shape and must never happen).

The figures are checked here independently of the worker's own `capacity_mismatch` flag:
configured > pool or served > pool is a mismatch even if the flag was not set.

Exit codes:
  0  at least one prefill and one decode worker answered, no mismatch, pools intact
  1  a capacity mismatch (clamped or worse) or a failed pool integrity check was seen
  2  NATS unreachable, no worker answered, or no prefill / no decode worker answered
With `--json` the last stdout line is one JSON object (also on exit 1 and 2).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import nats

from pdmesh.services import messages as m

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
WORKER_ROLES = (m.Role.PREFILL, m.Role.DECODE)

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_UNREACHABLE = 2


# ---------------------------------------------------------------------------------------
# Pure logic: rows, verdict, formatting (unit-tested without NATS)
# ---------------------------------------------------------------------------------------
@dataclass
class WorkerRow:
    """One worker as `pdmesh check` reports it, from its latest heartbeat (+ stats)."""

    beat: m.Heartbeat
    beats_seen: int = 1
    last_seen: float = 0.0  # monotonic
    stats: m.StatsReply | None = None
    stats_error: str = ""

    @property
    def mismatch(self) -> bool:
        b = self.beat
        return (b.capacity_mismatch or b.configured_context > b.pool_capacity_tokens
                or b.served_context > b.pool_capacity_tokens)

    @property
    def over_pool(self) -> bool:
        """Serves a context its pool cannot hold: must never happen (the incident's shape)."""
        return self.beat.served_context > self.beat.pool_capacity_tokens

    @property
    def mismatch_label(self) -> str:
        if self.over_pool:
            return "OVER POOL"
        if self.mismatch:
            return "CLAMPED"
        return "ok"

    @property
    def integrity_failed(self) -> bool:
        return self.stats is not None and not self.stats.integrity_ok

    def as_dict(self) -> dict[str, Any]:
        b = self.beat
        out: dict[str, Any] = {
            "role": b.role.value, "worker_id": b.worker_id, "model": b.model,
            "configured_context": b.configured_context,
            "pool_capacity_tokens": b.pool_capacity_tokens,
            "served_context": b.served_context, "capacity_mismatch": self.mismatch,
            "mismatch": self.mismatch_label, "flagged_by_worker": b.capacity_mismatch,
            "free_tokens": b.available_tokens, "page_tokens": b.page_tokens,
            "queue_depth": b.queue_depth, "active_requests": b.active_requests,
            "data_address": b.data_address, "http_address": b.http_address,
            "ready": b.ready, "draining": b.draining, "beats_seen": self.beats_seen,
            "stats": None, "stats_error": self.stats_error,
        }
        if self.stats is not None:
            s = self.stats
            out["stats"] = {
                "live_leases": s.live_leases, "leased_pages": s.leased_pages,
                "free_pages": s.free_pages, "cached_pages": s.cached_pages,
                "total_pages": s.total_pages,
                "integrity_ok": s.integrity_ok, "integrity_error": s.integrity_error,
                "counters": dict(s.counters)}
        return out


class Collector:
    """Folds heartbeats into one row per worker (latest beat wins)."""

    def __init__(self) -> None:
        self.rows: dict[str, WorkerRow] = {}
        self.bad_messages = 0

    def observe(self, beat: m.Heartbeat, now: float | None = None) -> None:
        if beat.role not in WORKER_ROLES:
            return
        now = time.monotonic() if now is None else now
        row = self.rows.get(beat.worker_id)
        if row is None:
            self.rows[beat.worker_id] = WorkerRow(beat=beat, last_seen=now)
        else:
            row.beat, row.last_seen = beat, now
            row.beats_seen += 1

    def sorted_rows(self) -> list[WorkerRow]:
        order = {r: i for i, r in enumerate(WORKER_ROLES)}
        return sorted(self.rows.values(), key=lambda r: (order[r.beat.role], r.beat.worker_id))


@dataclass(frozen=True)
class Verdict:
    code: int
    message: str
    problems: list[str] = field(default_factory=list)


def verdict(rows: Iterable[WorkerRow]) -> Verdict:
    """Exit code and one-line summary for what was seen."""
    rows = list(rows)
    if not rows:
        return Verdict(EXIT_UNREACHABLE, "no worker answered (no heartbeat seen)")
    problems: list[str] = []
    for r in rows:
        b = r.beat
        if r.over_pool:
            problems.append(f"{b.worker_id}: serves context {b.served_context} > real pool "
                            f"{b.pool_capacity_tokens} tokens (NOT clamped)")
        elif r.mismatch:
            problems.append(f"{b.worker_id}: configured context {b.configured_context} > real "
                            f"pool {b.pool_capacity_tokens} tokens; CLAMPED to "
                            f"{b.served_context}")
        if r.integrity_failed:
            problems.append(f"{b.worker_id}: KV pool integrity check FAILED: "
                            f"{r.stats.integrity_error if r.stats else ''}")
    if problems:
        return Verdict(EXIT_PROBLEM, f"{len(problems)} problem(s): " + "; ".join(problems),
                       problems)
    roles = {r.beat.role for r in rows}
    missing = [role.value for role in WORKER_ROLES if role not in roles]
    if missing:
        return Verdict(EXIT_UNREACHABLE, f"no {' or '.join(missing)} worker answered")
    counts = ", ".join(f"{sum(r.beat.role is role for r in rows)} {role.value}"
                       for role in WORKER_ROLES)
    return Verdict(EXIT_OK, f"ok: {counts}; every configured context fits its real pool")


COLUMNS = ("role", "worker", "model", "configured", "pool", "served", "mismatch", "free",
           "queue", "data address")


def _cells(r: WorkerRow) -> list[str]:
    b = r.beat
    mismatch = r.mismatch_label
    if mismatch != "ok":
        mismatch = f"!! {mismatch} !!"
    state = " (draining)" if b.draining else ""
    return [b.role.value, b.worker_id + state, b.model, str(b.configured_context),
            str(b.pool_capacity_tokens), str(b.served_context), mismatch,
            str(b.available_tokens), str(b.queue_depth), b.data_address or "-"]


def _stats_cells(r: WorkerRow) -> list[str]:
    if r.stats is None:
        return [r.beat.worker_id, "-", "-", "-", "-", r.stats_error or "not asked"]
    s = r.stats
    integrity = "ok" if s.integrity_ok else f"!! FAILED: {s.integrity_error} !!"
    return [r.beat.worker_id, str(s.live_leases), f"{s.leased_pages}/{s.total_pages}",
            str(s.free_pages), str(s.cached_pages), integrity]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
    return [line(header), line(["-" * w for w in widths]), *(line(row) for row in rows)]


def format_report(rows: Sequence[WorkerRow], result: Verdict, *,
                  with_stats: bool = False) -> str:
    """The human-readable report: worker table, optional stats table, loud problems."""
    out = _table(COLUMNS, [_cells(r) for r in rows]) if rows else ["(no worker answered)"]
    if with_stats and rows:
        out += ["", *_table(("worker", "leases", "leased/total pages", "free pages",
                             "cached pages", "pool integrity"),
                            [_stats_cells(r) for r in rows])]
    out.append("")
    for p in result.problems:
        out.append(f"!! CAPACITY CHECK: {p}")
    status = {EXIT_OK: "OK", EXIT_PROBLEM: "PROBLEM", EXIT_UNREACHABLE: "UNAVAILABLE"}
    out.append(f"pdmesh check: {status.get(result.code, '?')}: {result.message}")
    return "\n".join(out)


def report_json(rows: Sequence[WorkerRow], result: Verdict, *, nats_url: str,
                listen_s: float, bad_messages: int = 0) -> dict[str, Any]:
    return {
        "ok": result.code == EXIT_OK, "exit_code": result.code, "verdict": result.message,
        "problems": list(result.problems), "nats_url": nats_url, "listen_s": listen_s,
        "counts": {role.value: sum(r.beat.role is role for r in rows) for role in WORKER_ROLES},
        "mismatches": [r.beat.worker_id for r in rows if r.mismatch],
        "bad_messages": bad_messages,
        "workers": [r.as_dict() for r in rows],
    }


# ---------------------------------------------------------------------------------------
# NATS
# ---------------------------------------------------------------------------------------
class Unreachable(Exception):
    pass


async def _connect(url: str, timeout_s: float) -> Any:
    errors: list[Exception] = []

    async def quiet(exc: Exception) -> None:
        # nats-py retries a refused connection until our deadline; keep the cause.
        errors.append(exc)

    servers = [u.strip() for u in url.split(",") if u.strip()]
    try:
        return await asyncio.wait_for(nats.connect(
            servers=servers, name="pdmesh-check", connect_timeout=min(timeout_s, 2.0),
            allow_reconnect=False, max_reconnect_attempts=0, error_cb=quiet),
            timeout_s)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to connect is "unreachable"
        cause = errors[-1] if errors else exc
        detail = (f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__)
        if isinstance(exc, TimeoutError):
            detail += f"; gave up after {timeout_s:g}s"
        raise Unreachable(f"NATS at {url} is unreachable ({detail})") from None


async def collect(url: str, listen_s: float, *, stats: bool = True,
                  connect_timeout_s: float = 3.0, stats_timeout_s: float = 1.0) -> Collector:
    """Listen to heartbeats for `listen_s`, then ask each worker for its stats."""
    nc = await _connect(url, connect_timeout_s)
    col = Collector()
    decoder = m.Decoder(m.Heartbeat)

    async def on_beat(msg: Any) -> None:
        try:
            col.observe(decoder.decode(msg.subject, msg.data))
        except m.MessageError:
            col.bad_messages += 1

    try:
        sub = await nc.subscribe(m.HEARTBEAT_WILDCARD, cb=on_beat)
        await asyncio.sleep(listen_s)
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        if stats:
            await asyncio.gather(*(_ask_stats(nc, row, stats_timeout_s)
                                   for row in col.rows.values()))
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
    return col


async def _ask_stats(nc: Any, row: WorkerRow, timeout_s: float) -> None:
    subject = m.stats_subject(row.beat.role.value, row.beat.worker_id)
    try:
        reply = await nc.request(subject, b"", timeout=timeout_s)
        row.stats = m.Decoder(m.StatsReply).decode(subject, reply.data)
    except m.MessageError as exc:
        row.stats_error = f"bad stats reply: {exc.cause}"
    except Exception as exc:  # noqa: BLE001 - timeouts / no responders: reported, not fatal
        row.stats_error = f"no stats reply ({type(exc).__name__})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdmesh check",
        description="Print each live worker's configured context vs its real KV pool "
                    "capacity. Exit 0 ok, 1 capacity mismatch (or pool integrity failure), "
                    "2 NATS unreachable or no prefill/decode worker answered.")
    parser.add_argument("--nats-url", default=None,
                        help=f"NATS URL [PDMESH_NATS_URL, default {DEFAULT_NATS_URL}]")
    parser.add_argument("--listen-s", type=float, default=2.0,
                        help="how long to listen to heartbeats (they come every 0.5 s)")
    parser.add_argument("--connect-timeout-s", type=float, default=3.0,
                        help="give up on NATS after this long")
    parser.add_argument("--no-stats", action="store_true",
                        help="do not ask workers for lease counts and pool integrity")
    parser.add_argument("--json", action="store_true",
                        help="last stdout line is one JSON object")
    args = parser.parse_args(list(argv) if argv is not None else None)
    url = args.nats_url or os.environ.get("PDMESH_NATS_URL") or DEFAULT_NATS_URL
    if not args.listen_s > 0:
        print("pdmesh check: error: --listen-s must be > 0", file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        col = asyncio.run(collect(url, args.listen_s, stats=not args.no_stats,
                                   connect_timeout_s=args.connect_timeout_s))
    except Unreachable as exc:
        print(f"pdmesh check: error: {exc}", file=sys.stderr)
        if args.json:
            result = Verdict(EXIT_UNREACHABLE, str(exc))
            print(json.dumps(report_json([], result, nats_url=url, listen_s=args.listen_s)))
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        return 130
    rows = col.sorted_rows()
    result = verdict(rows)
    print(format_report(rows, result, with_stats=not args.no_stats), flush=True)
    if col.bad_messages:
        print(f"pdmesh check: {col.bad_messages} undecodable message(s) on "
              f"{m.HEARTBEAT_WILDCARD} ignored", file=sys.stderr)
    if result.code == EXIT_UNREACHABLE:
        print(f"pdmesh check: error: {result.message} on {url} within {args.listen_s:g}s",
              file=sys.stderr)
    if args.json:
        print(json.dumps(report_json(rows, result, nats_url=url, listen_s=args.listen_s,
                                     bad_messages=col.bad_messages)))
    return result.code


if __name__ == "__main__":
    sys.exit(main())
