"""`pdmesh check`: each live worker's configured context vs its real KV pool (invariant I5),
and whether every worker's KV data plane can be reached from this host.

Listens to the workers' heartbeats for `--listen-s` seconds (they carry live pool figures,
never configuration), optionally asks each worker for its stats (leases, pool integrity),
and prints one row per worker. A worker whose configured context exceeds its real pool is
shown as CLAMPED (or OVER POOL if it serves more than its pool holds: that would be the
2026 incident's shape and must never happen).

The figures are checked here independently of the worker's own `capacity_mismatch` flag:
configured > pool or served > pool is a mismatch even if the flag was not set.

Data plane: every worker's advertised `data_address` is dialled (a TCP connect, then close;
UCX listens on a TCP socket too) from the host `pdmesh check` runs on, so running it on each
host of a multi-host mesh gives per-host reachability. An address no peer can use is a
problem even before dialling: a wildcard (0.0.0.0, ::), or loopback while other workers
advertise routable addresses (peers on other hosts would dial themselves).

Exit codes:
  0  at least one prefill and one decode worker answered, no mismatch, pools intact
  1  a capacity mismatch (clamped or worse), a failed pool integrity check, or a data plane
     that is unreachable from this host or advertised at an address peers cannot use
  2  NATS unreachable, no worker answered, or no prefill / no decode worker answered
With `--json` the last stdout line is one JSON object (also on exit 1 and 2).

Nothing printed repeats a credential: the NATS URL's password, the `--nats-password` and
every other secret setting are masked (`services/runtime/redact.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import socket
import ssl
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import nats

from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol.errors import PdmeshError
from pdmesh.services.runtime import redact
from pdmesh.services.runtime.config import NatsConfig, add_arguments, resolve_nats, settings_of
from pdmesh.services.runtime.settings import CHECK

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
    reach: Reach | None = None  # the data plane dialled from this host (None: not probed)

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
            "data_plane": None if self.reach is None else {
                "reachable": self.reach.ok, "error": self.reach.error,
                "connect_ms": self.reach.connect_ms, "from_host": self.reach.from_host},
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


@dataclass(frozen=True)
class Reach:
    """One worker's data plane as dialled from this host."""

    ok: bool
    error: str = ""
    connect_ms: float = 0.0
    from_host: str = ""


def split_address(address: str) -> tuple[str, int]:
    """('host', port) of a data address `<scheme>://host:port` (ValueError when malformed)."""
    scheme, sep, rest = address.partition("://")
    host, colon, port = rest.rpartition(":")
    if not (sep and scheme and colon and host and port.isdigit()):
        raise ValueError(f"not <scheme>://host:port: {address!r}")
    return host.strip("[]"), int(port)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def address_problem(address: str, others: Iterable[str]) -> str:
    """Why peers cannot use this advertised data address ('' when nothing is wrong with it
    on its face): empty, malformed, a wildcard, or loopback among routable addresses."""
    if not address:
        return "no data address advertised"
    try:
        host, _port = split_address(address)
    except ValueError as exc:
        return str(exc)
    if host in ("0.0.0.0", "::", ""):
        return f"wildcard address {address} advertised: peers cannot dial it"
    if _is_loopback(host):
        routable = sorted(a for a in others
                          if a and not _is_loopback(_host_or_empty(a)))
        if routable:
            return (f"loopback address {address} advertised while other workers advertise "
                    f"{routable[0]}: peers on other hosts would dial themselves")
    return ""


def _host_or_empty(address: str) -> str:
    try:
        return split_address(address)[0]
    except ValueError:
        return ""


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
        bad_address = address_problem(
            b.data_address, (o.beat.data_address for o in rows if o is not r))
        if bad_address:
            problems.append(f"{b.worker_id}: data plane: {bad_address}")
        elif r.reach is not None and not r.reach.ok:
            problems.append(f"{b.worker_id}: data plane {b.data_address} unreachable from "
                            f"{r.reach.from_host}: {r.reach.error}")
    if problems:
        return Verdict(EXIT_PROBLEM, f"{len(problems)} problem(s): " + "; ".join(problems),
                       problems)
    roles = {r.beat.role for r in rows}
    missing = [role.value for role in WORKER_ROLES if role not in roles]
    if missing:
        return Verdict(EXIT_UNREACHABLE, f"no {' or '.join(missing)} worker answered")
    counts = ", ".join(f"{sum(r.beat.role is role for r in rows)} {role.value}"
                       for role in WORKER_ROLES)
    reached = ("; every data plane reachable from this host"
               if rows and all(r.reach is not None for r in rows) else "")
    return Verdict(EXIT_OK, f"ok: {counts}; every configured context fits its real pool"
                   + reached)


