"""Data-plane threats on the running mesh: every faulty transfer fails *that* request
cleanly (error to the client, pages freed) and never produces a 200 with other KV (I3)."""

from __future__ import annotations

import time

import pytest

from pdmesh.loadtest.client import SSEParser
from pdmesh.services.protocol import messages as m
from tests.support.meshproc import Mesh
from tests.support.meshstats import counter, worker_stats
from tests.support.oracle import expected_text

pytestmark = [pytest.mark.mesh, pytest.mark.slow]

# A prompt of several pages (16 tokens each) so reorder/drop/truncate have frames to hit.
PROMPT = "the quick brown fox jumps over the lazy dog; " * 4

FAULTS = ["corrupt_payload", "corrupt_header", "drop_frame", "duplicate_frame",
          "reorder_frames", "commit_first", "truncate", "reset", "stale_epoch",
          "foreign_reservation", "stub_transfer", "first_token_out_of_range",
          "first_token_negative"]


@pytest.mark.parametrize("fault", FAULTS)
def test_faulty_transfer_fails_only_that_request(mesh: Mesh, fault: str) -> None:
    before = counter(worker_stats(mesh.nats_url), m.Role.DECODE, "generated_tokens")
    t0 = time.monotonic()
    status, body = mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        headers={"X-Pdmesh-Fault": fault})
    elapsed = time.monotonic() - t0
    assert status == 502, (fault, body)
    # A connection cut mid-transfer looks like a lost peer: the gateway tries to resume the
    # request on another worker (the lost one avoided); this mesh has no other, so it fails
    # with the loss named. Every other fault is the transfer's own failure.
    lost = fault in ("truncate", "reset")
    assert body["error"]["code"] == ("worker_lost" if lost else "transfer_failed"), body
    # Failed on evidence, not on a timeout (the mesh's stall limit is 5 s).
    assert elapsed < 3.0, (fault, elapsed)
    # Decode never generated a token from the unverified KV (it never attended over it).
    assert counter(worker_stats(mesh.nats_url), m.Role.DECODE, "generated_tokens") == before
    # A concurrent-free follow-up on the same (LIFO-reused) pages is exactly right.
    status, body = mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["text"] == expected_text(PROMPT, 8)


def test_streamed_reply_reports_a_transfer_failure_as_an_error_event(mesh: Mesh) -> None:
    import json
    import urllib.request

    req = urllib.request.Request(
        f"{mesh.base_url}/completions", method="POST",
        data=json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 8,
                         "stream": True}).encode(),
        headers={"Authorization": "Bearer sk-dev-alice", "Content-Type": "application/json",
                 "X-Pdmesh-Fault": "corrupt_payload"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        events = SSEParser().feed(resp.read())
    assert events and "[DONE]" not in events
    last = json.loads(events[-1])
    assert last["error"]["code"] == "transfer_failed"
    # No text was streamed before the error: the KV never verified, decode never ran.
    assert all("error" in json.loads(e) or not json.loads(e)["choices"][0].get("text")
               for e in events)


def test_first_token_outside_the_grammar_fails_only_that_request(mesh: Mesh) -> None:
    """A structured output whose commit carries a first token the request's grammar does not
    allow (a misbehaving prefill): decode fails that request at once, on evidence, and
    generates nothing from it; the next constrained request is exactly the oracle's."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "structured_outputs": {"choice": ["alpha", "beta"]}}
    before = counter(worker_stats(mesh.nats_url), m.Role.DECODE, "generated_tokens")
    t0 = time.monotonic()
    status, reply = mesh.http("POST", "/v1/completions", body,
                              headers={"X-Pdmesh-Fault": "first_token_off_grammar"})
    assert status == 502 and reply["error"]["code"] == "transfer_failed", reply
    assert "structured output" in reply["error"]["message"], reply
    assert time.monotonic() - t0 < 3.0
    assert counter(worker_stats(mesh.nats_url), m.Role.DECODE, "generated_tokens") == before
    status, reply = mesh.http("POST", "/v1/completions", body)
    assert status == 200 and reply["choices"][0]["text"] in ("alpha", "beta"), reply
