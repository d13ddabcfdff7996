"""The gateway's /metrics: latency histograms and request/token counters by tenant and
outcome move exactly as the requests that were made (tenant carol, used only here)."""

from __future__ import annotations

import urllib.request

import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.meshproc import Mesh

TENANT, KEY = "carol", "sk-dev-carol"


def scrape(mesh: Mesh) -> dict[tuple[str, frozenset], float]:
    url = f"http://127.0.0.1:{mesh.gateway_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, frozenset({"tenant": TENANT, **labels}.items()))
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
            client.completions.create(model="tiny", prompt="Hello", n=2)
        except openai.BadRequestError as exc:
            assert exc.param == "n"
        else:
            raise AssertionError("n=2 was accepted")
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
