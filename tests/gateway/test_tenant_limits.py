"""Each tenant's limits: read from the tenants file with safe defaults, and enforced at the
gateway (requests in flight, request and token rates) with a 429 that names the limit and
says when to retry. The KV share and the fair order are admission's
(tests/admission/test_tenant_share.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from pdmesh.gateway.limits import TenantLimiter
from pdmesh.gateway.schema import ApiError
from pdmesh.gateway.tenants import TenantDirectory, TenantLimits
from pdmesh.services.protocol.errors import ConfigError
from tests.support.meshproc import NatsServer
from tests.support.scripted_mesh import ScriptedMesh, gateways

SALT_KEY = "a1" * 32
TWO = """
[[tenant]]
id = "a"
api_keys = ["sk-a"]
{a}

[[tenant]]
id = "b"
api_keys = ["sk-b"]
"""


def _load(tmp_path: Path, text: str) -> TenantDirectory:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return TenantDirectory.load(path, SALT_KEY)


def _limits(d: TenantDirectory, key: str) -> TenantLimits:
    tenant = d.authenticate(f"Bearer {key}")
    assert tenant is not None
    return tenant.limits


def test_defaults_are_safe_and_every_limit_can_be_set(tmp_path: Path) -> None:
    d = _load(tmp_path, TWO.format(a=""))
    assert _limits(d, "sk-a") == TenantLimits(max_concurrent=64, kv_share=0.5)
    one = _load(tmp_path, '[[tenant]]\nid = "solo"\napi_keys = ["sk-s"]\n')
    assert _limits(one, "sk-s").kv_share == 1.0  # nobody to share with
    d = _load(tmp_path, "[defaults]\nmax_concurrent = 8\nweight = 3\n" + TWO.format(
        a="kv_share = 0.25\nrequests_per_s = 5\ntokens_per_s = 1e4\nmax_concurrent = 2"))
    assert _limits(d, "sk-a") == TenantLimits(max_concurrent=2, kv_share=0.25,
                                              requests_per_s=5.0, tokens_per_s=1e4,
                                              weight=3.0)
    assert _limits(d, "sk-b") == TenantLimits(max_concurrent=8, kv_share=0.5, weight=3.0)


@pytest.mark.parametrize("text, problem", [
    (TWO.format(a="kv_shar = 0.2"), "unknown key 'kv_shar'"),
    (TWO.format(a="kv_share = 0"), "kv_share = 0 must be a number in (0, 1]"),
    (TWO.format(a="kv_share = 1.5"), "kv_share = 1.5"),
    (TWO.format(a="max_concurrent = 1.5"), "max_concurrent = 1.5 must be an integer"),
    (TWO.format(a="max_concurrent = true"), "max_concurrent = True"),
    (TWO.format(a='weight = "2"'), "weight = '2' must be a number > 0"),
    (TWO.format(a="tokens_per_s = -1"), "tokens_per_s = -1"),
    (TWO.format(a="requests_per_s = inf"), "requests_per_s = inf"),
    ("[defaults]\nbogus = 1\n" + TWO.format(a=""), "[defaults]: unknown key 'bogus'"),
    ("defaults = 3\n" + TWO.format(a=""), "defaults must be a table"),
    ("[limits]\n" + TWO.format(a=""), "unknown table or key 'limits'"),
])
def test_a_bad_limit_is_one_clear_error(tmp_path: Path, text: str, problem: str) -> None:
    with pytest.raises(ConfigError) as exc:
        _load(tmp_path, text)
    assert problem in str(exc.value)


def _tenant(tmp_path: Path, limits: str):
    return _load(tmp_path, TWO.format(a=limits)).authenticate("Bearer sk-a")


def test_concurrency_counts_choices_and_refuses_nothing_it_holds(tmp_path: Path) -> None:
    lim, t = TenantLimiter(), _tenant(tmp_path, "max_concurrent = 3")
    lim.admit(t, 2, 100)
    with pytest.raises(ApiError) as exc:
        lim.admit(t, 2, 100)  # 2 + 2 > 3
    err = exc.value
    assert (err.status, err.code, err.type) == (429, "tenant_max_concurrent",
                                                "rate_limit_error")
    assert "max_concurrent" in err.message and err.headers() == {"Retry-After": "1"}
    lim.admit(t, 1, 100)
    assert lim.in_flight("a") == 3
    lim.release("a", 2)
    lim.release("a", 1)
    assert lim.in_flight("a") == 0
    lim.admit(t, 5, 100)  # a tenant holding nothing may always have one request
    lim.release("a", 5)


def test_rates_are_one_second_buckets_and_a_refusal_costs_nothing(tmp_path: Path) -> None:
    lim, t = TenantLimiter(), _tenant(tmp_path, "requests_per_s = 2\ntokens_per_s = 1000")
    now = 100.0
    lim.admit(t, 1, 400, now)
    lim.admit(t, 1, 400, now)
    with pytest.raises(ApiError) as exc:
        lim.admit(t, 1, 10, now)  # a third request in the same second
    assert exc.value.code == "tenant_requests_per_s"
    assert exc.value.retry_after_s == pytest.approx(0.5)
    lim, t = TenantLimiter(), _tenant(tmp_path, "tokens_per_s = 1000")
    lim.admit(t, 1, 400, now)
    lim.admit(t, 1, 400, now)
    with pytest.raises(ApiError) as exc:
        lim.admit(t, 1, 1000, now + 0.5)  # 200 + 500 back: 700 of the 1000 it costs
    assert exc.value.code == "tenant_tokens_per_s"
    assert exc.value.retry_after_s == pytest.approx(0.3)
    # Larger than the bucket: waits for a full one and leaves it in debt.
    lim.admit(t, 1, 5000, now + 1.0)
    with pytest.raises(ApiError) as exc:
        lim.admit(t, 1, 1, now + 2.0)  # -4000 + 1000
    assert exc.value.retry_after_s == pytest.approx(3.001)


async def _finish(mesh: ScriptedMesh, rid: str) -> None:
    await mesh.progress_for(rid, 1.0)
    await mesh.token(rid, 0, finish=True)


@pytest.mark.mesh
async def test_the_gateway_answers_429_with_retry_after_naming_the_limit(
        nats_server: NatsServer, tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text("""
