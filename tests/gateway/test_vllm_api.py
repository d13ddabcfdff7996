"""The fields, defaults and endpoints vLLM / SGLang users send, through the official openai
client (raw HTTP where it has no parameter), each checked against the reference engine
run with the mesh's sampler (`tests/support/oracle.py` `expected_run`): a field that the mesh
ignored, or applied on one worker only, gives other tokens than the oracle.

Each field's test also shows that the field changes the output (against the neutral
request), so a gateway that dropped it would fail.
"""

from __future__ import annotations

import functools
import math
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import openai
import pytest

from pdmesh.services.protocol import messages as m
from tests.support.meshproc import Mesh, mesh_env, run_mesh
from tests.support.oracle import expected_run, tiny

pytestmark = pytest.mark.mesh

PROMPT = "Once upon"  # greedy tiny repeats itself here: penalties change the output
EOS_PROMPT = "1 2 3"  # greedy tiny emits eos as its 17th token here
N = 20


def ids_of(prompt: str) -> tuple[int, ...]:
    return tuple(prompt.encode())


@functools.cache
def _oracle(prompt_ids: tuple[int, ...], max_tokens: int, sampling_json: bytes
            ) -> tuple[tuple[int, ...], tuple]:
    sampling = msgspec.json.decode(sampling_json, type=m.Sampling)
    out, lps = expected_run(prompt_ids, max_tokens, sampling)
    return tuple(out), tuple(lps)


def oracle(prompt: str, max_tokens: int = N, **fields: Any) -> tuple[tuple[int, ...], tuple]:
    if fields.get("repetition_penalty", 1.0) != 1.0:
        fields["penalty_prompt_ids"] = sorted(set(ids_of(prompt)))
    return _oracle(ids_of(prompt), max_tokens, msgspec.json.encode(m.Sampling(**fields)))


def text_of(ids: tuple[int, ...]) -> str:
    tok = tiny().tokenizer
    return tok.decode(t for t in ids if t not in tok.eos_token_ids)


@pytest.fixture
async def client(live_mesh: Mesh) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=live_mesh.base_url, api_key="sk-dev-alice",
                                  max_retries=0, timeout=120) as c:
        yield c


async def complete(client: openai.AsyncOpenAI, prompt: str = PROMPT, **kw: Any):
    extra = {k: kw.pop(k) for k in list(kw) if k in (
        "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids")}
    return await client.completions.create(model="tiny", prompt=prompt,
                                           max_tokens=kw.pop("max_tokens", N),
                                           extra_body=extra or None, **kw)


# -- sampling fields, each against the oracle ---------------------------------------------
@pytest.mark.parametrize("fields", [
    {"repetition_penalty": 1.3},
    {"presence_penalty": 1.5},
    {"frequency_penalty": 1.0},
    {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 0.3},
], ids=["repetition", "presence", "frequency", "all-penalties"])
async def test_greedy_penalties_match_the_oracle(client: openai.AsyncOpenAI,
                                                 fields: dict[str, Any]) -> None:
    out = await complete(client, temperature=0, **fields)
    want, _ = oracle(PROMPT, **fields)
    assert out.choices[0].text == text_of(want)
    assert out.usage is not None and out.usage.completion_tokens == len(want)
    assert want != oracle(PROMPT)[0], "the field must change the greedy output"


@pytest.mark.parametrize("fields", [
    {"top_k": 5}, {"min_p": 0.05}, {"top_k": 20, "top_p": 0.8, "min_p": 0.01},
], ids=["top_k", "min_p", "top_k+top_p+min_p"])
async def test_seeded_filters_match_the_oracle(client: openai.AsyncOpenAI,
                                               fields: dict[str, Any]) -> None:
    out = await complete(client, temperature=1.0, seed=77, **fields)
    want, _ = oracle(PROMPT, temperature=1.0, seed=77, **fields)
    assert out.choices[0].text == text_of(want)
    assert want != oracle(PROMPT, temperature=1.0, seed=77)[0]


async def test_stop_token_ids_and_stop_reason(client: openai.AsyncOpenAI) -> None:
    greedy, _ = oracle(PROMPT)
    stop_id = greedy[5]
    out = await complete(client, temperature=0, stop_token_ids=[stop_id])
    want, _ = oracle(PROMPT, stop_token_ids=[stop_id])
    assert want == greedy[:greedy.index(stop_id) + 1]
    assert out.choices[0].text == text_of(want)
    assert out.choices[0].finish_reason == "stop"
    assert (out.choices[0].model_extra or {}).get("stop_reason") == stop_id


