"""The gateway's /metrics: latency histograms and request/token counters by tenant and
outcome move exactly as the requests that were made (tenant carol, used only here)."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request

import nats
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.services.protocol import messages as m
from tests.support.meshproc import REPO, Mesh

pytestmark = pytest.mark.mesh

TENANT, KEY = "carol", "sk-dev-carol"
DASHBOARD = REPO / "compose/observability/grafana/dashboards/pdmesh.json"


def scrape(mesh: Mesh) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(mesh.metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, frozenset({"model_name": "tiny", "tenant": TENANT, **labels}.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_by_tenant_and_outcome(live_mesh: Mesh) -> None:
    before = scrape(live_mesh)
    client = openai.OpenAI(base_url=live_mesh.base_url, api_key=KEY, max_retries=0)
    with client:
        done = client.completions.create(model="tiny", prompt="Hello", max_tokens=6,
                                         temperature=0)
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
            temperature=0, stream=True, stream_options={"include_usage": True})
        usage = [c.usage for c in stream if c.usage][0]
        try:
            client.completions.create(model="tiny", prompt="x" * (live_mesh.max_context + 1),
                                      max_tokens=4)
        except openai.BadRequestError as exc:
            assert exc.code == "context_length_exceeded"
        else:
            raise AssertionError("over-long prompt was accepted")
        try:
            client.completions.create(model="tiny", prompt="Hello", n=99)
        except openai.BadRequestError as exc:
            assert exc.param == "n"
        else:
            raise AssertionError("n=99 was accepted")
    after = scrape(live_mesh)

    # Labels are the mesh's one vocabulary: the terminal state and the reason code.
    def finished(name: str) -> float:  # a finish is `stop` (EOS) or `length`
        return sum(delta(before, after, name, outcome="finished", reason=r)
                   for r in ("stop", "length"))

    assert finished("pdmesh:requests_total") == 2
    assert delta(before, after, "pdmesh:requests_total", outcome="rejected",
                 reason="context_length_exceeded") == 1
    assert delta(before, after, "pdmesh:requests_total", outcome="rejected",
                 reason="invalid") == 1
    assert finished("pdmesh:e2e_request_latency_seconds_count") == 2
    assert finished("pdmesh:e2e_request_latency_seconds_sum") > 0
    assert delta(before, after, "pdmesh:time_to_first_token_seconds_count") == 2
    assert delta(before, after, "pdmesh:time_to_first_token_seconds_sum") > 0
    # At least one gap per request after its first token (6 tokens each, events may
    # carry more than one token).
    assert delta(before, after, "pdmesh:inter_token_latency_seconds_count") >= 2
    assert done.usage is not None
    assert delta(before, after, "pdmesh:tokens_total", kind="prompt") == (
        done.usage.prompt_tokens + usage.prompt_tokens)
    assert delta(before, after, "pdmesh:tokens_total", kind="completion") == (
        done.usage.completion_tokens + usage.completion_tokens)


def test_vllm_named_series_move_with_the_requests(live_mesh: Mesh) -> None:
    """The series a vLLM dashboard reads (`vllm:` -> `pdmesh:`), labelled `model_name`."""
    def total(snapshot: dict, name: str, **labels: str) -> float:
        return snapshot.get((name, frozenset({"model_name": "tiny", **labels}.items())), 0.0)

    before = scrape(live_mesh)
    client = openai.OpenAI(base_url=live_mesh.base_url, api_key=KEY, max_retries=0)
    with client:
        done = client.completions.create(model="tiny", prompt="Hello", max_tokens=5,
                                         temperature=0, extra_body={"ignore_eos": True})
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        usage = [c.usage for c in stream if c.usage][0]
    after = scrape(live_mesh)
    assert done.usage is not None

    def moved(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert moved("pdmesh:prompt_tokens_total") == (done.usage.prompt_tokens
                                                   + usage.prompt_tokens)
    assert moved("pdmesh:generation_tokens_total") == 5 + 4
    assert moved("pdmesh:request_success_total", finished_reason="length") == 2
    for hist in ("request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):
        assert moved(f"pdmesh:{hist}_count") == 2, hist
    assert moved("pdmesh:request_generation_tokens_sum") == 9
    assert moved("pdmesh:request_decode_time_seconds_sum") > 0
    # Nothing in flight once the replies are in.
    assert total(after, "pdmesh:num_requests_running") == 0
    assert total(after, "pdmesh:num_requests_waiting") == 0


async def _worker_addresses(mesh: Mesh) -> dict[m.Role, str]:
    """role -> /metrics base URL of a live prefill and decode worker (from heartbeats)."""
    nc = await nats.connect(mesh.nats_url)
    found: dict[m.Role, str] = {}
    beats = m.Decoder(m.Heartbeat)

    async def on_beat(msg) -> None:
        beat = beats.decode(msg.subject, msg.data)
        if beat.role in (m.Role.PREFILL, m.Role.DECODE) and beat.http_address:
            found[beat.role] = beat.http_address

    try:
        sub = await nc.subscribe(m.HEARTBEAT_WILDCARD, cb=on_beat)
        for _ in range(100):
            if len(found) == 2:
                break
            await asyncio.sleep(0.05)
        await sub.unsubscribe()
    finally:
        await nc.close()
    assert len(found) == 2, found
    return found


def _scrape_url(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


async def test_workers_report_kv_usage_and_transfer_time(live_mesh: Mesh) -> None:
    urls = await _worker_addresses(live_mesh)
    before = await asyncio.to_thread(_scrape_url, urls[m.Role.PREFILL])
    async with openai.AsyncOpenAI(base_url=live_mesh.base_url, api_key=KEY,
                                  max_retries=0) as client:
        await client.completions.create(model="tiny", prompt="Hello", max_tokens=2,
                                        temperature=0)
    after = await asyncio.to_thread(_scrape_url, urls[m.Role.PREFILL])

    def sample(snapshot: dict, name: str) -> float:
        return sum(v for (n, labels), v in snapshot.items()
                   if n == name and ("model_name", "tiny") in labels)

    assert sample(after, "pdmesh:kv_transfer_time_seconds_count") - sample(
        before, "pdmesh:kv_transfer_time_seconds_count") == 1
    out = ("pdmesh:kv_transfer_bytes_total", frozenset({("direction", "out")}))
    assert after[out] > before.get(out, 0.0)
    decode = await asyncio.to_thread(_scrape_url, urls[m.Role.DECODE])
    usage = [v for (n, labels), v in decode.items() if n == "pdmesh:kv_cache_usage_perc"]
    assert len(usage) == 1 and 0.0 <= usage[0] <= 1.0


async def test_dashboard_reads_only_series_the_mesh_exports(live_mesh: Mesh) -> None:
    """Every `pdmesh:` series the Grafana dashboard queries exists on a live mesh."""
    urls = await _worker_addresses(live_mesh)
    async with openai.AsyncOpenAI(base_url=live_mesh.base_url, api_key=KEY,
                                  max_retries=0) as client:  # labelled series appear
        await client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    gateway = live_mesh.metrics_url.removesuffix("/metrics")
    names = {n for url in [*urls.values(), gateway]
             for n, _ in await asyncio.to_thread(_scrape_url, url)}
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    used = {n for e in exprs for n in re.findall(r"pdmesh:[a-z0-9_]+", e)}
    assert len(used) >= 12
    assert sorted(used - names) == []
