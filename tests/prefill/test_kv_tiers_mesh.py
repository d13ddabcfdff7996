"""The KV tiers on a running mesh: a prompt the pool evicted comes back from host memory,
disk or the shared Redis store with the output of the single-process oracle (I4); another
tenant sending the same prompt gets nothing from any tier (I7); a restarted prefill worker
and a second mesh on the same store are warm; a store killed, paused or corrupted costs only
the cache, never a request."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdmesh.services.engine.model import PREFILL_CHUNK
from tests.support.meshproc import DEV_KEYS, Mesh, mesh_env, run_mesh
from tests.support.meshstats import heartbeats, worker_stats
from tests.support.oracle import expected_text
from tests.support.redisproc import RedisServer, running_redis

pytestmark = [pytest.mark.mesh, pytest.mark.slow]
MAX_TOKENS = 4
POOL_TOKENS = 2048  # four blocks: a few prompts evict each other
HOST_TOKENS = 2048
PROMPT_CHARS = 1100  # two whole blocks cached per prompt


def prompt_of(tag: str) -> str:
    return (f"[{tag}] Read the document, then answer. " * 40)[:PROMPT_CHARS]


def complete(mesh: Mesh, prompt: str, tenant: str = "alice") -> tuple[int, str]:
    """(cached_tokens, text) of one greedy completion; the output is checked against the
    oracle here, for every request."""
    status, body = mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0},
        key=DEV_KEYS[tenant], timeout=120)
    assert status == 200, body
    text = body["choices"][0]["text"]
    assert text == expected_text(prompt, MAX_TOKENS)  # I4: whatever tier served it
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"]), text


def seeded(mesh: Mesh, prompt: str) -> tuple[int, str]:
    """(cached_tokens, text) of one seeded sampled completion."""
    status, body = mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.9, "seed": 7},
        key=DEV_KEYS["alice"], timeout=120)
    assert status == 200, body
    return (int(body["usage"]["prompt_tokens_details"]["cached_tokens"]),
            body["choices"][0]["text"])


def tier_counters(mesh: Mesh) -> dict[str, float]:
    """The prefill worker's `kv_tier_*` counters (StatsReply)."""
    for reply in worker_stats(mesh.nats_url).values():
        if reply.role.value == "prefill":
            return {k: v for k, v in reply.counters.items() if k.startswith("kv_tier_")}
    raise AssertionError("no prefill worker answered")


def evict_from_pool_and_host(mesh: Mesh, tag: str, n: int = 4) -> None:
    for i in range(n):  # each caches two blocks: the pool and host memory hold four
        complete(mesh, prompt_of(f"{tag}-filler-{i}-{uuid.uuid4().hex[:6]}"))


