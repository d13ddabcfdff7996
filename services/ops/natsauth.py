"""NATS identities and per-subject permissions for the mesh, the way NATS itself secures them.

Every process has its own NATS user (user + random password) whose permissions allow only
the subjects its role needs. A worker's user may subscribe only to its own dispatch /
reserve / release subjects and publish only its own heartbeat, so it can neither read
another worker's reservations nor forge another worker's liveness; the gateway can submit
and abort but cannot publish a dispatch, a reservation or a heartbeat; the `tools` user
(`pdmesh check`, tests) only reads heartbeats and asks for stats. Replies to requests go
through NATS's `allow_responses` (a responder may answer only the requests it received),
into the requester's own inbox: each user subscribes to `_INBOX.<user>.>` only and connects
with that `inbox_prefix` (`messages.inbox_prefix()`), so no identity can read another's replies.

`pdmesh up` makes fresh identities for every run (`mesh_identities`) and starts its embedded
nats-server with `server_config(...)`; each service gets its user and password through
`PDMESH_NATS_USER` / `PDMESH_NATS_PASSWORD`. An unauthenticated client is refused; a valid
client outside its permissions gets a permissions violation and changes nothing.

Compose stacks cannot know worker ids in advance (replicas pick their own), so there every
replica of a role shares one role-level user whose permissions use `*` for the worker id
(`role_identities`): a prefill replica can still not publish a decode heartbeat, receive a
reservation or submit a request, but replicas of one role are not told apart by NATS (the
data plane's per-reservation MACs still are). `pdmesh secrets --out DIR` writes such a
secrets directory: `nats.conf` (the server's authorization block), one `nats-<role>.env` per
role with its user and password, and the keys, each in a file only its holders mount:
`signing.env` (admission's Ed25519 signing key), `verify.env` (its public key, for prefill,
decode and colocated workers), `salt.env` (the gateway's cache-salt key) and `kvtier.env` (the
key prefill workers seal KV-tier blocks under). The signing, salt and KV-tier
keys are made when missing and kept when present (every host of a stack must share
them); `verify.env` is always derived from `signing.env`.
With `--hosts`, also the multi-host NATS cluster's files: a dev CA and server certificate
(`services/ops/certs.py`) and `nats-cluster.conf`: the same users, TLS on client connections
(clients verify the server against the CA), and a `cluster` block whose routes use mutual
TLS and a route user and password (a server without them cannot join the cluster and see
its traffic).

Every file written here is 0600 and the directory 0700, whatever the umask: the compose
command reads the env files on the host (`env_file:`) as the operator, and the `nats` image,
which runs as root, reads the NATS configs and the server key. The CA and server
certificates are public and stay 0644 (services running as uid 10001 read `nats-ca.crt`);
the CA key is kept apart, in `ca-private/` (`certs.make_certs`). A rerun makes the directory
and any kept key file private if they were not, saying so on stderr.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from pdmesh.services.ops import certs
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol import tickets

TOOLS_USER = "tools"
ROLES = ("gateway", "admission", "prefill", "decode", "colocated")
ROUTE_USER, ROUTE_PORT = "route", 6222  # NATS cluster routes (multi-host)
HANDSHAKE_FIRST_FALLBACK = "300ms"  # clients that do not start with TLS wait this long
COMPOSE_SECRETS = "/run/secrets"  # where compose mounts the secrets in a container
ANY_WORKER = "*"  # a role-level user's worker id: one NATS token, any worker of the role
# The largest NATS message the mesh's servers accept (nats-server's default is 1 MiB). A
# control message carries the prompt's token ids (msgpack: at most 5 bytes each), so the
# largest, a PrefillDispatch at MAX_CONTEXT_TOKENS (prompt, the repetition penalty's
# distinct ids and one page id per token at worst, ~15 bytes a token: ~3.9 MB), fits with
# twice that to spare (tests/gateway/test_long_prompt.py checks it). A prompt over
# the served context is a 400 at the gateway before anything is sent; a submit that would
# not fit a server's max_payload anyway (a context configured beyond MAX_CONTEXT_TOKENS, a
# NATS set lower) is a 413 there, also before anything is sent.
MAX_PAYLOAD_BYTES = 8 * 1024 * 1024
MAX_CONTEXT_TOKENS = 262_144


@dataclass(frozen=True)
class Identity:
    user: str
    password: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False  # may answer requests it received (reply subjects)

    def url(self, nats_url: str) -> str:
        """`nats_url` with this identity's credentials in it (for tools that take a URL)."""
        parts = urlsplit(nats_url)
        netloc = f"{quote(self.user, safe='')}:{quote(self.password, safe='')}@" \
                 f"{parts.hostname}:{parts.port}"
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def permissions(role: str, worker_id: str,
                user: str | None = None) -> tuple[tuple[str, ...], tuple[str, ...], bool]:
    """(publish, subscribe, allow_responses) for one process of `role` whose NATS user is
    `user` (default: `worker_id`)."""
    inbox = f"{m.inbox_prefix(user or worker_id)}.>"  # guard: private-inbox
    hb_prefill = m.heartbeat_subject("prefill", "*")
    stats_own = (m.stats_subject(role, worker_id),)
    tokens_any = m.tokens_subject("*")
    if role == "gateway":
        return ((m.SUBMIT_SUBJECT, m.ABORT_SUBJECT),
                (m.HEARTBEAT_WILDCARD, m.tokens_subject("*"), inbox), False)
    if role == "admission":
        return ((m.reserve_subject("*"), m.dispatch_subject("*"), m.ABORT_SUBJECT),
                (m.SUBMIT_SUBJECT, m.UNREACHABLE_SUBJECT, m.HEARTBEAT_WILDCARD, inbox,
                 *stats_own), True)
    if role == "prefill":
        return ((m.heartbeat_subject("prefill", worker_id), m.release_subject("*"),
                 tokens_any, m.UNREACHABLE_SUBJECT),
                (m.dispatch_subject(worker_id), m.ABORT_SUBJECT, m.CACHE_PURGE_SUBJECT, inbox,
                 *stats_own), True)
    if role == "decode":
        return ((m.heartbeat_subject("decode", worker_id), tokens_any),
                (m.reserve_subject(worker_id), m.release_subject(worker_id), m.ABORT_SUBJECT,
                 hb_prefill, inbox, *stats_own), True)
    if role == "colocated":
        # Heartbeats and stats as both roles (it advertises both).
        return ((m.heartbeat_subject("prefill", worker_id),
                 m.heartbeat_subject("decode", worker_id), tokens_any),
                (m.dispatch_subject(worker_id), m.reserve_subject(worker_id),
                 m.release_subject(worker_id), m.ABORT_SUBJECT, hb_prefill, inbox,
                 m.stats_subject("prefill", worker_id), m.stats_subject("decode", worker_id)),
                True)
    if role == "tools":
        return ((f"{m.STATS_SUBJECT}.>", m.CACHE_PURGE_SUBJECT), (m.HEARTBEAT_WILDCARD, inbox),
                False)
    raise ValueError(f"no NATS permissions defined for role {role!r}")


