"""`POST /v1/responses` through the openai client (tiny model, live mesh): text in and
out, streamed and not, equal to the chat path's (the oracle's) answer; a JSON-schema text
format; what is refused."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pdmesh.services.engine.oracle import reference
from pdmesh.services.protocol import messages as m
from tests.support.meshproc import Mesh

pytestmark = pytest.mark.mesh


def _client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="sk-dev-alice", max_retries=0)


def _expected(messages: list[dict], max_tokens: int, sampling: m.Sampling | None = None
              ) -> str:
    ref = reference("tiny")
    ids = ref.tokenizer.encode(ref.tokenizer.apply_chat_template(messages))
    return ref.answer(ids, max_tokens, sampling or m.Sampling()).text


def test_a_response_is_the_chat_answer(live_mesh: Mesh) -> None:
    with _client(live_mesh) as client:
        resp = client.responses.create(model="tiny", input="Say something",
                                       instructions="Be brief.", max_output_tokens=9,
                                       temperature=0)
    assert resp.object == "response" and resp.id.startswith("resp_")
    expected = _expected([{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Say something"}], 9)
    assert resp.output_text == expected
    assert resp.usage.output_tokens == 9 and resp.usage.input_tokens > 0
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"


def test_a_streamed_response_carries_the_events_in_order(live_mesh: Mesh) -> None:
    messages = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "second"}]
    with _client(live_mesh) as client:
        stream = client.responses.create(model="tiny", input=[
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
            {"role": "user", "content": [{"type": "input_text", "text": "second"}]}],
            max_output_tokens=8, temperature=0, stream=True)
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == _expected(messages, 8) == events[-1].response.output_text


def test_a_json_schema_text_format(live_mesh: Mesh) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    with _client(live_mesh) as client:
        resp = client.responses.create(model="tiny", input="json please", temperature=0,
                                       max_output_tokens=64, text={"format": {
                                           "type": "json_schema", "name": "r",
                                           "schema": schema, "strict": True}})
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), schema)


@pytest.mark.parametrize("fields,param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": ""}, "input"),
    ({"input": "x", "frequency": 1}, "frequency"),
])
def test_what_responses_refuse(fields: dict, param: str, live_mesh: Mesh) -> None:
    status, body = live_mesh.http("POST", "/v1/responses", {"model": "tiny", "input": "x",
                                                           **fields})
    assert status == 400 and body["error"]["param"] == param, body