COLUMNS = ("role", "worker", "model", "configured", "pool", "served", "mismatch", "free",
           "queue", "data address", "reach")


def _cells(r: WorkerRow) -> list[str]:
    b = r.beat
    mismatch = r.mismatch_label
    if mismatch != "ok":
        mismatch = f"!! {mismatch} !!"
    state = " (draining)" if b.draining else ""
    return [b.role.value, b.worker_id + state, b.model, str(b.configured_context),
            str(b.pool_capacity_tokens), str(b.served_context), mismatch,
            str(b.available_tokens), str(b.queue_depth), b.data_address or "-",
            _reach_cell(r)]


def _reach_cell(r: WorkerRow) -> str:
    if r.reach is None:
        return "-"
    if r.reach.ok:
        return f"ok {r.reach.connect_ms:.1f} ms"
    return f"!! UNREACHABLE: {r.reach.error} !!"


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
    reach_from = {r.reach.from_host for r in rows if r.reach is not None}
    if reach_from:
        out.append(f"reach: each data plane dialled from {', '.join(sorted(reach_from))}")
    for p in result.problems:
        label = "DATA PLANE" if ": data plane" in p else "CAPACITY CHECK"
        out.append(f"!! {label}: {p}")
    status = {EXIT_OK: "OK", EXIT_PROBLEM: "PROBLEM", EXIT_UNREACHABLE: "UNAVAILABLE"}
    out.append(f"pdmesh check: {status.get(result.code, '?')}: {result.message}")
    return "\n".join(out)


def report_json(rows: Sequence[WorkerRow], result: Verdict, *, nats_url: str,
                listen_s: float, bad_messages: int = 0) -> dict[str, Any]:
    """The `--json` report; `nats_url` appears with its password masked."""
    return {
        "ok": result.code == EXIT_OK, "exit_code": result.code, "verdict": result.message,
        "problems": list(result.problems), "nats_url": redact.redact(nats_url),
        "listen_s": listen_s,
        "counts": {role.value: sum(r.beat.role is role for r in rows) for role in WORKER_ROLES},
        "mismatches": [r.beat.worker_id for r in rows if r.mismatch],
        "unreachable": [r.beat.worker_id for r in rows if r.reach is not None
                        and not r.reach.ok],
        "bad_messages": bad_messages,
        "workers": [r.as_dict() for r in rows],
    }


# ---------------------------------------------------------------------------------------
# NATS
# ---------------------------------------------------------------------------------------
class Unreachable(Exception):
    pass


async def _connect(cfg: NatsConfig, timeout_s: float) -> Any:
    errors: list[Exception] = []

    async def quiet(exc: Exception) -> None:
        # nats-py retries a refused connection until our deadline; keep the cause.
        errors.append(exc)

    servers = cfg.nats_servers
    url = ",".join(servers)
    # The same credentials and CA settings a service takes (--nats-user/--nats-password,
    # --nats-tls-ca or their env vars); credentials in the URL work too.
    extra: dict[str, Any] = {}
    if cfg.nats_user:
        extra.update(user=cfg.nats_user, password=cfg.nats_password or None)
    # Replies come to this user's own inbox (each NATS user may read only its own).
    user = cfg.nats_user or (unquote(urlsplit(servers[0]).username or "") if servers else "")
    extra["inbox_prefix"] = m.inbox_prefix(user)
    if cfg.nats_tls_ca:
        extra.update(tls=ssl.create_default_context(cafile=cfg.nats_tls_ca),
                     tls_handshake_first=True)
    try:
        return await asyncio.wait_for(nats.connect(
            servers=servers, name="pdmesh-check", connect_timeout=min(timeout_s, 2.0),
            allow_reconnect=False, max_reconnect_attempts=0, error_cb=quiet, **extra),
            timeout_s)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to connect is "unreachable"
        cause = errors[-1] if errors else exc
        detail = (f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__)
        if isinstance(exc, TimeoutError):
            detail += f"; gave up after {timeout_s:g}s"
        raise Unreachable(f"NATS at {url} is unreachable ({detail})") from None


async def collect(nats_at: str | NatsConfig, listen_s: float, *, stats: bool = True,
                  probe: bool = True, connect_timeout_s: float = 3.0,
                  stats_timeout_s: float = 1.0, probe_timeout_s: float = 2.0) -> Collector:
    """Listen to heartbeats for `listen_s`, then ask each worker for its stats and dial its
    data plane. `nats_at`: the NATS settings, or a URL (credentials and CA then come from
    the environment, as a service's do)."""
    cfg = resolve_nats({"nats_url": nats_at}) if isinstance(nats_at, str) else nats_at
    nc = await _connect(cfg, connect_timeout_s)
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
        if probe:
            await probe_all(col.rows.values(), probe_timeout_s)
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
    return col


