"""Network namespaces as hosts: the plumbing of the multi-host test (root only).

A `Switch` is one namespace holding a Linux bridge; `Switch.add_host(name, address)` makes a
namespace for a host and joins it to the bridge with a veth pair (the host end is `eth0`, the
switch end is the host's port). Everything lives in namespaces this module creates: nothing
is added to the machine's own network namespace, and traffic goes only between those
namespaces' private addresses and their loopbacks. `cut(host)` / `restore(host)` set the
host's switch port down / up (a pulled cable).

Threads of the test process can enter a namespace (`NetnsThreads`: a thread pool whose
threads called setns(2) first), so plain urllib and nats-py clients talk to the hosts.

    python -m tests.support.netns   # exit 0 when namespaces can be created here, else 1
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

NETNS_DIR = "/run/netns"
CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def ip(*args: str) -> None:
    """Run `ip <args>`; raise with ip's own message when it fails."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def netns_path(name: str) -> str:
    return f"{NETNS_DIR}/{name}"


def enter(name: str) -> None:
    """Move the calling thread into namespace `name` (setns(2) is per thread)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(netns_path(name), os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


def command_in(name: str, argv: list[str]) -> list[str]:
    """`argv` run inside namespace `name` (nsenter execs it: the pid is the program's)."""
    return ["nsenter", f"--net={netns_path(name)}", "--", *argv]


class NetnsThreads:
    """A thread pool whose threads live in one namespace: `run(fn, ...)` calls fn there.

    Sockets keep the namespace they were created in, so everything a call opens (HTTP,
    NATS) is opened from inside the host."""

    def __init__(self, name: str, workers: int = 16) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix=f"netns-{name}", initializer=enter, initargs=(name,))

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any
               ) -> concurrent.futures.Future[T]:
        return self.pool.submit(fn, *args, **kwargs)

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return self.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


@dataclass
class Host:
    name: str  # the namespace
    address: str  # its eth0 address on the switch's subnet
    port: str  # its veth end in the switch namespace


@dataclass
class Switch:
    """A bridge in its own namespace, and the hosts joined to it."""

    prefix: str  # namespace names start with it (unique per run)
    subnet: str = "10.231.0"  # /24; hosts get .10, .11, ...
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.prefix}-sw"

    def create(self) -> Switch:
        ip("netns", "add", self.name)
        ip("-n", self.name, "link", "set", "lo", "up")
        ip("-n", self.name, "link", "add", "br0", "type", "bridge")
        ip("-n", self.name, "link", "set", "br0", "up")
        return self

    def add_host(self, role: str) -> Host:
        ns = f"{self.prefix}-{role}"
        address = f"{self.subnet}.{10 + len(self.hosts)}"
        port = f"p-{role}"[:15]
        ip("netns", "add", ns)
        self.hosts[role] = Host(ns, address, port)
        ip("-n", ns, "link", "set", "lo", "up")
        # Both ends are created straight inside their namespaces.
        ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port,
           "netns", self.name)
        ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", self.name, "link", "set", port, "master", "br0")
        ip("-n", self.name, "link", "set", port, "up")
        return self.hosts[role]

    def cut(self, role: str) -> None:
        ip("-n", self.name, "link", "set", self.hosts[role].port, "down")

    def restore(self, role: str) -> None:
        ip("-n", self.name, "link", "set", self.hosts[role].port, "up")

    def destroy(self) -> None:
        """Delete every namespace (their veths go with them). Idempotent."""
        for host in self.hosts.values():
            with contextlib.suppress(RuntimeError):
                ip("netns", "del", host.name)
        self.hosts.clear()
        with contextlib.suppress(RuntimeError):
            ip("netns", "del", self.name)


def probe() -> str:
    """'' when namespaces, a bridge and veths can be made here; else why not."""
    switch = Switch(prefix=f"pdmhprobe{os.getpid()}")
    try:
        switch.create()
        switch.add_host("a")
    except (RuntimeError, OSError) as exc:
        return str(exc)
    finally:
        switch.destroy()
    return ""


if __name__ == "__main__":
    why = probe()
    if why:
        print(f"network namespaces unavailable: {why}", file=sys.stderr)
    sys.exit(1 if why else 0)
