"""`pdmesh certs`: a development CA and the TLS certificates of a multi-host NATS cluster.

    pdmesh certs --out DIR --hosts 10.0.0.10,10.0.0.11,10.0.0.12

writes, with the `openssl` command (no Python crypto dependency):

    nats-ca.crt / nats-ca.key          the CA (keep nats-ca.key off the hosts)
    nats-server.crt / nats-server.key  one certificate for every NATS node, valid for each of
                                       `--hosts` plus localhost/127.0.0.1 (services reach their
                                       own host's node on loopback); server and client use,
                                       so routes verify each other with it (mutual TLS)

Clients (services, `pdmesh check`) verify the server against `nats-ca.crt`
(`PDMESH_NATS_TLS_CA`) and authenticate with their NATS user and password; routes present
`nats-server.crt` both ways. It is a dev CA: for production, issue these from your own.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

CA_CERT, CA_KEY = "nats-ca.crt", "nats-ca.key"
SERVER_CERT, SERVER_KEY = "nats-server.crt", "nats-server.key"
DEFAULT_DAYS = 365


class CertError(Exception):
    """openssl is missing or failed, or a host name is not usable in a certificate."""


def _san(hosts: Sequence[str]) -> str:
    names = []
    for host in [*hosts, "localhost", "127.0.0.1"]:
        host = host.strip("[]")
        try:
            entry = f"IP:{ipaddress.ip_address(host)}"
        except ValueError:
            if not host or not all(c.isalnum() or c in ".-" for c in host):
                raise CertError(f"not a host name or address: {host!r}") from None
            entry = f"DNS:{host}"
        if entry not in names:
            names.append(entry)
    return ",".join(names)


def _openssl(*args: str) -> None:
    binary = shutil.which("openssl")
    if binary is None:
        raise CertError("the openssl command is not installed")
    result = subprocess.run([binary, *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise CertError(f"openssl {args[0]} failed: {result.stderr.strip()[-500:]}")


def make_certs(out: Path, hosts: Sequence[str], days: int = DEFAULT_DAYS) -> list[Path]:
    """Write a fresh CA and a server certificate for `hosts` into `out` (keys 0600, except
    nats-server.key which the NATS container reads: 0644; keep `out` private)."""
    if not hosts:
        raise CertError("--hosts names no host")
    san = _san(hosts)
    out.mkdir(parents=True, exist_ok=True)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    with tempfile.TemporaryDirectory(dir=out) as tmp_dir:
        tmp = Path(tmp_dir)
        _openssl("req", "-x509", *ec, "-keyout", str(tmp / CA_KEY), "-out", str(tmp / CA_CERT),
                 "-days", str(days), "-subj", "/CN=pdmesh dev NATS CA",
                 "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        _openssl("req", "-new", *ec, "-keyout", str(tmp / SERVER_KEY),
                 "-out", str(tmp / "server.csr"), "-subj", "/CN=pdmesh NATS")
        (tmp / "server.ext").write_text(
            f"subjectAltName={san}\nbasicConstraints=CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth,clientAuth\n")
        _openssl("x509", "-req", "-in", str(tmp / "server.csr"), "-CA", str(tmp / CA_CERT),
                 "-CAkey", str(tmp / CA_KEY), "-CAcreateserial", "-days", str(days),
                 "-extfile", str(tmp / "server.ext"), "-out", str(tmp / SERVER_CERT))
        written = []
        for name, mode in ((CA_CERT, 0o644), (CA_KEY, 0o600), (SERVER_CERT, 0o644),
                           (SERVER_KEY, 0o644)):
            os.chmod(tmp / name, mode)
            (tmp / name).replace(out / name)
            written.append(out / name)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdmesh certs",
        description="Make a dev CA and the NATS server certificate for multi-host NATS "
                    "(TLS on client connections and on cluster routes), with openssl.")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--hosts", required=True,
                        help="comma-separated addresses or names of the NATS hosts")
    parser.add_argument("--days", type=int, default=DEFAULT_DAYS,
                        help="validity in days (default: %(default)s)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    if args.days < 1:
        print("pdmesh certs: --days must be at least 1", file=sys.stderr)
        return 2
    try:
        written = make_certs(args.out, hosts, args.days)
    except (CertError, OSError) as exc:
        print(f"pdmesh certs: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, CertError) else 1
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
