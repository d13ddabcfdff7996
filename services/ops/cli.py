"""The `pdmesh` command: `up`, `serve <service>`, `check`, `bench <what>`, `loadtest`,
`soak`, `secrets`, `certs`.

Every failure to start is one clear line on stderr and a non-zero exit, never a traceback,
and like every log line it passes through `redact` (no URL password, bearer token or
secret setting's value is printed). Each service logs at start whether it runs in
production mode or with dev credentials allowed.
The settings flags come from services/runtime/settings.py: `pdmesh serve <role>` offers
the role's own, `pdmesh up` the rows marked `up`, each role of the mesh handed its share.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import os
import secrets
import sys
from collections.abc import Mapping, Sequence

from pdmesh.services.protocol.errors import PdmeshError
from pdmesh.services.runtime import redact
from pdmesh.services.runtime.config import (
    ALLOW_DEV_ENV,
    ArgumentParser,
    ServiceConfig,
    add_arguments,
    check_dev_credentials,
    dev_credentials,
    env_value,
    in_env,
    mode_line,
    resolve,
    serve_settings,
    up_settings,
)
from pdmesh.services.runtime.settings import (
    ADMISSION,
    BY_FIELD,
    COLOCATED,
    DECODE,
    GATEWAY,
    KEY_FIELDS,
    PREFILL,
    ROLES,
    SETTINGS,
)

SERVE = {
    "admission": "pdmesh.services.admission.service",
    "prefill": "pdmesh.services.prefill.service",
    "decode": "pdmesh.services.decode.service",
    "colocated": "pdmesh.services.colocated.service",
    "gateway": "pdmesh.gateway.app",
}
BENCH = {
    "engine": "pdmesh.loadtest.bench.engine",
    "transport": "pdmesh.loadtest.bench.transport",
    "admission": "pdmesh.loadtest.bench.admission",
    "prefix-cache": "pdmesh.loadtest.bench.prefix",
    "kvcache": "pdmesh.loadtest.bench.kvcache",
    "disagg": "pdmesh.loadtest.bench.disagg",
    "fairness": "pdmesh.loadtest.bench.fairness",
    "structured": "pdmesh.loadtest.bench.structured",
    "structured-valid": "pdmesh.loadtest.bench.schemas",
    "llamacpp": "pdmesh.loadtest.bench.llamacpp",
    "serving": "pdmesh.loadtest.bench.serving",
}
PASSTHROUGH = {"loadtest": "pdmesh.loadtest.cli", "soak": "pdmesh.loadtest.soak.run",
               "check": "pdmesh.loadtest.check", "secrets": "pdmesh.services.ops.natsauth",
               "certs": "pdmesh.services.ops.certs", "cache": "pdmesh.services.ops.cachecmd"}
# The launcher hands these to the processes itself (each its own port, the NATS it started).
UP_OWN = ("nats_url", "gateway_port")


def _fail(msg: str, code: int = 2) -> int:
    print(f"pdmesh: error: {redact.redact(msg)}", file=sys.stderr)
    return code


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    redact.install()


def cmd_serve(role: str, argv: Sequence[str]) -> int:
    parser = ArgumentParser(prog=f"pdmesh serve {role}")
    add_arguments(parser, serve_settings(role))
    args = parser.parse_args(argv)
    allowed = _allow_dev(args)
    try:
        cfg = resolve(role, args)
        check_dev_credentials(cfg, allowed)
    except PdmeshError as exc:
        return _fail(str(exc))
    _setup_logging(cfg.log_level)
    logging.getLogger("pdmesh").info("%s: %s", role, mode_line(allowed))
    for what in dev_credentials(cfg):
        logging.getLogger("pdmesh").warning("%s runs with %s: development only", role, what)
    try:
        module = importlib.import_module(SERVE[role])
        asyncio.run(module.serve(cfg))
    except PdmeshError as exc:
        return _fail(str(exc), 1)
    except KeyboardInterrupt:
        return 130
    return 0


def _allow_dev(args: object) -> bool:
    return bool(getattr(args, "allow_dev_credentials", None)
                or env_value("allow_dev_credentials"))


def up_configs(args: object, colocated: bool,
               env: Mapping[str, str] | None = None) -> dict[str, ServiceConfig]:
    """The config of every role the mesh runs, from `pdmesh up`'s flags (each role takes
    the flags it uses) and the environment: every value is checked before anything
    starts, and each role is handed only its own. The keys are fresh for each run unless
    given (flag or env var): admission gets the signing key, the workers its verify key,
    the gateway the salt key, prefill workers the KV-tier key."""
    from pdmesh.services.protocol import tickets

    env = os.environ if env is None else env
    roles = [r for r in ROLES if r not in ((PREFILL, DECODE) if colocated else (COLOCATED,))]
    flags = {s.field: getattr(args, s.field) for s in up_settings() if s.roles}
    for field, fresh in (("signing_key", tickets.generate_signing_key),
                         ("salt_key", lambda: secrets.token_hex(32)),
                         ("kv_tier_key", lambda: secrets.token_hex(32))):
        if flags.get(field) is None and not in_env(field, env):
            flags[field] = fresh()
    cfgs: dict[str, ServiceConfig] = {}
    for role in roles:  # admission first: the workers' verify key is its signing key's
        cfgs[role] = resolve(role, {f: v for f, v in flags.items()
                                    if role in BY_FIELD[f].roles}, env)
        if role == ADMISSION:
            flags["verify_key"] = tickets.verify_key_of(cfgs[role].signing_key)
    for role in (DECODE, COLOCATED):
        cfg = cfgs.get(role)
        if cfg is not None and not cfg.decode_torch_threads and not cfg.torch_threads:
            # One host runs the whole mesh: decode steps leave a core to the gateway, NATS
            # and the worker's own event loop, which publish each token while the next
            # step runs (a colocated worker's prefill keeps torch's default).
            cfgs[role] = dataclasses.replace(cfg, decode_torch_threads=up_decode_threads())
    return cfgs


def up_decode_threads() -> int:
    """`pdmesh up`'s decode engine threads when neither --decode-torch-threads nor
    --torch-threads is given: the cores this process may run on, less one, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


