"""Prefix cache on the running mesh: usage reports hits for the same tenant only (I7), a
client cannot choose a salt, and greedy outputs equal the single-process oracle (I4)."""

from __future__ import annotations

import uuid

import pytest

from pdmesh.gateway.tenants import TenantDirectory
from pdmesh.services.engine.model import PREFILL_CHUNK
from tests.support.meshproc import DEV_KEYS, Mesh
from tests.support.oracle import expected_text

pytestmark = [pytest.mark.mesh, pytest.mark.slow]
MAX_TOKENS = 6


def complete(mesh: Mesh, key: str, prompt: str, **extra: object) -> tuple[int, dict]:
    return mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        **extra}, key=key)


def cached_tokens(body: dict) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_same_tenant_hits_other_tenant_never(live_mesh: Mesh) -> None:
    # ~1100 tokens, unique to this run so nothing else on the shared mesh cached it.
    marker = uuid.uuid4().hex
    system = (f"[{marker}] You are a careful assistant. " * 40)[:1080]
    prompt = system + " Q: capital?"
    expected = expected_text(prompt, MAX_TOKENS)

    status, first = complete(live_mesh, DEV_KEYS["alice"], prompt)
    assert status == 200, first
    assert cached_tokens(first) == 0  # cold
    assert first["choices"][0]["text"] == expected

    status, second = complete(live_mesh, DEV_KEYS["alice"], prompt)
    assert status == 200, second
    prompt_tokens = second["usage"]["prompt_tokens"]
    # Positive control: whole prefill chunks, always leaving the last token to compute.
    assert cached_tokens(second) == (prompt_tokens - 1) // PREFILL_CHUNK * PREFILL_CHUNK > 0
    assert second["choices"][0]["text"] == expected  # same output from cached KV

    status, bob = complete(live_mesh, DEV_KEYS["bob"], prompt)
    assert status == 200, bob
    assert cached_tokens(bob) == 0  # identical tokens, other tenant: no hit
    assert bob["choices"][0]["text"] == expected

    # A client cannot pick a salt: even alice's real (server-side) salt sent by carol is
    # either refused or changes nothing (carol's first run misses; later ones hit only
    # what carol herself cached).
    alice_salt = TenantDirectory.load("", live_mesh.salt_key).authenticate(
        f"Bearer {DEV_KEYS['alice']}").cache_salt
    carol_runs = 0
    for salt in (alice_salt, "alice"):
        status, carol = complete(live_mesh, DEV_KEYS["carol"], prompt, cache_salt=salt)
        if status == 200:
            assert cached_tokens(carol) == (cached_tokens(second) if carol_runs else 0), salt
            assert carol["choices"][0]["text"] == expected
            carol_runs += 1
        else:
            assert status == 400 and "cache_salt" in str(carol), carol
