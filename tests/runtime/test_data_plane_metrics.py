"""A worker's /metrics shows its data plane's refusals: frames refused by reason, the bytes
of refused payloads it drained, inbound links it ended to stay within its limits (and, for
nixl, staging regions held for senders that never released them: tests/transports/
test_nixl.py). Read from the transport's counters at scrape time."""

from __future__ import annotations

import asyncio
import socket
import uuid

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.services.decode.service import DecodeService
from pdmesh.services.runtime.config import resolve
from pdmesh.transports import Reason, TransferError, TransferPlan, make_transport
from pdmesh.transports.framing import transfer_key

PAGE = 4096


def _samples(registry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_a_workers_metrics_count_refused_frames_drained_bytes_and_refused_links():
    cfg = resolve("decode", {}, {"PDMESH_WORKER_ID": "decode-metrics",
                                 "PDMESH_KV_TOKENS": "1024"})
    worker = DecodeService(cfg)
    receiver = worker.transport
    receiver.max_unbound_links = 2
    address = await receiver.start()
    sender = make_transport("tcp", progress_timeout_s=1.0)
    flood: list[socket.socket] = []
    try:
        before = _samples(worker.rt.registry)
        assert not [k for k in before if k[0] == "pdmesh:data_plane_frames_rejected_total"]
        assert before[("pdmesh:data_plane_links_refused_total", ())] == 0
        # A transfer for a reservation this worker never expected: refused, its page
        # drained.
        rid = uuid.uuid4().hex
        plan = TransferPlan(rid, 1, (0,), 16, 16, PAGE, 0, 5.0,
                            key=transfer_key("x", rid, 1))
        with pytest.raises(TransferError) as sent:
            await sender.send(address, plan, [memoryview(bytearray(PAGE))])
        assert sent.value.reason is Reason.UNKNOWN_RESERVATION
        # Idle connections past the cap of unbound links: the oldest are ended.
        host, port = address[len("tcp://"):].rsplit(":", 1)
        for _ in range(5):
            s = socket.create_connection((host, int(port)))
            s.send(b"PD")  # a header that never completes
            flood.append(s)
        await asyncio.sleep(0.3)
        after = _samples(worker.rt.registry)
        assert after[("pdmesh:data_plane_frames_rejected_total",
                      (("reason", "unknown_reservation"),))] >= 1, after
        assert after[("pdmesh:data_plane_bytes_drained_total", ())] >= PAGE
        assert after[("pdmesh:data_plane_links_refused_total", ())] >= 3
        assert after[("pdmesh:data_plane_links_timed_out_total", ())] == 0
        assert after[("pdmesh:data_plane_accept_errors_total", ())] == 0
        assert ("pdmesh:data_plane_staging_retired", ()) not in after  # tcp has no staging
    finally:
        for s in flood:
            s.close()
        await sender.close()
        await receiver.close()
