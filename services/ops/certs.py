"""`pdmesh certs`: a development CA and the TLS certificates of a multi-host NATS cluster.

    pdmesh certs --out DIR --hosts 10.0.0.10,10.0.0.11,10.0.0.12

writes, with the `openssl` command (no Python crypto dependency):

    nats-ca.crt                        the CA certificate (public: 0644, every host)
    nats-server.crt / nats-server.key  one certificate for every NATS node, valid for each of
                                       `--hosts` plus localhost/127.0.0.1 (services reach their
                                       own host's node on loopback); server and client use,
                                       so routes verify each other with it (mutual TLS);
                                       the certificate 0644, the key 0600 (every NATS host)
    ca-private/nats-ca.key             the CA's private key (0600, in its own 0700 directory:
                                       it only signs, and stays on the machine that made it)

Clients (services, `pdmesh check`) verify the server against `nats-ca.crt`
(`PDMESH_NATS_TLS_CA`) and authenticate with their NATS user and password; routes present
`nats-server.crt` both ways. It is a dev CA: for production, issue these from your own.

Every file is created with its final mode and every directory this module creates is 0700,
whatever the umask (`write_private`, `private_dir`); an existing output directory that
group or others may read is tightened to 0700, with a line saying so. A `nats-ca.key`
directly in DIR (where a CA key must not lie) is left in place, made 0600 and warned about.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

CA_CERT = "nats-ca.crt"
CA_PRIVATE_DIR = "ca-private"  # under the output directory; never copied to the hosts
CA_KEY = f"{CA_PRIVATE_DIR}/nats-ca.key"
SERVER_CERT, SERVER_KEY = "nats-server.crt", "nats-server.key"
DEFAULT_DAYS = 365
SECRET_MODE, PUBLIC_MODE, DIR_MODE = 0o600, 0o644, 0o700
# The modes of the files `make_certs` writes: only the two certificates are public.
MODES = {CA_CERT: PUBLIC_MODE, CA_KEY: SECRET_MODE, SERVER_CERT: PUBLIC_MODE,
         SERVER_KEY: SECRET_MODE}

Note = Callable[[str], None]


class CertError(Exception):
    """openssl is missing or failed, or a host name is not usable in a certificate."""


def silent(_: str) -> None:
    """A `Note` that drops the line (the default where no one reports to an operator)."""


def private_dir(path: Path, note: Note = silent) -> Path:
    """Make `path` a directory only its owner may use: each missing directory (parents too) is
    created 0700 whatever the umask; an existing one that group or others may read, write or
    enter loses those bits, and `note` gets a line saying so."""
    missing = []
    probe = path
    while not probe.exists() and not probe.is_symlink():
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        directory.mkdir(mode=DIR_MODE, exist_ok=True)
        os.chmod(directory, DIR_MODE)  # mkdir's mode passes through the umask
    if not missing:
        if not path.is_dir():
            raise NotADirectoryError(f"{path} is not a directory")
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:  # guard: secrets-tighten
            os.chmod(path, mode & ~0o077)
            note(f"tightened {path} from {mode:04o} to {mode & ~0o077:04o}")
    return path


def tighten(path: Path, mode: int, note: Note = silent) -> None:
    """Take from an existing file the permission bits that `mode` does not grant, saying so
    through `note` when it had any."""
    current = stat.S_IMODE(path.stat().st_mode)
    if current & ~mode:
        os.chmod(path, current & mode)
        note(f"tightened {path} from {current:04o} to {current & mode:04o}")


def write_private(path: Path, data: str | bytes, mode: int = SECRET_MODE) -> Path:
    """Replace `path` with `data`, atomically: the data goes to a temporary file in the same
    directory, created 0600 with O_CREAT|O_EXCL (mkstemp) and set to `mode` with fchmod
    before anything is written, then renamed over `path`. So no reader ever finds a partial
    file, and the file never has more permission than `mode`, whatever the umask."""
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), mode)
            out.write(raw)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


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


def make_certs(out: Path, hosts: Sequence[str], days: int = DEFAULT_DAYS,
               note: Note = silent) -> list[Path]:
    """Write a fresh CA and a server certificate for `hosts`: into `out` the certificates
    (0644) and `nats-server.key` (0600), the CA key into `out/ca-private/` (0600; that
    directory 0700). `out` is made private first (`private_dir`; `note` hears of any
    tightening, and of a `nats-ca.key` lying directly in `out`). Returns the paths written."""
    if not hosts:
        raise CertError("--hosts names no host")
    san = _san(hosts)
    private_dir(out, note)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    with tempfile.TemporaryDirectory(dir=out) as tmp_dir:  # 0700 (mkdtemp)
        tmp = Path(tmp_dir)
        ca_key = tmp / "ca.key"
        _openssl("req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(tmp / CA_CERT),
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
                 "-CAkey", str(ca_key), "-CAcreateserial", "-days", str(days),
                 "-extfile", str(tmp / "server.ext"), "-out", str(tmp / SERVER_CERT))
        made = {CA_CERT: tmp / CA_CERT, CA_KEY: ca_key, SERVER_CERT: tmp / SERVER_CERT,
                SERVER_KEY: tmp / SERVER_KEY}
        private_dir(out / CA_PRIVATE_DIR, note)
        written = [write_private(out / name, made[name].read_bytes(), MODES[name])
                   for name in (CA_KEY, CA_CERT, SERVER_CERT, SERVER_KEY)]
    stray = out / Path(CA_KEY).name  # a CA key lying with the files copied to the hosts
    if stray.exists():
        tighten(stray, SECRET_MODE, note)
        note(f"warning: {stray} is not this CA's key (that is {out / CA_KEY}) and lies "
             "with the files copied to the hosts: move it off them or delete it")
    return written


def _say(line: str) -> None:
    print(f"pdmesh certs: {line}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdmesh certs",
        description="Make a dev CA and the NATS server certificate for multi-host NATS "
                    "(TLS on client connections and on cluster routes), with openssl. "
                    "Certificates are 0644, keys 0600, directories 0700; the CA key goes to "
                    "OUT/ca-private/, apart from the files the hosts need.")
    parser.add_argument("--out", required=True, type=Path,
                        help="output directory (made or tightened to 0700)")
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
        written = make_certs(args.out, hosts, args.days, note=_say)
    except (CertError, OSError) as exc:
        print(f"pdmesh certs: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, CertError) else 1
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