def up_env(cfgs: dict[str, ServiceConfig], allow_dev: bool) -> dict[str, dict[str, str]]:
    """By role, the env vars `pdmesh up` hands that role's processes: the values of its
    flags the role uses and its key (the launcher sets NATS and the ports itself)."""
    env = {role: {s.env: str(getattr(cfg, s.field)) for s in SETTINGS
                  if role in s.roles and (s.up or s.field in KEY_FIELDS)
                  and s.field not in UP_OWN} for role, cfg in cfgs.items()}
    if allow_dev:
        for role_env in env.values():
            role_env[ALLOW_DEV_ENV] = "1"
    return env


def cmd_up(argv: Sequence[str]) -> int:
    # Lazy like every command's module: `pdmesh serve gateway` must not load the launcher.
    from pdmesh.services.ops.launcher import RESTART_CHOICES, Launcher, RestartPolicy, run_up

    parser = ArgumentParser(
        prog="pdmesh up", description="Run the whole mesh locally: embedded nats-server, "
        "admission, prefill, decode and gateway, each its own process.")
    add_arguments(parser, up_settings())
    parser.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    parser.add_argument("--decode", type=int, default=1, help="number of decode workers")
    parser.add_argument("--quiet", action="store_true", help="do not echo service logs")
    parser.add_argument("--colocated", action="store_true",
                        help="baseline mesh: one colocated worker (prefill + decode in one "
                        "process, no KV transfer) behind the same gateway and admission")
    policy = RestartPolicy()
    parser.add_argument("--restart", choices=RESTART_CHOICES, default=None,
                        help="a service that exits (any code or signal): `always` (default) "
                        f"starts it again, same ports and worker id, after a back-off "
                        f"({policy.first_delay_s:g}s doubling to {policy.max_delay_s:g}s; "
                        f"the mesh stops when it dies within {policy.quick_exit_s:g}s of "
                        f"its start {policy.max_quick_exits} times in a row); `never` "
                        "stops the whole mesh. nats-server exiting always stops it")
    parser.add_argument("--keep-going", action="store_true",
                        help="keep the mesh up when one service exits, without restarting it "
                        "(fault-injection tests kill workers on purpose)")
    args = parser.parse_args(argv)
    if args.keep_going and args.restart == "always":
        return _fail("--keep-going never restarts a service; drop --restart always")
    allow_dev = _allow_dev(args)
    try:
        cfgs = up_configs(args, args.colocated)
        for role_cfg in cfgs.values():  # before any process starts, one clear line
            check_dev_credentials(role_cfg, allow_dev)
    except PdmeshError as exc:
        return _fail(str(exc))
    cfg = cfgs[GATEWAY]
    if args.prefill < 1 or args.decode < 1:
        return _fail("--prefill and --decode must be at least 1")
    if args.colocated and (args.prefill != 1 or args.decode != 1):
        return _fail("--colocated runs one colocated worker; drop --prefill/--decode")
    env = up_env(cfgs, allow_dev)
    if allow_dev:
        for role, role_cfg in cfgs.items():
            for what in dev_credentials(role_cfg):
                print(f"pdmesh: --allow-dev-credentials: {role} runs with {what}; "
                      "for local development only", flush=True)
    launcher = Launcher(nats_url=cfg.nats_url, gateway_port=cfg.gateway_port,
                        prefill=args.prefill, decode=args.decode, env=env, quiet=args.quiet,
                        keep_going=args.keep_going, colocated=args.colocated,
                        restart=args.restart or "always", policy=policy,
                        drain_timeout_s=max(c.drain_timeout_s for c in cfgs.values()),
                        worker_ttl_s=max(getattr(c, "worker_ttl_s", 0.0)
                                         for c in cfgs.values()))
    try:
        return asyncio.run(run_up(launcher))
    except PdmeshError as exc:
        return _fail(str(exc), 1)


