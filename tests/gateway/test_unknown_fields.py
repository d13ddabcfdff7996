"""`--ignore-unknown-fields`: request fields the gateway does not know are dropped (at any
depth) and logged by name instead of refused, for clients written against other servers'
extensions; the default stays strict (a 400 naming the field)."""

from __future__ import annotations

import logging

import pytest

from pdmesh.gateway.schema import ApiError, parse_chat, parse_completion
from pdmesh.services.protocol import messages as m
from tests.support.meshproc import NatsServer
from tests.support.scripted_mesh import ScriptedMesh, gateways

BODY = (b'{"model": "tiny", "prompt": "hi", "max_tokens": 2, "guided_decoding_backend": "x",'
        b' "stream": true, "stream_options": {"include_usage": true, "vendor_flag": 1}}')


def test_strict_by_default_lenient_when_asked() -> None:
    with pytest.raises(ApiError) as err:
        parse_completion(BODY)
    assert err.value.param == "guided_decoding_backend"
    ignored: list[str] = []
    body = parse_completion(BODY, ignored)
    assert body.prompt == "hi" and body.stream_options.include_usage
    assert ignored == ["guided_decoding_backend", "stream_options.vendor_flag"]


def test_lenient_parse_still_refuses_wrong_values_and_reaches_nested_fields() -> None:
    with pytest.raises(ApiError) as err:  # a known field with a wrong type: still a 400
        parse_completion(b'{"model": "tiny", "prompt": "hi", "max_tokens": "two", "x": 1}', [])
    assert err.value.param == "max_tokens"
    ignored: list[str] = []
    body = parse_chat(b'{"model": "tiny", "messages": [{"role": "user", "content": "q"}], '
                      b'"tools": [{"type": "function", "function": {"name": "f", "extra": 1},'
                      b' "cache_control": {}}]}', ignored)
    assert body.tools[0].function.name == "f"
    assert sorted(ignored) == ["tools[0].cache_control", "tools[0].function.extra"]
    with pytest.raises(ApiError):
        parse_completion(b'{"model": "tiny", "prompt": "hi", "x": 1', [])  # not JSON


async def _script(mesh: ScriptedMesh, rid: str) -> None:
    await mesh.send(rid, m.TokenEvent(request_id=rid, seq=0, token_ids=[ord("k")],
                                      finish=m.FINISHED_LENGTH))


async def test_the_setting_on_a_running_gateway(nats_server: NatsServer,
                                                caplog: pytest.LogCaptureFixture) -> None:
    body = {"prompt": "hi", "max_tokens": 1, "best_of_n_vendor": 3}
    async with gateways(nats_server.url) as start:
        strict = await start(_script)
        status, reply, _ = await strict.post(body)
        assert status == 400 and reply["error"]["param"] == "best_of_n_vendor", reply
        lenient = await start(_script, ignore_unknown_fields=True)
        with caplog.at_level(logging.WARNING, logger="pdmesh.gateway"):
            status, reply, _ = await lenient.post(body)
        assert status == 200 and reply["choices"][0]["text"] == "k", reply
        assert "ignored unknown request fields: best_of_n_vendor" in caplog.text
