"""A real redis-server for the KV tier-3 tests: started on a free loopback port in a
directory of its own, nothing saved, stopped (or killed) by the test."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

from pdmesh.services.ops.launcher import free_port

MISSING = ("redis-server is not installed: the KV tier-3 tests need it (`apt-get install "
           "redis-server`; `make test` installs it)")


@dataclass
class RedisServer:
    proc: subprocess.Popen[bytes]
    port: int
    workdir: str

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):  # redis.Redis, imported lazily
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def start_redis(*extra: str, port: int | None = None) -> RedisServer:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(MISSING)
    port = port or free_port()
    workdir = tempfile.mkdtemp(prefix="pdmesh-redis-")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir, *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return RedisServer(proc, port, workdir)
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not listen within 15 s")


@contextlib.contextmanager
def running_redis(*extra: str) -> Iterator[RedisServer]:
    server = start_redis(*extra)
    try:
        yield server
    finally:
        server.kill()
        shutil.rmtree(server.workdir, ignore_errors=True)