[[tenant]]
id = "alice"
api_keys = ["sk-dev-alice"]
max_concurrent = 2

[[tenant]]
id = "bob"
api_keys = ["sk-dev-bob"]
requests_per_s = 1
""")
    async with gateways(nats_server.url) as start:
        run = await start(_finish, tenants_file=str(path))

        async def post(key: str, body: dict) -> tuple[int, dict, dict]:
            async with aiohttp.ClientSession() as http, http.post(
                    run.base + "/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                        "max_tokens": 1, **body},
                    headers={"Authorization": f"Bearer {key}"}) as resp:
                return resp.status, await resp.json(), dict(resp.headers)

        first = asyncio.ensure_future(post("sk-dev-alice", {"n": 2}))
        await asyncio.sleep(0.3)  # alice has two choices in flight
        status, body, headers = await post("sk-dev-alice", {})
        assert status == 429 and body["error"]["code"] == "tenant_max_concurrent", (
            body, first.done() and first.result())
        assert headers["Retry-After"] == "1"
        assert (await first)[0] == 200, await first
        assert (await post("sk-dev-alice", {}))[0] == 200  # free again
        assert len(run.mesh.submits) == 2  # the refused one never reached admission
        ok, (status, body, headers) = sorted(await asyncio.gather(
            post("sk-dev-bob", {}), post("sk-dev-bob", {})), key=lambda r: r[0])
        assert ok[0] == 200
        assert status == 429 and body["error"]["code"] == "tenant_requests_per_s"
        assert "requests_per_s limit (1 requests per second)" in body["error"]["message"]
        assert int(headers["Retry-After"]) >= 1
        metrics = await run.metrics()
        refused = {k: v for k, v in metrics.items() if k[0] == "pdmesh:requests_total"
                   and ("reason", "tenant_limit") in k[1]}
        assert sorted((dict(k[1])["tenant"], v) for k, v in refused.items()) == [
            ("alice", 1.0), ("bob", 1.0)]