def this_host() -> str:
    """How the report names the host it dialled from."""
    return socket.gethostname()


async def probe_data_plane(address: str, timeout_s: float) -> Reach:
    """Dial a worker's advertised data address from here (TCP connect, then close)."""
    started = time.monotonic()
    try:
        host, port = split_address(address)
        _reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                                 timeout_s)
    except asyncio.CancelledError:
        raise
    except TimeoutError:
        return Reach(False, f"no answer within {timeout_s:g}s", from_host=this_host())
    except (OSError, ValueError) as exc:
        return Reach(False, f"{type(exc).__name__}: {exc}", from_host=this_host())
    connect_ms = (time.monotonic() - started) * 1000
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return Reach(True, connect_ms=connect_ms, from_host=this_host())


async def probe_all(rows: Iterable[WorkerRow], timeout_s: float) -> None:
    rows = list(rows)
    reaches = await asyncio.gather(*(probe_data_plane(r.beat.data_address, timeout_s)
                                     for r in rows))
    for row, reach in zip(rows, reaches, strict=True):
        row.reach = reach


async def _ask_stats(nc: Any, row: WorkerRow, timeout_s: float) -> None:
    subject = m.stats_subject(row.beat.role.value, row.beat.worker_id)
    try:
        reply = await nc.request(subject, b"", timeout=timeout_s)
        row.stats = m.Decoder(m.StatsReply).decode(subject, reply.data)
    except m.MessageError as exc:
        row.stats_error = f"bad stats reply: {exc.cause}"
    except Exception as exc:  # noqa: BLE001 - timeouts / no responders: reported, not fatal
        row.stats_error = f"no stats reply ({type(exc).__name__})"


def _say(text: str, stream: Any = None) -> None:
    """Print `text` (default: to stdout) with every credential masked."""
    print(redact.redact(text), file=stream or sys.stdout, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdmesh check",
        description="Print each live worker's configured context vs its real KV pool "
                    "capacity, and whether its KV data plane answers from this host. Exit 0 "
                    "ok, 1 capacity mismatch, pool integrity failure or unreachable data "
                    "plane, 2 NATS unreachable or no prefill/decode worker answered.")
    add_arguments(parser, settings_of(CHECK))  # the NATS flags and env vars of a service
    parser.add_argument("--listen-s", type=float, default=2.0,
                        help="how long to listen to heartbeats (they come every 0.5 s)")
    parser.add_argument("--connect-timeout-s", type=float, default=3.0,
                        help="give up on NATS after this long")
    parser.add_argument("--no-stats", action="store_true",
                        help="do not ask workers for lease counts and pool integrity")
    parser.add_argument("--no-probe", action="store_true",
                        help="do not dial the workers' data planes from this host")
    parser.add_argument("--probe-timeout-s", type=float, default=2.0,
                        help="give up dialling one data plane after this long")
    parser.add_argument("--json", action="store_true",
                        help="last stdout line is one JSON object")
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        nats_cfg = resolve_nats(args)
    except PdmeshError as exc:
        _say(f"pdmesh check: error: {exc}", sys.stderr)
        return EXIT_UNREACHABLE
    url = nats_cfg.nats_url or DEFAULT_NATS_URL
    if not args.listen_s > 0:
        _say("pdmesh check: error: --listen-s must be > 0", sys.stderr)
        return EXIT_UNREACHABLE
    try:
        col = asyncio.run(collect(nats_cfg, args.listen_s, stats=not args.no_stats,
                                   probe=not args.no_probe,
                                   connect_timeout_s=args.connect_timeout_s,
                                   probe_timeout_s=args.probe_timeout_s))
    except Unreachable as exc:
        _say(f"pdmesh check: error: {exc}", sys.stderr)
        if args.json:
            result = Verdict(EXIT_UNREACHABLE, str(exc))
            _say(json.dumps(report_json([], result, nats_url=url, listen_s=args.listen_s)))
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        return 130
    rows = col.sorted_rows()
    result = verdict(rows)
    _say(format_report(rows, result, with_stats=not args.no_stats))
    if col.bad_messages:
        _say(f"pdmesh check: {col.bad_messages} undecodable message(s) on "
             f"{m.HEARTBEAT_WILDCARD} ignored", sys.stderr)
    if result.code == EXIT_UNREACHABLE:
        _say(f"pdmesh check: error: {result.message} on {url} within {args.listen_s:g}s",
             sys.stderr)
    if args.json:
        _say(json.dumps(report_json(rows, result, nats_url=url, listen_s=args.listen_s,
                                    bad_messages=col.bad_messages)))
    return result.code


if __name__ == "__main__":
    sys.exit(main())