def identity(role: str, worker_id: str, user: str | None = None) -> Identity:
    publish, subscribe, responses = permissions(role, worker_id, user)
    return Identity(user=user or worker_id, password=secrets.token_urlsafe(24),
                    publish=publish, subscribe=subscribe, allow_responses=responses)


def mesh_identities(processes: Iterable[tuple[str, str]]) -> dict[str, Identity]:
    """Fresh identities for (role, worker_id) pairs, plus `tools`; keyed by user name."""
    ids = {wid: identity(role, wid) for role, wid in processes}
    ids[TOOLS_USER] = identity("tools", TOOLS_USER, TOOLS_USER)
    return ids


def server_config(identities: Iterable[Identity]) -> str:
    """A nats-server `authorization` block for these identities, and the mesh's
    `max_payload` (the listen address and ports are given on nats-server's command line).
    Values are JSON strings, which the NATS config syntax accepts as they are."""
    users = []
    for ident in identities:
        perms = [f"publish: {{ allow: {json.dumps(list(ident.publish))} }}",
                 f"subscribe: {{ allow: {json.dumps(list(ident.subscribe))} }}"]
        if ident.allow_responses:
            perms.append("allow_responses: true")
        users.append(f"    {{ user: {json.dumps(ident.user)}, "  # guard: nats-permissions
                     f"password: {json.dumps(ident.password)},\n"
                     f"      permissions: {{ {', '.join(perms)} }} }}")
    return (f"max_payload: {MAX_PAYLOAD_BYTES}\n"
            "authorization {\n  users: [\n" + ",\n".join(users) + "\n  ]\n}\n")


def role_identities(roles: Iterable[str] = ROLES) -> dict[str, Identity]:
    """Fresh role-level identities (user = role, any worker id of it), plus `tools`; keyed by
    user name. For stacks whose worker ids are not known in advance (compose replicas)."""
    ids = {role: identity(role, ANY_WORKER, role) for role in roles}
    ids[TOOLS_USER] = identity("tools", TOOLS_USER, TOOLS_USER)
    return ids


