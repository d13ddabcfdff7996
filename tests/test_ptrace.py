"""The protocol trace (services/runtime/ptrace.py): the pool's observer, the writer, and a
real mesh writing one trace file per process."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from pdmesh.kvstore import KVPool, PoolSpec
from pdmesh.services.runtime.config import resolve
from pdmesh.services.runtime.ptrace import ProtocolTrace, attach
from pdmesh.services.runtime.service import ServiceRuntime
from pdmesh.transports import FaultPlan, TransferError, make_transport
from tests.support.meshproc import mesh_env, run_mesh
from tests.support.transport_cases import PROGRESS_S, make_case

PAGE = 4


def _pool() -> tuple[KVPool, list[tuple[str, dict]]]:
    spec = PoolSpec(num_layers=1, num_kv_heads=1, head_dim=2, page_tokens=PAGE, num_pages=6)
    pool = KVPool(spec)
    seen: list[tuple[str, dict]] = []
    pool.observer = lambda ev, fields: seen.append((ev, fields))
    return pool, seen


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_pool_observer_reports_each_action_with_its_fields() -> None:
    pool, seen = _pool()
    pid = pool.pool_id
    owner = pool.allocate("r1", 2 * PAGE)
    assert seen == [("lease", {"pool": pid, "lease": owner.lease_id, "req": "r1",
                               "epoch": owner.epoch, "pages": list(owner.page_ids),
                               "shared": [], "tokens": 2 * PAGE,
                               "page_tokens": PAGE})]
    pool.mark_written_range(owner, 0, PAGE + 1)  # one event per page touched
    assert seen[1:] == [
        ("written", {"pool": pid, "lease": owner.lease_id, "epoch": owner.epoch,
                     "page": owner.page_ids[0], "tokens": PAGE}),
        ("written", {"pool": pid, "lease": owner.lease_id, "epoch": owner.epoch,
                     "page": owner.page_ids[1], "tokens": 1})]
    pool.check_readable(owner, PAGE + 1)  # the fast path reports too
    assert seen[-1] == ("read", {"pool": pid, "lease": owner.lease_id,
                                 "epoch": owner.epoch, "tokens": PAGE + 1})
    cached = pool.share(owner, 0)
    assert seen[-1] == ("cache", {"pool": pid, "lease": owner.lease_id,
                                  "epoch": owner.epoch, "page": cached})
    reader = pool.allocate("r2", 2 * PAGE, shared_prefix=[cached])
    assert seen[-1][0] == "lease" and seen[-1][1]["shared"] == [cached]
    assert seen[-1][1]["pages"] == list(reader.page_ids) and reader.page_ids[0] == cached
    pool.release(owner, "stop")
    assert seen[-1] == ("free", {"pool": pid, "lease": owner.lease_id,
                                 "epoch": owner.epoch, "pages": [owner.page_ids[1]],
                                 "cause": "stop"})
    count = len(seen)
    pool.release(owner, "stop")  # the idempotent no-op says nothing
    assert len(seen) == count
    pool.quarantine(reader, "fence failed")
    assert seen[-1] == ("quarantine", {"pool": pid, "lease": reader.lease_id,
                                       "epoch": reader.epoch,
                                       "pages": list(reader.page_ids[1:]),
                                       "cause": "fence failed"})
    pool.evict(cached)
    assert seen[-1] == ("evict", {"pool": pid, "page": cached})
    json.dumps(seen)  # every field is plain JSON


def test_decode_steps_report_only_the_first_read() -> None:
    pool, seen = _pool()
    lease = pool.allocate("r", 2 * PAGE)
    pool.mark_written(lease, 0, PAGE - 1)
    seen.clear()
    for position in range(PAGE - 1, PAGE + 1):  # the page's last token: the slow path
        pool.check_decode_batch([lease], [position])
        pool.mark_decode_batch([lease], [position])
    assert seen == [("read", {"pool": pool.pool_id, "lease": lease.lease_id,
                              "epoch": lease.epoch, "tokens": PAGE - 1})]


def test_trace_writes_one_json_object_per_line(tmp_path: Path) -> None:
    trace = ProtocolTrace(str(tmp_path / "t"), "decode")
    trace.emit("start", role="decode")
    trace.observe("lease", {"pool": "p", "pages": (1, 2)})
    path = Path(trace.path)
    assert path.name.startswith("decode-") and path.suffix == ".jsonl"
    assert len(path.read_text().splitlines()) == 2  # flushed line by line, before close
    trace.close()
    trace.emit("late")  # after close: nothing
    first, second = _lines(path)
    assert first["ev"] == "start" and first["role"] == "decode"
    assert first["p"] == f"decode:{path.stem.split('-')[1]}"
    assert isinstance(first["ts"], int) and second["ts"] >= first["ts"]
    assert second == {"ts": second["ts"], "p": first["p"], "ev": "lease", "pool": "p",
                      "pages": [1, 2]}
    again = ProtocolTrace(str(tmp_path / "t"), "decode")  # appends
    again.emit("start")
    again.close()
    assert [e["ev"] for e in _lines(path)] == ["start", "lease", "start"]


def test_off_unless_the_setting_names_a_directory(tmp_path: Path) -> None:
    assert ProtocolTrace.open("", "admission") is None
    assert ServiceRuntime(resolve("admission", {}, {})).trace is None
    cfg = resolve("admission", {}, {"PDMESH_PROTOCOL_TRACE_DIR": str(tmp_path)})
    rt = ServiceRuntime(cfg)
    assert rt.trace is not None
    rt.trace.close()
    (path,) = tmp_path.iterdir()
    assert path.name.startswith("admission-")
    assert [e["ev"] for e in _lines(path)] == ["start"]


async def test_receive_table_reports_expect_accept_land_commit_fence_drop() -> None:
    receiver = make_transport("tcp", progress_timeout_s=PROGRESS_S, faults=True)
    sender = make_transport("tcp", progress_timeout_s=PROGRESS_S, faults=True)
    pool, seen = _pool()
    attach(_Recorder(seen), pool, receiver)  # through the fault wrapper to its table
    address = await receiver.start()
    await sender.start()
    try:
        _src, _dst, target, plan = make_case(num_tokens=40, page_tokens=16, page_bytes=256)
        rid, epoch = target.reservation_id, target.epoch
        fut = receiver.expect(target)
        await sender.send(address, plan, _src.views())
        await fut
        await receiver.fence(rid)
        assert seen == [
            ("expect", {"lease": rid, "epoch": epoch, "pages": 3}),
            *[(ev, {"lease": rid, "epoch": epoch, "index": i})
              for i in range(3) for ev in ("accept", "land")],
            ("commit", {"lease": rid, "epoch": epoch, "ok": True, "reason": ""}),
            ("fence", {"lease": rid, "ok": True})]
        seen.clear()
        # A transfer cut inside its second page: the accepted page is reported landed
        # when the slot fails (no write into it can happen any more).
        _src, _dst, target, plan = make_case(num_tokens=40, page_tokens=16, page_bytes=256)
        rid, epoch = target.reservation_id, target.epoch
        fut = receiver.expect(target)
        sender.arm(rid, FaultPlan(truncate_after=2 * 96 + 256 + 100))  # 100 bytes of page 1
        with pytest.raises(TransferError):
            await sender.send(address, plan, _src.views())
        with pytest.raises(TransferError):
            await fut
        await receiver.fence(rid)
        kinds = [ev for ev, _ in seen]
        assert kinds[:5] == ["expect", "accept", "land", "accept", "fail"], kinds
        assert seen[5] == ("land", {"lease": rid, "epoch": epoch, "index": 1})
        assert seen[-1] == ("fence", {"lease": rid, "ok": True})
        seen.clear()
        # Frames for a fenced reservation change nothing: dropped (a commit refused).
        with pytest.raises(TransferError):
            await sender.send(address, plan, _src.views())
        # (named as the mesh names reservations: a lease id, the UUID's canonical form)
        assert seen[0] == ("drop", {"lease": str(uuid.UUID(rid)), "epoch": epoch,
                                    "reason": "FENCED"})
        assert {ev for ev, _ in seen} <= {"drop", "commit"}
        assert all(not f["ok"] for ev, f in seen if ev == "commit")
    finally:
        await sender.close()
        await receiver.close()


class _Recorder:
    """A stand-in for ProtocolTrace that keeps what it is given."""

    def __init__(self, seen: list[tuple[str, dict]]) -> None:
        self.seen = seen

    def observe(self, ev: str, fields: dict) -> None:
        self.seen.append((ev, fields))


@pytest.mark.mesh
def test_a_mesh_traces_every_process(tmp_path: Path) -> None:
    trace_dir = tmp_path / "trace"
    with run_mesh("--kv-tokens", "1024",
                  env=mesh_env(PDMESH_PROTOCOL_TRACE_DIR=str(trace_dir))) as mesh:
        status, body = mesh.http("POST", "/v1/completions", {
            "model": "tiny", "prompt": "trace this request", "max_tokens": 4,
            "temperature": 0})
        assert status == 200, body
        assert mesh.stop() == 0
    files = {path.name.split("-")[0]: _lines(path) for path in trace_dir.iterdir()}
    assert set(files) == {"admission", "prefill", "decode", "gateway"}, sorted(files)
    for role, events in files.items():
        kinds = [e["ev"] for e in events]
        assert kinds[0] == "start" and kinds[-1] == "stop", (role, kinds)
        assert all(e["p"].startswith(f"{role}:") for e in events)
    kinds = {role: {e["ev"] for e in events} for role, events in files.items()}
    assert {"decide", "reserve", "dispatch"} <= kinds["admission"]
    assert {"job", "lease", "written", "read", "commit_sent", "free"} <= kinds["prefill"]
    assert {"reserve_in", "lease", "expect", "accept", "land", "commit", "written",
            "fence", "free", "tell"} <= kinds["decode"]
    assert "submit" in kinds["gateway"]
    # One request, one reservation: the decode lease is the one admission reserved.
    (reserved,) = [e for e in files["admission"] if e["ev"] == "reserve"]
    (commit,) = [e for e in files["decode"] if e["ev"] == "commit"]
    (tell,) = [e for e in files["decode"] if e["ev"] == "tell"]
    assert commit["lease"] == reserved["lease"] and commit["ok"] is True
    assert tell["req"] == reserved["req"] and tell["kind"] == "finished"
    freed = [e for e in files["decode"] if e["ev"] == "free"]
    assert [e["lease"] for e in freed] == [reserved["lease"]]
    assert freed[0]["ts"] <= tell["ts"]  # released before telling
