"""SSE parsing (pure) and single requests against the OpenAI-style test double."""

import aiohttp
import pytest

from pdmesh.loadtest.client import ClientConfig, SSEParser, context_length_of, send_request
from pdmesh.loadtest.workload import RequestSpec


def test_sse_events_split_across_reads():
    parser = SSEParser()
    assert parser.feed(b'data: {"a"') == []
    assert parser.feed(b": 1}\n") == []
    assert parser.feed(b"\n") == ['{"a": 1}']


def test_sse_crlf_comments_multiline_and_done():
    parser = SSEParser()
    raw = b": ping\r\n\r\ndata: one\r\ndata:two\r\n\r\nevent: x\ndata: [DONE]\n\n"
    assert parser.feed(raw) == ["one\ntwo", "[DONE]"]


def test_sse_byte_at_a_time():
    parser = SSEParser()
    raw = 'data: {"text": "é"}\n\ndata: [DONE]\n\n'.encode()
    events = [e for i in range(len(raw)) for e in parser.feed(raw[i:i + 1])]
    assert events == ['{"text": "é"}', "[DONE]"]


def test_sse_flushes_an_unterminated_last_event():
    parser = SSEParser()
    assert parser.feed(b"data: last") == []
    assert parser.close() == ["last"]


def test_context_length_from_models_entry():
    assert context_length_of({"id": "m", "max_model_len": 4096}) == 4096
    assert context_length_of({"id": "m", "context_length": 2048}) == 2048
    assert context_length_of({"id": "m"}) is None


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("stream", [True, False])
async def test_request_timings_and_usage(sse_server, endpoint, stream):
    cfg = ClientConfig(sse_server.base_url, sse_server.model, endpoint=endpoint, stream=stream)
    req = RequestSpec(0, 0, "x" * 100, max_tokens=8)
    async with aiohttp.ClientSession() as session:
        result = await send_request(session, cfg, req, "key-a")
    assert result.success and result.status == 200 and result.error == ""
    assert result.prompt_tokens == 101  # from usage: 100 bytes + BOS
    assert result.output_tokens == 8
    assert result.generated_text == sse_server.reply_text(req.prompt, 8, corrupt=False)
    assert 0 < result.ttft_s <= result.e2el_s
    assert len(result.itls_s) == (7 if stream else 0)


async def test_over_long_prompt_is_a_400_with_its_code(sse_server):
    cfg = ClientConfig(sse_server.base_url, sse_server.model)
    req = RequestSpec(0, 0, "x" * 600, max_tokens=8, expect_reject=True)
    async with aiohttp.ClientSession() as session:
        result = await send_request(session, cfg, req, "key-a")
    assert not result.success and result.status == 400
    assert result.error_kind == "http_400" and result.error_code == "context_length_exceeded"


async def test_bad_key_and_unreachable_server(sse_server):
    req = RequestSpec(0, 0, "x", max_tokens=1)
    async with aiohttp.ClientSession() as session:
        bad_key = await send_request(
            session, ClientConfig(sse_server.base_url, sse_server.model), req, "wrong")
        down = await send_request(session, ClientConfig("http://127.0.0.1:9/v1", "m"), req, None)
    assert bad_key.error_kind == "http_401" and bad_key.error_code == "invalid_api_key"
    assert down.error_kind == "connection" and down.status is None