def _dispatch(table: dict[str, str], what: str, argv: Sequence[str]) -> int:
    module = importlib.import_module(table[what])
    return int(module.main(list(argv)) or 0)


HELP = ("-h", "--help")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = ("usage: pdmesh {up,serve,check,bench,loadtest,soak,secrets,certs,cache} ...\n"
             "  up                      run the whole mesh locally (see pdmesh up --help)\n"
             "  serve <service>         run one service: " + ", ".join(SERVE) + "\n"
             "  check                   print each worker's configured context vs real pool\n"
             "  bench <what>            benchmarks: " + ", ".join(BENCH) + "\n"
             "  loadtest                long-prompt load generator (OpenAI-compatible HTTP)\n"
             "  soak                    canary workload with oracle checks\n"
             "  secrets --out DIR       NATS credentials + the mesh's keys for compose stacks\n"
             "  certs --out DIR --hosts  dev CA + NATS TLS certificates (multi-host)\n"
             "  cache purge --tenant ID  delete a tenant's cached KV in every tier\n")
    if not argv or argv[0] in HELP:
        print(usage)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "up":
        return cmd_up(rest)
    if cmd == "serve":
        if rest[:1] and rest[0] in HELP:
            print(f"usage: pdmesh serve {{{','.join(SERVE)}}} [flags]\n"
                  "  run one service; pdmesh serve <service> --help lists its flags")
            return 0
        if not rest or rest[0] not in SERVE:
            return _fail(f"pdmesh serve needs one of: {', '.join(SERVE)}")
        return cmd_serve(rest[0], rest[1:])
    if cmd == "bench":
        if rest[:1] and rest[0] in HELP:
            print(f"usage: pdmesh bench {{{','.join(BENCH)}}} [flags]\n"
                  "  benchmarks (figures, never pass/fail); pdmesh bench <what> --help lists "
                  "its flags")
            return 0
        if not rest or rest[0] not in BENCH:
            return _fail(f"pdmesh bench needs one of: {', '.join(BENCH)}")
        return _dispatch(BENCH, rest[0], rest[1:])
    if cmd in PASSTHROUGH:
        return _dispatch(PASSTHROUGH, cmd, rest)
    return _fail(f"unknown command {cmd!r}\n{usage}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