async def test_min_tokens_masks_stop_ids(client: openai.AsyncOpenAI) -> None:
    greedy, _ = oracle(PROMPT)
    stop_id = greedy[0]
    fields = {"stop_token_ids": [stop_id], "min_tokens": 4}
    out = await complete(client, temperature=0, **fields)
    want, _ = oracle(PROMPT, **fields)
    assert want[0] != stop_id and len(want) >= 4
    assert out.choices[0].text == text_of(want)


async def test_ignore_eos_runs_to_max_tokens(client: openai.AsyncOpenAI) -> None:
    plain = await complete(client, EOS_PROMPT, temperature=0, max_tokens=24)
    assert plain.choices[0].finish_reason == "stop"
    assert plain.usage is not None and plain.usage.completion_tokens < 24
    out = await complete(client, EOS_PROMPT, temperature=0, max_tokens=24, ignore_eos=True)
    want, _ = oracle(EOS_PROMPT, 24, ignore_eos=True)
    assert len(want) == 24 and 257 in want
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 24
    assert out.choices[0].text == text_of(want)


async def test_n_choices_are_seeded_per_index(client: openai.AsyncOpenAI) -> None:
    out = await complete(client, temperature=1.0, seed=5, n=3, max_tokens=8)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for c in out.choices:
        want, _ = oracle(PROMPT, 8, temperature=1.0, seed=5 + c.index)
        assert c.text == text_of(want)
    assert out.usage is not None
    assert out.usage.completion_tokens == sum(
        len(oracle(PROMPT, 8, temperature=1.0, seed=5 + i)[0]) for i in range(3))
    # Streamed: the chunks of three choices interleave, each with its index.
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
        temperature=1.0, seed=5, n=3, stream=True)
    texts = ["", "", ""]
    finishes: list[Any] = [None] * 3
    async for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            finishes[ch.index] = ch.finish_reason or finishes[ch.index]
    assert all(finishes) and len(set(texts)) > 1


async def test_n_above_the_setting_is_refused(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await complete(client, temperature=0, n=9)
    assert info.value.param == "n"


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4)


async def test_completion_logprobs_match_the_oracle(client: openai.AsyncOpenAI) -> None:
    out = await complete(client, temperature=0, logprobs=3, max_tokens=6)
    want, lps = oracle(PROMPT, 6, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(want) == 6  # the first one comes from prefill
    for got, top, (exp, exp_top), token in zip(lp.token_logprobs, lp.top_logprobs, lps, want,
                                               strict=True):
        assert _close(got, exp) and got <= 0
        # Keyed by token text, as OpenAI's format is (byte tokens may share "\ufffd").
        tok = tiny().tokenizer
        assert top == pytest.approx({tok.decode([i]): v for i, v in exp_top}, abs=1e-4)
        assert exp_top[0][0] == token  # greedy: the sampled token is the top one
        assert _close(exp_top[0][1], exp)
    assert lp.text_offset is not None and lp.text_offset[0] == 0


async def test_chat_logprobs_streamed_and_not(client: openai.AsyncOpenAI) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    prompt = tiny().tokenizer.apply_chat_template(messages)
    want, lps = oracle(prompt, 5, logprobs=2)
    out = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                               temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    for item, (exp, exp_top) in zip(content, lps, strict=True):
        assert _close(item.logprob, exp)
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(
            [v for _, v in exp_top], abs=1e-4)
    stream = await client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True,
        stream=True)
    streamed = []
    async for chunk in stream:
        for ch in chunk.choices:
            if ch.logprobs and ch.logprobs.content:
                streamed += [c.logprob for c in ch.logprobs.content]
    assert streamed == pytest.approx([exp for exp, _ in lps], abs=1e-4)


async def test_neutral_vllm_extras_are_accepted(client: openai.AsyncOpenAI) -> None:
    """What `vllm bench serve` sends on every request: neutral values, accepted."""
    out = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, user="bench",
        extra_body={"repetition_penalty": 1.0, "ignore_eos": False, "top_k": -1,
                    "min_p": 0.0, "skip_special_tokens": True,
                    "include_stop_str_in_output": False})
    assert out.choices[0].text == text_of(oracle(PROMPT, 4)[0])


async def test_max_completion_tokens_on_chat(client: openai.AsyncOpenAI) -> None:
    out = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=3, temperature=0)
    assert out.usage is not None and out.usage.completion_tokens <= 3
    assert out.choices[0].finish_reason in ("stop", "length")


