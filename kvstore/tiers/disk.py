"""Tier 2: sealed entries as files in a local directory, `<dir>/<tenant_tag>/<name>.kv`.

A file is written to a temporary name beside it and renamed (`os.replace`), so a reader
sees a whole entry or none. Nothing is fsynced: this is a cache, and a file a crash left
short or zeroed fails its AEAD tag when read and is deleted then. The index (name, size)
lives in memory and is rebuilt by scanning the directory when the tier opens, so a
restarted worker starts warm; capacity is in bytes, eviction S3-FIFO, oldest files first
after a scan.

A write that fails (ENOSPC, EIO, a read-only file system: any OSError) drops that entry
and counts it in `errors["put"]`; no method raises an OSError to its caller. The tier
stores and returns bytes only: sealing and opening are the stack's (kvstore.tiers.entry).
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import threading
from pathlib import Path

from pdmesh.kvstore.evict import S3FIFO

_TAG = re.compile(r"[0-9a-f]{16}")
_NAME = re.compile(r"[0-9a-f]{64}")
SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"

_Key = tuple[str, str]  # (tenant tag, store name)


class DiskTier:
    """Sealed entries under `root`, at most `capacity_bytes` of files."""

    name = "disk"

    def __init__(self, root: str | os.PathLike[str], capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"disk tier capacity {capacity_bytes} bytes: must be > 0")
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.errors: collections.Counter[str] = collections.Counter()  # by operation
        self._sizes: dict[_Key, int] = {}
        self._purges: collections.Counter[str] = collections.Counter()  # by tenant tag
        self._policy = S3FIFO(capacity_bytes)
        self._lock = threading.Lock()
        self.root.mkdir(parents=True, exist_ok=True)
        self._scan()

    def path(self, tenant_tag: str, name: str) -> Path:
        if not (_TAG.fullmatch(tenant_tag) and _NAME.fullmatch(name)):
            raise ValueError(f"not a tenant tag and store name: {tenant_tag!r}, {name!r}")
        return self.root / tenant_tag / (name + SUFFIX)

    def put(self, tenant_tag: str, name: str, entry: bytes) -> bool:
        """Write the entry (replacing one of the same name); False if it was dropped."""
        path, key, size = self.path(tenant_tag, name), (tenant_tag, name), len(entry)
        if size > self.capacity_bytes:
            return False
        with self._lock:  # the space is reserved before the write
            victims = self._make_room(key, size)
            self._policy.insert(key, size)
            self._sizes[key] = size
            purges = self._purges[tenant_tag]
        for victim in victims:
            self._unlink(*victim)
        tmp = path.with_name(f".{name}.{os.getpid()}.{threading.get_ident()}{_TMP_SUFFIX}")
        try:
            path.parent.mkdir(exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(entry)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError:
            self._error("put")
            with contextlib.suppress(OSError):
                tmp.unlink()
            with self._lock:
                self._forget(key)
            self._unlink(tenant_tag, name)  # an older copy would stay unindexed
            return False
        with self._lock:
            purged = self._purges[tenant_tag] != purges
        if purged:  # the tenant was purged while this was written: it must not stay
            self._unlink(tenant_tag, name)
            return False
        return True

    def get(self, tenant_tag: str, name: str) -> bytes | None:
        """The entry's bytes, or None if there is none (or it cannot be read)."""
        key = (tenant_tag, name)
        with self._lock:
            if key not in self._sizes:
                return None
            self._policy.touch(key)
        try:
            return self.path(tenant_tag, name).read_bytes()
        except FileNotFoundError:  # evicted or purged by another thread meanwhile
            return None
        except OSError:
            self._error("get")
            return None

    def delete(self, tenant_tag: str, name: str) -> None:
        """Remove one entry (a refused one: corrupt, stale, another tenant's)."""
        with self._lock:
            self._forget((tenant_tag, name))
        self._unlink(tenant_tag, name)

    def purge(self, tenant_tag: str) -> int:
        """Remove every file of the tenant, indexed or not; how many there were."""
        if not _TAG.fullmatch(tenant_tag):
            raise ValueError(f"not a tenant tag: {tenant_tag!r}")
        with self._lock:
            self._purges[tenant_tag] += 1
            for key in [k for k in self._sizes if k[0] == tenant_tag]:
                self._forget(key)
        removed = 0
        folder = self.root / tenant_tag
        try:
            files = list(folder.iterdir())
        except FileNotFoundError:
            return 0
        except OSError:
            self._error("purge")
            return 0
        for file in files:
            try:
                file.unlink()
            except FileNotFoundError:
                continue
            except OSError:
                self._error("purge")
                continue
            removed += file.suffix == SUFFIX
        with contextlib.suppress(OSError):
            folder.rmdir()
        return removed

    @property
    def entries(self) -> int:
        with self._lock:
            return len(self._sizes)

    @property
    def size_bytes(self) -> int:
        with self._lock:
            return self._policy.size

    def close(self) -> None:
        """Nothing to release: files stay for the next start."""

    def _make_room(self, key: _Key, size: int) -> list[_Key]:
        """Under the lock: forget the entry being replaced and the victims that make room
        for `size` bytes; the caller unlinks the victims' files."""
        self._forget(key)
        victims = []
        while self._policy.size + size > self.capacity_bytes:
            victim = self._policy.pop_victim()
            if victim is None:
                break
            del self._sizes[victim]
            victims.append(victim)
        return victims

    def _forget(self, key: _Key) -> None:
        if self._sizes.pop(key, None) is not None:
            self._policy.remove(key)

    def _unlink(self, tenant_tag: str, name: str) -> None:
        try:
            self.path(tenant_tag, name).unlink()
        except FileNotFoundError:
            pass
        except OSError:
            self._error("delete")

    def _error(self, op: str) -> None:
        with self._lock:
            self.errors[op] += 1

    def _scan(self) -> None:
        """Index the entries already on disk, oldest first, evicting past the capacity;
        leftover temporary files of an interrupted write are removed."""
        found: list[tuple[float, _Key, int]] = []
        for folder in self.root.iterdir():
            if not (folder.is_dir() and _TAG.fullmatch(folder.name)):
                continue
            for file in folder.iterdir():
                if file.name.endswith(_TMP_SUFFIX):
                    with contextlib.suppress(OSError):
                        file.unlink()
                elif file.suffix == SUFFIX and _NAME.fullmatch(file.stem):
                    with contextlib.suppress(FileNotFoundError):
                        st = file.stat()
                        found.append((st.st_mtime, (folder.name, file.stem), st.st_size))
        found.sort()
        doomed: list[_Key] = []
        with self._lock:
            for _, key, size in found:
                if size > self.capacity_bytes:
                    doomed.append(key)
                    continue
                doomed += self._make_room(key, size)
                self._policy.insert(key, size)
                self._sizes[key] = size
        for key in doomed:
            self._unlink(*key)
