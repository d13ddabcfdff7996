"""RemoteTier on a real redis-server: round trip with an expiry, planted and altered
entries refused, and a store that is killed, paused or full costs misses, never errors."""

from __future__ import annotations

import threading
import time

from pdmesh.kvstore.tiers import KeyRing, RemoteTier, TierStack, chain_digests
from tests.kvstore.tiers.conftest import (
    BLOCK_TOKENS,
    GEOMETRY,
    MODEL,
    payload,
    prompt,
    put_prompt,
)
from tests.support.redisproc import RedisServer

TAG_A, TAG_B = "a" * 16, "b" * 16
TIMEOUT_S = 0.3


def name(i: int) -> str:
    return f"{i:064x}"


def remote_stack(keys: KeyRing, server: RedisServer, **kw) -> TierStack:
    remote = RemoteTier(server.url, ttl_s=60, timeout_s=TIMEOUT_S, **kw)
    return TierStack(keys, MODEL, GEOMETRY, remote=remote)


def test_an_entry_is_set_with_the_ttl_under_its_tenants_prefix(redis_server):
    remote = RemoteTier(redis_server.url, ttl_s=60, timeout_s=TIMEOUT_S)
    assert remote.put(TAG_A, name(1), b"entry")
    assert remote.get(TAG_A, name(1)) == b"entry"
    assert remote.get(TAG_B, name(1)) is None
    client = redis_server.client()
    key = f"pdmesh:kv:{TAG_A}:{name(1)}"
    assert client.keys("*") == [key.encode()]
    assert 0 < client.pttl(key) <= 60_000
    remote.delete(TAG_A, name(1))
    assert remote.get(TAG_A, name(1)) is None and not remote.errors
    remote.close()
    client.close()


def test_purge_unlinks_only_that_tenants_keys(redis_server):
    remote = RemoteTier(redis_server.url, ttl_s=60, timeout_s=TIMEOUT_S)
    for i in range(300):  # past one UNLINK batch
        remote.put(TAG_A, name(i), b"a")
    remote.put(TAG_B, name(1), b"b")
    client = redis_server.client()
    client.set("pdmesh:kvother", b"not ours")
    assert remote.purge(TAG_A) == 300
    assert sorted(client.keys("*")) == sorted([b"pdmesh:kvother",
                                               f"pdmesh:kv:{TAG_B}:{name(1)}".encode()])
    remote.close()
    client.close()


def test_another_tenants_entry_planted_in_the_store_is_refused_mac(keys, redis_server):
    stack = remote_stack(keys, redis_server)
    ids = prompt("same prompt, two tenants", 1)
    put_prompt(stack, "tenant-a", ids)
    assert stack.flush(10)
    client = redis_server.client()
    (key_a,) = client.keys("pdmesh:kv:*")
    keys_b = keys.for_salt("tenant-b")
    key_b = RemoteTier.key(keys_b.tenant_tag,
                           keys_b.name(chain_digests("tenant-b", ids, BLOCK_TOKENS)[0]))
    client.set(key_b, client.get(key_a))
    assert stack.lookup("tenant-b", ids, 0, 1) == []
    assert stack.counters()["kv_tier_refused_remote_mac"] == 1
    assert not client.exists(key_b) and client.exists(key_a)
    stack.close()
    client.close()


def test_an_altered_entry_in_the_store_is_refused_mac(keys, redis_server):
    stack = remote_stack(keys, redis_server)
    ids = prompt("altered", 1)
    put_prompt(stack, "acme", ids)
    assert stack.flush(10)
    client = redis_server.client()
    (key,) = client.keys("pdmesh:kv:*")
    value = bytearray(client.get(key))
    value[-40] ^= 0x01
    client.set(key, bytes(value))
    assert stack.lookup("acme", ids, 0, 1) == []
    assert stack.counters()["kv_tier_refused_remote_mac"] == 1
    stack.close()
    client.close()


def test_a_store_killed_between_put_and_get_is_a_miss_and_an_error(keys, redis_server):
    stack = remote_stack(keys, redis_server)
    ids = prompt("killed", 2)
    put_prompt(stack, "acme", ids)
    assert stack.flush(10)
    assert len(stack.lookup("acme", ids, 0, 2)) == 2
    redis_server.kill()
    started = time.monotonic()
    assert stack.lookup("acme", ids, 0, 2) == []
    assert stack.lookup("acme", ids, 0, 2) == []  # marked down: not even tried
    assert time.monotonic() - started < 2 * TIMEOUT_S
    put_prompt(stack, "acme", prompt("after the kill", 1))  # dropped, counted, no raise
    assert stack.flush(10)
    errors = stack.errors()
    assert errors[("remote", "get")] == 1 and errors[("remote", "down")] >= 2, errors
    assert stack.counters()["kv_tier_misses_remote"] == 2
    assert stack.purge("acme") == {"remote": 0}
    assert stack.errors()[("remote", "purge")] == 1
    stack.close()


def test_a_paused_store_answers_a_lookup_within_the_timeout_as_a_miss(keys, redis_server):
    stack = remote_stack(keys, redis_server)
    ids = prompt("paused", 3)
    put_prompt(stack, "acme", ids)
    assert stack.flush(10)
    pauser = redis_server.client()
    pauser.execute_command("CLIENT", "PAUSE", "2000")
    started = time.monotonic()
    assert stack.lookup("acme", ids, 0, 3) == []
    assert time.monotonic() - started < TIMEOUT_S + 0.5
    assert stack.errors()[("remote", "get")] == 1
    pauser.close()
    stack.close()


def test_a_full_store_drops_the_put_and_counts_it(keys, redis_server):
    client = redis_server.client()
    client.config_set("maxmemory-policy", "noeviction")
    # 1 MiB past what the empty server uses (its own baseline is about 1 MiB).
    client.config_set("maxmemory", client.info("memory")["used_memory"] + (1 << 20))
    remote = RemoteTier(redis_server.url, ttl_s=60, timeout_s=TIMEOUT_S)
    results = [remote.put(TAG_A, name(i), bytes(100 << 10)) for i in range(40)]
    assert results[0] and not results[-1], results
    assert remote.errors["put"] == results.count(False)
    assert remote.get(TAG_A, name(0)) == bytes(100 << 10)  # still up: reads go on
    assert remote.errors["down"] == 0
    remote.close()
    client.close()


def test_puts_and_gets_from_several_threads_share_the_client(redis_server):
    threads = 4
    remote = RemoteTier(redis_server.url, ttl_s=60, timeout_s=TIMEOUT_S)
    failures: list[str] = []

    def work(t: int) -> None:
        for i in range(50):
            data = payload(f"t{t}", i)
            if not remote.put(TAG_A, name(t * 1000 + i), data):
                failures.append(f"put {t}/{i}")
            elif remote.get(TAG_A, name(t * 1000 + i)) != data:
                failures.append(f"get {t}/{i}")
    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert failures == [] and not remote.errors
    remote.close()