def restart_prefill(mesh: Mesh) -> None:
    """SIGKILL the prefill worker; `pdmesh up` starts it again (same worker id)."""
    victims = [pid for pid in mesh.child_pids()
               if b"prefill" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(victims) == 1, victims
    os.kill(victims[0], signal.SIGKILL)
    deadline = time.monotonic() + 90
    time.sleep(2)
    while time.monotonic() < deadline:
        beats = heartbeats(mesh.nats_url, 1.0)
        if any(b.role.value == "prefill" and b.ready for b in beats.values()):
            status, _ = mesh.http("GET", "/v1/models")
            if status == 200:
                return
        time.sleep(0.5)
    raise AssertionError("the prefill worker did not come back")


@pytest.fixture(scope="module")
def store() -> Iterator[RedisServer]:
    with running_redis("--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru") as server:
        yield server


@pytest.fixture(scope="module")
def keys() -> dict[str, str]:
    return {"PDMESH_KV_TIER_KEY": secrets.token_hex(32), "PDMESH_SALT_KEY": secrets.token_hex(32)}


def tier_mesh(store: RedisServer, keys: dict[str, str], disk: Path | None):
    args = ["--kv-tokens", str(POOL_TOKENS), "--kv-host-tokens", str(HOST_TOKENS),
            "--kv-remote-url", store.url, "--kv-remote-timeout-s", "0.3"]
    if disk is not None:
        args += ["--kv-disk-dir", str(disk)]
    return run_mesh(*args, env=mesh_env(**keys))


@pytest.fixture(scope="module")
def mesh(store: RedisServer, keys: dict[str, str],
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with tier_mesh(store, keys, tmp_path_factory.mktemp("kv-disk")) as m:
        yield m


def test_an_evicted_prompt_comes_back_from_a_tier_and_no_other_tenant_gets_it(
        mesh: Mesh) -> None:
    prompt = prompt_of(f"doc-{uuid.uuid4().hex}")
    whole = (len(prompt) - 1) // PREFILL_CHUNK * PREFILL_CHUNK
    assert complete(mesh, prompt)[0] == 0  # cold
    evict_from_pool_and_host(mesh, "evict")
    before = tier_counters(mesh)
    assert complete(mesh, prompt)[0] == whole  # every cached block, from below the pool
    after = tier_counters(mesh)
    assert sum(after.get(f"kv_tier_hits_{t}", 0) - before.get(f"kv_tier_hits_{t}", 0)
               for t in ("host", "disk", "remote")) >= whole // PREFILL_CHUNK
    # Seeded sampling too: the same text from computed and from loaded KV (I4).
    sampled = prompt_of(f"seeded-{uuid.uuid4().hex}")
    cold_cached, cold_text = seeded(mesh, sampled)
    evict_from_pool_and_host(mesh, "evict-seeded")
    warm_cached, warm_text = seeded(mesh, sampled)
    assert (cold_cached, warm_cached, warm_text) == (0, whole, cold_text)
    # The same tokens from another tenant: nothing from the pool or any tier (I7).
    evict_from_pool_and_host(mesh, "evict-again")
    assert complete(mesh, prompt, tenant="bob")[0] == 0


def test_a_restarted_prefill_worker_is_warm_from_disk_and_the_store(mesh: Mesh) -> None:
    prompt = prompt_of(f"restart-{uuid.uuid4().hex}")
    whole = (len(prompt) - 1) // PREFILL_CHUNK * PREFILL_CHUNK
    assert complete(mesh, prompt)[0] == 0
    restart_prefill(mesh)  # pool and host memory are gone
    assert complete(mesh, prompt)[0] == whole


def test_a_second_mesh_on_the_same_store_serves_the_first_ones_prefix(
        mesh: Mesh, store: RedisServer, keys: dict[str, str]) -> None:
    prompt = prompt_of(f"shared-{uuid.uuid4().hex}")
    whole = (len(prompt) - 1) // PREFILL_CHUNK * PREFILL_CHUNK
    assert complete(mesh, prompt)[0] == 0
    with tier_mesh(store, keys, disk=None) as other:  # another prefill worker, no disk
        assert complete(other, prompt)[0] == whole
        assert tier_counters(other).get("kv_tier_hits_remote", 0) >= whole // PREFILL_CHUNK
        assert complete(other, prompt, tenant="bob")[0] == 0


def test_a_corrupted_disk_and_a_store_holding_forged_entries_cost_only_the_cache(
        mesh: Mesh, store: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> None:
    prompt = prompt_of(f"corrupt-{uuid.uuid4().hex}")
    assert complete(mesh, prompt)[0] == 0
    # Every entry at rest altered: disk files get a flipped byte, store values too.
    args = list(mesh.proc.args)  # type: ignore[arg-type]
    disk = Path(args[args.index("--kv-disk-dir") + 1])
    flipped = 0
    for path in disk.rglob("*.kv"):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
        flipped += 1
    client = store.client()
    for key in client.scan_iter(match="pdmesh:kv:*"):
        value = bytearray(client.get(key))
        value[len(value) // 2] ^= 0x40
        client.set(key, bytes(value))
        flipped += 1
    assert flipped
    restart_prefill(mesh)  # nothing left in memory: only the altered entries below
    before = tier_counters(mesh)
    assert complete(mesh, prompt)[0] == 0  # refused, recomputed, the oracle's answer
    after = tier_counters(mesh)
    refused = sum(v - before.get(k, 0) for k, v in after.items()
                  if k.startswith("kv_tier_refused_"))
    assert refused >= 1, after


def test_cache_purge_deletes_a_tenants_kv_in_every_tier_and_no_one_elses(
        mesh: Mesh, keys: dict[str, str]) -> None:
    prompt = prompt_of(f"purge-{uuid.uuid4().hex}")
    whole = (len(prompt) - 1) // PREFILL_CHUNK * PREFILL_CHUNK
    complete(mesh, prompt)
    complete(mesh, prompt, tenant="bob")
    out = subprocess.run(
        [sys.executable, "-m", "pdmesh.services.ops.cli", "cache", "purge", "--tenant",
         "alice", "--nats-url", mesh.nats_url, "--json", "--wait-s", "1.5"],
        env={**os.environ, "PDMESH_SALT_KEY": keys["PDMESH_SALT_KEY"]},
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    (answer,) = report["workers"].values()
    assert answer["error"] == "" and answer["removed"]["pool"] >= 1
    assert answer["removed"]["host"] >= 1 and answer["removed"]["disk"] >= 1
    assert answer["removed"]["remote"] >= 1
    assert complete(mesh, prompt)[0] == 0  # gone from the pool and every tier
    assert complete(mesh, prompt, tenant="bob")[0] == whole  # bob's untouched


def test_a_store_paused_or_killed_never_fails_a_request(mesh: Mesh,
                                                        store: RedisServer) -> None:
    prompt = prompt_of(f"paused-{uuid.uuid4().hex}")
    pauser = store.client()
    pauser.execute_command("CLIENT", "PAUSE", "3000")  # every other client waits 3 s
    started = time.monotonic()
    complete(mesh, prompt)
    complete(mesh, prompt)  # served from the pool or host memory, the store still paused
    assert time.monotonic() - started < 60
    time.sleep(3)
    store.kill()  # the last test of the module: the store is gone for good
    evict_from_pool_and_host(mesh, "killed", n=2)
    complete(mesh, prompt)
    assert tier_counters(mesh).get("kv_tier_errors_remote", 0) >= 1
