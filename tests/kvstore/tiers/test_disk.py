"""DiskTier: files written whole, an index rebuilt at start, a full disk survived, and
(through the stack) corrupt or planted files refused and deleted."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdmesh.kvstore.tiers import DiskTier, KeyRing, TierStack, chain_digests
from tests.kvstore.tiers.conftest import BLOCK_TOKENS, GEOMETRY, MODEL, payload, prompt, put_prompt

TAG_A, TAG_B = "a" * 16, "b" * 16


def name(i: int) -> str:
    return f"{i:064x}"


def disk_stack(keys: KeyRing, root: Path, capacity_bytes: int = 1 << 20) -> TierStack:
    return TierStack(keys, MODEL, GEOMETRY, disk=DiskTier(root, capacity_bytes))


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_an_entry_is_one_file_per_tenant_folder_and_comes_back(tmp_path):
    disk = DiskTier(tmp_path, capacity_bytes=10_000)
    assert disk.put(TAG_A, name(1), b"entry one")
    assert disk.put(TAG_A, name(1), b"entry one, again")  # replaced, counted once
    assert disk.get(TAG_A, name(1)) == b"entry one, again"
    assert disk.get(TAG_B, name(1)) is None
    assert files(tmp_path) == [f"{TAG_A}/{name(1)}.kv"]
    assert (disk.entries, disk.size_bytes) == (1, len(b"entry one, again"))
    with pytest.raises(ValueError, match="not a tenant tag"):
        disk.put("../etc", name(1), b"x")


def test_capacity_evicts_files_and_a_reopened_tier_is_warm(tmp_path):
    disk = DiskTier(tmp_path, capacity_bytes=3000)
    for i in range(5):
        assert disk.put(TAG_A if i % 2 else TAG_B, name(i), bytes([i]) * 1000)
        os.utime(disk.path(TAG_A if i % 2 else TAG_B, name(i)), (1000 + i, 1000 + i))
    assert disk.entries == 3 and len(files(tmp_path)) == 3
    (tmp_path / TAG_A / f".{name(9)}.1.2.tmp").write_bytes(b"half a write")
    again = DiskTier(tmp_path, capacity_bytes=3000)
    assert again.entries == 3
    assert [again.get(TAG_A if i % 2 else TAG_B, name(i)) for i in (2, 3, 4)] == [
        bytes([i]) * 1000 for i in (2, 3, 4)]
    assert not [f for f in files(tmp_path) if f.endswith(".tmp")]
    smaller = DiskTier(tmp_path, capacity_bytes=2000)  # oldest files go first
    assert smaller.entries == 2 and smaller.get(TAG_B, name(2)) is None
    assert len(files(tmp_path)) == 2


def test_purge_removes_only_that_tenants_folder(tmp_path):
    disk = DiskTier(tmp_path, capacity_bytes=10_000)
    for i in range(3):
        disk.put(TAG_A, name(i), b"a")
        disk.put(TAG_B, name(i), b"b")
    assert disk.purge(TAG_A) == 3
    assert disk.purge(TAG_A) == 0
    assert files(tmp_path) == [f"{TAG_B}/{name(i)}.kv" for i in range(3)]
    assert disk.entries == 3


@contextlib.contextmanager
def small_disk(path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A 2 MiB tmpfs at `path` (the real ENOSPC); where mounting is not allowed, os.write
    raising ENOSPC once 2 MiB were written. Yields which one it is."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(path)],
                             capture_output=True).returncode == 0
    if not mounted:
        real_write, written = os.write, [0]

        def write(fd: int, data) -> int:
            if written[0] + len(data) > 2 << 20:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            written[0] += len(data)
            return real_write(fd, data)
        monkeypatch.setattr(os, "write", write)
    try:
        yield "tmpfs" if mounted else "simulated"
    finally:
        if mounted:
            subprocess.run(["umount", str(path)], check=True)


def test_a_full_disk_drops_the_put_and_counts_it(tmp_path, monkeypatch):
    with small_disk(tmp_path / "small", monkeypatch) as kind:
        disk = DiskTier(tmp_path / "small", capacity_bytes=64 << 20)
        results = [disk.put(TAG_A, name(i), bytes([i]) * (300 << 10)) for i in range(10)]
        assert results[0] and not results[-1], (kind, results)
        stored = [i for i, ok in enumerate(results) if ok]
        assert disk.errors["put"] == results.count(False) >= 1
        assert disk.entries == len(stored)
        assert all(disk.get(TAG_A, name(i)) == bytes([i]) * (300 << 10) for i in stored)
        assert not [f for f in files(tmp_path / "small") if f.endswith(".tmp")], kind
        disk.purge(TAG_A)  # room again: the next put works
        assert disk.put(TAG_A, name(99), b"fits")


@pytest.mark.parametrize("damage", ["flip", "truncate", "zero"])
def test_a_corrupted_file_is_refused_and_deleted(keys, tmp_path, damage):
    stack = disk_stack(keys, tmp_path)
    ids = prompt("corrupt", 2)
    put_prompt(stack, "acme", ids)
    assert stack.flush(10)
    tag = keys.for_salt("acme").tenant_tag
    victim = sorted((tmp_path / tag).iterdir())[0]
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    elif damage == "truncate":
        data = data[:12]
    else:
        data = bytearray(len(data))
    victim.write_bytes(bytes(data))
    found = stack.lookup("acme", ids, 0, 2)
    reason = {"flip": "mac", "truncate": "malformed", "zero": "malformed"}[damage]
    assert stack.counters()[f"kv_tier_refused_disk_{reason}"] == 1
    assert not victim.exists()
    assert len(found) < 2 and stack.entries()["disk"] == 1
    stack.close()


def test_another_tenants_file_planted_under_this_tenants_name_is_refused_mac(keys, tmp_path):
    stack = disk_stack(keys, tmp_path)
    ids = prompt("same prompt, two tenants", 1)
    put_prompt(stack, "tenant-a", ids, seed="a's secret")
    assert stack.flush(10)
    tag_a, tag_b = (keys.for_salt(s).tenant_tag for s in ("tenant-a", "tenant-b"))
    (entry_a,) = (tmp_path / tag_a).iterdir()
    name_b = keys.for_salt("tenant-b").name(chain_digests("tenant-b", ids, BLOCK_TOKENS)[0])
    (tmp_path / tag_b).mkdir()
    planted = tmp_path / tag_b / f"{name_b}.kv"
    shutil.copy(entry_a, planted)
    stack.close()
    stack = disk_stack(keys, tmp_path)  # a restart indexes the planted file
    assert stack.lookup("tenant-b", ids, 0, 1) == []
    assert stack.counters()["kv_tier_refused_disk_mac"] == 1
    assert not planted.exists() and entry_a.exists()
    assert stack.lookup("tenant-a", ids, 0, 1)[0].payload == payload("a's secret", 0)
    stack.close()


def test_a_restarted_worker_loads_from_disk(keys, tmp_path):
    stack = disk_stack(keys, tmp_path)
    ids = prompt("warm", 3)
    put_prompt(stack, "acme", ids)
    assert stack.flush(10)
    stack.close()
    stack = disk_stack(keys, tmp_path)
    found = stack.lookup("acme", ids, 0, 3)
    assert [(b.index, b.tier) for b in found] == [(0, "disk"), (1, "disk"), (2, "disk")]
    assert [b.payload for b in found] == [payload("kv", i) for i in range(3)]
    stack.close()
