"""`pdmesh cache purge`: delete one tenant's cached KV in every prefill worker and tier.

The command sends `CachePurge` on NATS (the `tools` user may publish it; prefill workers
subscribe) and prints what each worker answered within `--wait-s`. The message names the
tenant's cache salt: derived from the tenant id under the gateway's salt key (PDMESH_SALT_KEY
or --salt-key, as the gateway does: gateway/tenants.py) or given as `--cache-salt`. Without
either, the message names the tenant id alone and each worker purges the salts it has seen
that tenant's tickets carry. Each worker deletes the salt's unpinned pool pages, its host
and disk tiers' blocks, and the salt's entries in the shared store (every worker tries; a
second delete finds nothing). Exit 0 when at least one worker answered without an error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence

from pdmesh.services.protocol import messages as m
from pdmesh.services.runtime.config import add_arguments, resolve_nats, settings_of
from pdmesh.services.runtime.settings import BY_FIELD, CHECK


async def purge(nats_cfg: object, message: m.CachePurge, wait_s: float,
                connect_timeout_s: float) -> list[m.CachePurged]:
    """Publish `message` and gather the workers' answers for `wait_s` seconds."""
    from pdmesh.loadtest.check import _connect  # the tools' one NATS connect

    nc = await _connect(nats_cfg, connect_timeout_s)
    decoder = m.Decoder(m.CachePurged)
    answers: list[m.CachePurged] = []
    try:
        inbox = nc.new_inbox()

        async def on_reply(msg: object) -> None:
            try:
                answers.append(decoder.decode(inbox, msg.data))  # type: ignore[attr-defined]
            except Exception as exc:  # noqa: BLE001 - a bad answer is reported, not fatal
                print(f"pdmesh cache: an undecodable answer: {exc}", file=sys.stderr)

        sub = await nc.subscribe(inbox, cb=on_reply)
        await nc.publish(m.CACHE_PURGE_SUBJECT, m.encode(message), reply=inbox)
        await nc.flush()
        await asyncio.sleep(wait_s)
        await sub.unsubscribe()
    finally:
        await nc.close()
    return answers


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdmesh cache",
        description="Delete a tenant's cached KV in every prefill worker's pool and KV tier "
                    "(host memory, disk, the shared store).")
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("purge", help="delete one tenant's cached KV everywhere")
    add_arguments(p, settings_of(CHECK))  # the NATS flags and env vars of a service
    p.add_argument("--tenant", required=True, help="the tenant id (tenants file `id`)")
    p.add_argument("--cache-salt", default="",
                   help="the tenant's cache salt (hex); default: derived from the salt key")
    p.add_argument("--salt-key", default=None,
                   help="the gateway's salt key (hex; default PDMESH_SALT_KEY): derives the "
                        "tenant's cache salt as the gateway does")
    p.add_argument("--wait-s", type=float, default=2.0,
                   help="how long to gather the workers' answers")
    p.add_argument("--connect-timeout-s", type=float, default=3.0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(list(argv) if argv is not None else None)
    from pdmesh.gateway.tenants import cache_salt

    salt = args.cache_salt
    # The gateway's own setting, read as the gateway reads it (its env var).
    salt_key = args.salt_key or os.environ.get(BY_FIELD["salt_key"].env, "")
    if not salt and salt_key:
        try:
            salt = cache_salt(salt_key, args.tenant)
        except ValueError:
            print("pdmesh cache: error: the salt key must be hex", file=sys.stderr)
            return 2
    if not args.wait_s > 0:
        print("pdmesh cache: error: --wait-s must be > 0", file=sys.stderr)
        return 2
    from pdmesh.loadtest.check import Unreachable

    try:
        answers = asyncio.run(purge(resolve_nats(args), m.CachePurge(
            cache_salt=salt, tenant=args.tenant), args.wait_s, args.connect_timeout_s))
    except Unreachable as exc:
        print(f"pdmesh cache: error: {exc}", file=sys.stderr)
        return 2
    report = {"tenant": args.tenant, "by_salt": bool(salt),
              "workers": {a.worker_id: {"removed": a.removed, "error": a.error}
                          for a in answers}}
    if args.json:
        print(json.dumps(report))
    else:
        for a in answers:
            print(f"{a.worker_id}: removed {a.removed}" + (f"; {a.error}" if a.error else ""))
        if not answers:
            print("no prefill worker answered", file=sys.stderr)
    return 0 if any(not a.error for a in answers) else 1