def env_file(ident: Identity) -> str:
    """A compose `env_file` giving a service this identity."""
    return f"PDMESH_NATS_USER={ident.user}\nPDMESH_NATS_PASSWORD={ident.password}\n"


# The key files of a secrets directory: file -> (env var, the roles that mount it).
KEY_FILES = {"signing.env": ("PDMESH_SIGNING_KEY", ("admission",)),
             "verify.env": ("PDMESH_VERIFY_KEY", ("prefill", "decode", "colocated")),
             "salt.env": ("PDMESH_SALT_KEY", ("gateway",)),
             "kvtier.env": ("PDMESH_KV_TIER_KEY", ("prefill",))}


class SecretsError(Exception):
    """A secrets directory file that cannot be used as it is."""


def _env_value(path: Path, var: str) -> str:
    """The value of `var` in an env file, checked to be a 32-byte hex key."""
    for line in path.read_text().splitlines():
        name, sep, value = line.strip().partition("=")
        if sep and name == var:
            if tickets.key_problem(value.strip()):
                raise SecretsError(f"{path}: {var} {tickets.key_problem(value.strip())}")
            return value.strip()
    raise SecretsError(f"{path} has no {var}=")


def write_secrets(out: Path, roles: Iterable[str] = ROLES, hosts: Sequence[str] = (),
                  tls_dir: str = COMPOSE_SECRETS, note: certs.Note = certs.silent) -> list[Path]:
    """Write a compose secrets directory: `nats.conf`, `nats-<user>.env` per identity, and
    the keys, one file per holder: `signing.env` (admission's Ed25519 signing key),
    `salt.env` (the gateway's cache-salt key), `kvtier.env` (the prefill workers'
    KV-tier key), each made when missing and kept when present
    (every host of a stack must share them), and `verify.env` (the workers' verify key),
    always the public key of `signing.env`'s. With `hosts` (multi-host) also a fresh dev CA
    and server certificate (`certs.make_certs`) and `nats-cluster.conf`, which names them
    as the server sees them in `tls_dir` (compose: /run/secrets). `out` is made 0700 and
    every file written 0600 whatever the umask (`certs.private_dir`, `certs.write_private`),
    but for the public certificates (0644); kept key files looser than 0600 are tightened.
    `note` hears of each tightening. Returns the paths written. Raises SecretsError when a
    kept key file is malformed (no file is written then)."""
    certs.private_dir(out, note)
    signing, salt, verify = out / "signing.env", out / "salt.env", out / "verify.env"
    kvtier = out / "kvtier.env"
    sign_var, salt_var, verify_var, kvtier_var = (KEY_FILES[p.name][0]
                                                  for p in (signing, salt, verify, kvtier))
    files: dict[Path, str] = {}
    if signing.exists():
        signing_key = _env_value(signing, sign_var)
    else:
        signing_key = tickets.generate_signing_key()
        files[signing] = f"{sign_var}={signing_key}\n"
    if salt.exists():
        _env_value(salt, salt_var)
    else:
        files[salt] = f"{salt_var}={secrets.token_hex(32)}\n"
    if kvtier.exists():
        _env_value(kvtier, kvtier_var)
    else:
        files[kvtier] = f"{kvtier_var}={secrets.token_hex(32)}\n"
    verify_text = f"{verify_var}={tickets.verify_key_of(signing_key)}\n"
    if not verify.exists() or verify.read_text() != verify_text:
        files[verify] = verify_text
    for kept in (signing, salt, verify, kvtier):
        if kept not in files:
            certs.tighten(kept, certs.SECRET_MODE, note)
    ids = role_identities(roles)
    files[out / "nats.conf"] = server_config(ids.values())
    written = []
    if hosts:
        written = certs.make_certs(out, hosts, note=note)
        files[out / "nats-cluster.conf"] = cluster_server_config(
            ids.values(), hosts, secrets.token_urlsafe(24), tls_dir)
    files.update({out / f"nats-{user}.env": env_file(ident) for user, ident in ids.items()})
    for path, text in files.items():
        certs.write_private(path, text, certs.SECRET_MODE)
    return sorted([*files, *written])


