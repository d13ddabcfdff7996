"""Size is never the failure: a prompt of megabytes (far over the served context, under the
body limit) is a 400 `context_length_exceeded` decided by the gateway before any control
message is sent — not a 500 from a NATS submit over its max payload."""

from __future__ import annotations

from tests.meshproc import Mesh


def test_a_multi_megabyte_prompt_is_a_400_not_a_500(live_mesh: Mesh) -> None:
    prompt = "long prompt " * 180_000  # ~2.2 MB: ~2 M tokens of the byte tokenizer
    for path, body in (
            ("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4}),
            ("/v1/chat/completions", {"model": "tiny", "max_tokens": 4,
                                      "messages": [{"role": "user", "content": prompt}]}),
            ("/v1/completions", {"model": "tiny", "prompt": prompt})):  # default max_tokens
        status, reply = live_mesh.http("POST", path, body, timeout=120)
        assert status == 400, (path, reply)
        assert reply["error"]["code"] == "context_length_exceeded", reply
        assert f"maximum context length is {live_mesh.max_context}" in \
            reply["error"]["message"]
    # The mesh still serves.
    status, reply = live_mesh.http("POST", "/v1/completions",
                                   {"model": "tiny", "prompt": "still here", "max_tokens": 2})
    assert status == 200, reply
