"""vLLM's request surface beyond sampling, on the live mesh (tiny): logit_bias (the
oracle's tokens with the same bias), stream_options.continuous_usage_stats, /ping, /load,
and the fields refused with a 400 that says so."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import pytest

from pdmesh.services.engine.oracle import reference
from pdmesh.services.protocol import messages as m
from tests.support.meshproc import Mesh, run_mesh

pytestmark = pytest.mark.mesh


@pytest.fixture(scope="module")
def colocated_mesh() -> Iterator[Mesh]:
    with run_mesh("--colocated", "--kv-tokens", "4096") as mesh:
        yield mesh


def test_logit_bias_moves_the_tokens_as_the_oracle(live_mesh: Mesh) -> None:
    prompt = "biased towards z"
    bias = {str(ord("z")): 100.0, str(ord(" ")): 8.0}
    status, body = live_mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
        "logit_bias": bias})
    assert status == 200, body
    text = body["choices"][0]["text"]
    assert text == "z" * 12  # +100 wins every step
    ref = reference("tiny")
    for b in ({ord("z"): 3.0, ord("e"): -100.0}, {}):  # a bias that only shifts, none
        status, body = live_mesh.http("POST", "/v1/completions", {
            "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0.7,
            "seed": 9, "logit_bias": {str(k): v for k, v in b.items()}})
        expected = ref.answer(ref.prompt_ids(prompt), 12, m.Sampling(
            temperature=0.7, seed=9, logit_bias=b))
        assert body["choices"][0]["text"] == expected.text
    for bad in ({"x": 1.0}, {"1": 101.0}, {str(10**6): 1.0}):
        status, body = live_mesh.http("POST", "/v1/completions", {
            "model": "tiny", "prompt": prompt, "max_tokens": 2, "logit_bias": bad})
        assert status == 400 and body["error"]["param"] == "logit_bias", (bad, body)


def test_continuous_usage_stats_count_in_every_chunk(live_mesh: Mesh) -> None:
    req = urllib.request.Request(f"{live_mesh.base_url}/completions", method="POST",
                                 data=json.dumps({
                                     "model": "tiny", "prompt": "usage", "max_tokens": 5,
                                     "temperature": 0, "stream": True, "stream_options": {
                                         "include_usage": True,
                                         "continuous_usage_stats": True}}).encode(),
                                 headers={"Authorization": "Bearer sk-dev-alice",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        events = [json.loads(line[6:]) for line in resp.read().decode().splitlines()
                  if line.startswith("data: {")]
    chunks = [e for e in events if e["choices"]]
    assert chunks and all(e["usage"] is not None for e in chunks)
    counts = [e["usage"]["completion_tokens"] for e in chunks]
    assert counts == sorted(counts) and counts[-1] == 5
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5


def test_ping_and_load(live_mesh: Mesh) -> None:
    for method in ("GET", "POST"):
        status, body = live_mesh.http(method, "/ping", key=None)
        assert status == 200 and body == {"status": "healthy"}
    status, body = live_mesh.http("GET", "/load")
    assert status == 200 and isinstance(body["server_load"], int) and body["server_load"] >= 0
    assert live_mesh.http("GET", "/load", key=None)[0] == 401


def test_batched_prompts_are_one_reply_of_every_prompts_choices(live_mesh: Mesh) -> None:
    """A list of prompts (strings, or token-id lists): prompt i's choice j at index i*n+j,
    each the oracle's answer, usage summed, as vLLM answers it."""
    ref = reference("tiny")
    prompts = ["first prompt", "the second one", "3"]
    status, body = live_mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": prompts, "max_tokens": 5, "temperature": 0, "n": 2})
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for c in body["choices"]:
        assert c["text"] == ref.expected(prompts[c["index"] // 2], 5).text
    lengths = [len(ref.prompt_ids(p)) for p in prompts]
    assert body["usage"]["prompt_tokens"] == sum(lengths)  # once a prompt, whatever its n
    assert body["usage"]["completion_tokens"] == sum(
        ref.expected(p, 5).num_tokens for p in prompts) * 2
    ids = [ref.prompt_ids(p) for p in prompts[:2]]
    status, body = live_mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": ids, "max_tokens": 5, "temperature": 0})
    assert status == 200, body
    assert [c["text"] for c in body["choices"]] == [ref.expected(p, 5).text
                                                   for p in prompts[:2]]
    for bad, param in ((["a", [1, 2]], "prompt"), ([[1, "x"]], "prompt"), ([], "prompt"),
                       (["a"] * 65, "prompt")):
        status, body = live_mesh.http("POST", "/v1/completions", {
            "model": "tiny", "prompt": bad, "max_tokens": 2})
        assert status == 400 and body["error"]["param"] == param, (bad, body)
    status, body = live_mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": ["a", "b"], "max_tokens": 2, "stream": True})
    assert status == 400 and body["error"]["param"] == "stream", body


def test_echo_puts_the_prompt_before_the_completion(live_mesh: Mesh) -> None:
    ref = reference("tiny")
    prompt = "echo me"
    status, body = live_mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True})
    assert status == 200 and body["choices"][0]["text"] == prompt + ref.expected(prompt, 4).text
    req = urllib.request.Request(f"{live_mesh.base_url}/completions", method="POST",
                                 data=json.dumps({
                                     "model": "tiny", "prompt": ref.prompt_ids(prompt),
                                     "max_tokens": 4, "temperature": 0, "stream": True,
                                     "echo": True}).encode(),
                                 headers={"Authorization": "Bearer sk-dev-alice",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        events = [json.loads(line[6:]) for line in resp.read().decode().splitlines()
                  if line.startswith("data: {")]
    texts = [e["choices"][0]["text"] for e in events]
    assert texts[0] == prompt and "".join(texts) == prompt + ref.expected(prompt, 4).text


@pytest.mark.parametrize("which", ["mesh", "colocated"])
def test_echo_with_logprobs_scores_the_prompt(which: str, live_mesh: Mesh,
                                              request: pytest.FixtureRequest) -> None:
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 1): every prompt token's
    logprob given the ones before it (the first null), then the completion's; the prompt's
    are the reference engine's, batched prompts included."""
    mesh = live_mesh if which == "mesh" else request.getfixturevalue("colocated_mesh")
    ref = reference("tiny")
    prompts = ["score this prompt " * 40, "and a second one"]  # the first spans chunks
    status, body = mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": prompts, "max_tokens": 1, "temperature": 0, "echo": True,
        "logprobs": 2})
    assert status == 200, body
    for choice, prompt in zip(body["choices"], prompts, strict=True):
        ids = ref.prompt_ids(prompt)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None and choice["text"].startswith(prompt)
        expected = ref.prompt_logprobs(ids, 2)
        got = lp["token_logprobs"][1:len(ids)]
        assert max(abs(a - b) for a, (b, _) in zip(got, expected, strict=True)) < 1e-4
        for tops, (_, want) in zip(lp["top_logprobs"][1:len(ids)], expected, strict=True):
            # (OpenAI's shape keys them by text: two ids of one text are one entry)
            want_by_text = {ref.tokenizer.decode([i]): v for i, v in want}
            assert tops.keys() == want_by_text.keys()
            assert list(tops.values()) == pytest.approx(list(want_by_text.values()), abs=1e-4)
        assert lp["text_offset"][len(ids)] == len(prompt)


def test_tokenizer_info_lets_a_client_tokenize_as_the_server(live_mesh: Mesh) -> None:
    status, info = live_mesh.http("GET", "/tokenizer_info")
    assert status == 200, info
    ref = reference("tiny")
    assert info["vocab_size"] == ref.tokenizer.vocab_size and info["pad_token"] is None
    assert info["model_max_length"] > 0
    assert live_mesh.http("GET", "/tokenizer_info", key=None)[0] == 401