# -- endpoints ------------------------------------------------------------------------------
async def test_models_have_root_parent_and_length(client: openai.AsyncOpenAI,
                                                  live_mesh: Mesh) -> None:
    page = await client.models.list()
    extra = page.data[0].model_extra or {}
    assert extra["root"] == "tiny" and extra["parent"] is None
    assert extra["max_model_len"] == live_mesh.max_context


def test_tokenize_detokenize_version_health(live_mesh: Mesh) -> None:
    status, body = live_mesh.http("POST", "/tokenize", {"model": "tiny", "prompt": "Hello"})
    assert status == 200 and body["tokens"] == list(b"Hello") and body["count"] == 5
    assert body["max_model_len"] == live_mesh.max_context
    messages = [{"role": "user", "content": "Hi"}]
    status, body = live_mesh.http("POST", "/tokenize", {"messages": messages})
    assert body["tokens"] == list(tiny().tokenizer.apply_chat_template(messages).encode())
    status, body = live_mesh.http("POST", "/detokenize", {"tokens": list(b"Hi there")})
    assert status == 200 and body == {"prompt": "Hi there"}
    status, body = live_mesh.http("POST", "/detokenize", {"tokens": [999]})
    assert status == 400 and body["error"]["param"] == "tokens"
    status, body = live_mesh.http("POST", "/tokenize", {"prompt": "x"}, key=None)
    assert status == 401
    status, body = live_mesh.http("GET", "/version", key=None)
    assert status == 200 and body["version"]
    status, _ = live_mesh.http("GET", "/health", key=None)
    assert status == 200


# -- defaults and names: a mesh of its own, colocated (first token sampled in-process) -------
@pytest.fixture(scope="module")
def named_mesh() -> Iterator[Mesh]:
    with run_mesh("--colocated", "--max-context", "128", "--kv-tokens", "1024", env=mesh_env(
            PDMESH_SERVED_MODEL_NAME="my-model,alias", PDMESH_DEFAULT_MAX_TOKENS="12",
            PDMESH_MAX_N="2")) as mesh:
        yield mesh


@pytest.mark.slow
def test_served_names_and_default_max_tokens(named_mesh: Mesh) -> None:
    status, body = named_mesh.http("GET", "/v1/models")
    assert [d["id"] for d in body["data"]] == ["my-model", "alias"]
    assert {d["root"] for d in body["data"]} == {"tiny"}
    with openai.OpenAI(base_url=named_mesh.base_url, api_key="sk-dev-alice",
                       max_retries=0) as client:
        # No max_tokens: the rest of the context, capped by --default-max-tokens (12).
        out = client.completions.create(model="alias", prompt=PROMPT, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.model == "my-model"
        assert out.usage is not None and out.usage.completion_tokens == 12
        # A prompt 5 tokens short of the served context (128) gets 5 tokens.
        long_prompt = "a" * 123
        out = client.completions.create(model="my-model", prompt=long_prompt, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage is not None and out.usage.completion_tokens == 5
        assert out.choices[0].finish_reason == "length"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt=PROMPT, max_tokens=2)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="alias", prompt=PROMPT, max_tokens=2, n=3)
    with urllib.request.urlopen(named_mesh.metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    assert 'pdmesh:num_requests_running{model_name="my-model"}' in text


@pytest.mark.slow
def test_colocated_worker_samples_the_same_stream(named_mesh: Mesh) -> None:
    """One worker samples the first token and the rest: same tokens and logprobs."""
    fields = {"temperature": 0.9, "seed": 3, "top_k": 30, "frequency_penalty": 0.8,
              "repetition_penalty": 1.1, "min_tokens": 4}
    want, lps = oracle(PROMPT, 10, logprobs=1, stop_token_ids=[], **fields)
    with openai.OpenAI(base_url=named_mesh.base_url, api_key="sk-dev-alice",
                       max_retries=0) as client:
        out = client.completions.create(
            model="my-model", prompt=PROMPT, max_tokens=10, logprobs=1,
            temperature=fields["temperature"], seed=fields["seed"],
            frequency_penalty=fields["frequency_penalty"], extra_body={
                "top_k": 30, "repetition_penalty": 1.1, "min_tokens": 4})
    assert out.choices[0].text == text_of(want)
    got = out.choices[0].logprobs.token_logprobs  # type: ignore[union-attr]
    assert got == pytest.approx([lp for lp, _ in lps], abs=1e-4)