def tls_block(tls_dir: str, *, verify: bool, indent: str = "",
              handshake_first: str | None = None) -> str:
    """A nats-server `tls` block with `certs.py`'s files as the server sees them in
    `tls_dir`; `verify`: the peer must present a certificate of the CA too (routes);
    `handshake_first`: accept a TLS handshake before INFO (services, which insist on it so
    that nobody can strip TLS), falling back to INFO after that delay for other clients."""
    paths = {"cert_file": f"{tls_dir}/{certs.SERVER_CERT}",
             "key_file": f"{tls_dir}/{certs.SERVER_KEY}", "ca_file": f"{tls_dir}/{certs.CA_CERT}"}
    body = ", ".join(f"{k}: {json.dumps(v)}" for k, v in paths.items())
    first = f", handshake_first: {json.dumps(handshake_first)}" if handshake_first else ""
    return f"{indent}tls {{ {body}, verify: {str(verify).lower()}{first}, timeout: 3 }}\n"


def cluster_config(hosts: Sequence[str], password: str, port: int = ROUTE_PORT,
                   listen_host: str = "0.0.0.0", tls_dir: str | None = None) -> str:
    """A nats-server `cluster` block: routes to every host (a node skips its own), each
    route authenticated with the route user (`ROUTE_USER`, `password`) and, with `tls_dir`,
    mutual TLS (`tls_block`)."""
    cred = f"{quote(ROUTE_USER, safe='')}:{quote(password, safe='')}"
    scheme = "tls" if tls_dir else "nats"
    routes = [f"{scheme}://{cred}@{host}:{port}" for host in hosts]
    tls = tls_block(tls_dir, verify=True, indent="  ") if tls_dir else ""
    return ("cluster {\n  name: \"pdmesh\"\n"  # guard: route-auth
            f"  listen: {json.dumps(f'{listen_host}:{port}')}\n"
            f"  authorization {{ user: {json.dumps(ROUTE_USER)}, "
            f"password: {json.dumps(password)} }}\n"
            f"{tls}  routes: {json.dumps(routes)}\n}}\n")


MONITOR_ENV = "NATS_MONITOR_LISTEN"  # host:port of a multi-host node's monitoring endpoint


def cluster_server_config(identities: Iterable[Identity], hosts: Sequence[str],
                          route_password: str, tls_dir: str, port: int = ROUTE_PORT) -> str:
    """The multi-host node's whole config: users, client TLS (server certificate only:
    clients authenticate with their password), the authenticated mutual-TLS cluster, and
    the monitoring endpoint (/healthz, /routez) on the address each node's environment
    gives in NATS_MONITOR_LISTEN (its cluster address: never every interface; one file
    serves every node, so the address comes from the node's environment)."""
    return (server_config(identities)
            + tls_block(tls_dir, verify=False, handshake_first=HANDSHAKE_FIRST_FALLBACK)
            + cluster_config(hosts, route_password, port, tls_dir=tls_dir)
            + f"http: ${MONITOR_ENV}\n")


def _say(line: str) -> None:
    print(f"pdmesh secrets: {line}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdmesh secrets",
        description="Write NATS credentials (one role-level user per role, per-subject "
                    "permissions) and the mesh's keys (signing.env for admission, verify.env "
                    "for the workers, salt.env for the gateway, kvtier.env for prefill "
                    "workers) into a compose secrets "
                    "directory: files 0600, the directory 0700 (certificates 0644, the CA "
                    "key in ca-private/).")
    parser.add_argument("--out", required=True, type=Path,
                        help="secrets directory (e.g. compose/secrets); nats files are "
                             "replaced, existing signing.env and salt.env are kept "
                             "(verify.env follows signing.env)")
    parser.add_argument("--roles", default=",".join(ROLES),
                        help="comma-separated roles (default: %(default)s)")
    parser.add_argument("--hosts", default="",
                        help="comma-separated addresses of the multi-host NATS nodes: also "
                             "write a dev CA (its key in ca-private/), the NATS server "
                             "certificate and nats-cluster.conf (TLS, authenticated routes "
                             "between them)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    roles = [r for r in args.roles.split(",") if r]
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    bad = [h for h in hosts if not all(c.isalnum() or c in ".-:[]" for c in h)]
    if bad:
        print(f"pdmesh secrets: not a host address: {', '.join(bad)}", file=sys.stderr)
        return 2
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        print(f"pdmesh secrets: unknown role(s) {', '.join(unknown)}; known: "
              f"{', '.join(ROLES)}", file=sys.stderr)
        return 2
    try:
        written = write_secrets(args.out, roles, hosts, note=_say)
    except (certs.CertError, SecretsError) as exc:
        print(f"pdmesh secrets: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"pdmesh secrets: cannot write {args.out}: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
