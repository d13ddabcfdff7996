"""The engine fingerprint: equal for the same model and engine build, different when the
model file, the decode path or the dtype differ; a checkpoint is hashed once per version.
`pdmesh soak` refuses to judge a mesh whose workers announce another one than its oracle."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import nats
import pytest
import torch
from aiohttp import web

from pdmesh.loadtest.cli import EXIT_USAGE
from pdmesh.loadtest.soak import fingerprints as soak_fingerprints
from pdmesh.loadtest.soak.run import _amain, build_parser
from pdmesh.services.engine import fingerprint, native
from pdmesh.services.engine.fingerprint import engine_fingerprint
from pdmesh.services.engine.model import LoadedModel
from pdmesh.services.engine.oracle import Oracle
from pdmesh.services.engine.reference import ReferenceEngine
from pdmesh.services.engine.runner import Engine, make_pool
from pdmesh.services.engine.tiny import TINY_CONFIG, tiny_weights
from pdmesh.services.engine.tokenizer import ByteTokenizer
from pdmesh.services.protocol import messages as m
from tests.support.meshproc import NatsServer


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch) -> Path:
    """The digest records of each test in a directory of its own (the kernels stay in the
    machine's cache: they take long to build)."""
    records = tmp_path / "records"
    monkeypatch.setattr(fingerprint, "_records_dir", lambda: records)
    return records


def engine(model: LoadedModel, dtype: torch.dtype = torch.float32) -> Engine:
    return Engine(model, make_pool(model, num_pages=4, dtype=dtype))


def test_the_same_model_and_engine_give_the_same_fingerprint(tiny) -> None:
    first = engine_fingerprint(tiny, engine(tiny))
    assert first == engine_fingerprint(tiny, engine(tiny), spec="tiny")
    # The oracle's reference engine and a worker's paged engine agree.
    assert first == engine_fingerprint(tiny, ReferenceEngine(tiny))
    parts = first.split("|")
    assert parts[0].startswith("tiny:") and parts[2] == f"torch-{torch.__version__}"
    assert parts[3:] == ["float32", f"cpu-{torch.backends.cpu.get_cpu_capability().lower()}"]


def test_other_weights_give_another_fingerprint(tiny) -> None:
    other = LoadedModel(TINY_CONFIG, tiny_weights(seed=1), ByteTokenizer(), "tiny")
    assert (engine_fingerprint(other, engine(other)).split("|")[0]
            != engine_fingerprint(tiny, engine(tiny)).split("|")[0])


def test_a_different_model_file_gives_another_fingerprint(tiny, tmp_path: Path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + bytes(1000))
    b.write_bytes(b"GGUF" + bytes(999) + b"\1")
    run = engine(tiny)
    fa = engine_fingerprint(tiny, run, spec=str(a))
    assert fa.startswith("sha256:") and fa == engine_fingerprint(tiny, run, spec=str(a))
    assert fa != engine_fingerprint(tiny, run, spec=str(b))
    assert fa.split("|")[1:] == engine_fingerprint(tiny, run, spec=str(b)).split("|")[1:]


def test_a_safetensors_directory_is_its_config_and_weights(tiny, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "llama"}')
    (ckpt / "model.safetensors").write_bytes(bytes(64))
    (ckpt / "tokenizer.json").write_text("{}")
    run = engine(tiny)
    before = engine_fingerprint(tiny, run, spec=str(ckpt))
    (ckpt / "tokenizer.json").write_text('{"changed": 1}')  # not what the engine computes
    assert engine_fingerprint(tiny, run, spec=str(ckpt)) == before
    (ckpt / "config.json").write_text('{"model_type": "llama", "rope_theta": 1}')
    assert engine_fingerprint(tiny, run, spec=str(ckpt)) != before


def test_a_model_without_a_spec_is_refused(tiny) -> None:
    named = LoadedModel(tiny.config, tiny.weights, tiny.tokenizer, "my-model")
    with pytest.raises(ValueError, match="pass the model spec"):
        engine_fingerprint(named, engine(named))


def test_the_decode_path_is_part_of_it(tiny, monkeypatch) -> None:
    if native.setting() == "off" or not native.available():
        pytest.skip("the native decode kernels do not run here")
    on_native = engine_fingerprint(tiny, engine(tiny))
    assert on_native.split("|")[1].startswith("native-step:")
    monkeypatch.setattr(native, "usable", lambda device, dtype: False)
    on_torch = engine_fingerprint(tiny, engine(tiny))
    assert on_torch.split("|")[1] == "torch"
    assert on_torch != on_native
    rest = [part for i, part in enumerate(on_torch.split("|")) if i != 1]
    assert rest == [part for i, part in enumerate(on_native.split("|")) if i != 1]


def test_the_dtype_is_part_of_it(tiny, monkeypatch) -> None:
    monkeypatch.setattr(native, "usable", lambda device, dtype: False)  # torch in both
    fp32 = engine_fingerprint(tiny, engine(tiny))
    bf16 = engine_fingerprint(tiny, engine(tiny, torch.bfloat16))
    assert fp32 != bf16
    assert bf16.split("|")[3] == "bfloat16"
    assert fp32.split("|")[:3] == bf16.split("|")[:3]


def test_a_checkpoint_is_hashed_once_per_size_and_mtime(tiny, tmp_path: Path, monkeypatch,
                                                        cache_dir: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(4096))
    hashed: list[Path] = []
    real = fingerprint._hash_file
    monkeypatch.setattr(fingerprint, "_hash_file", lambda p: hashed.append(p) or real(p))
    first = fingerprint.file_digest(path)
    assert fingerprint.file_digest(path) == first and len(hashed) == 1
    assert len(list(cache_dir.glob("*.json"))) == 1
    path.write_bytes(b"GGUF" + bytes(4095) + b"\1")  # same size, new mtime
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert fingerprint.file_digest(path) != first and len(hashed) == 2
    # A cache directory that cannot be written: hashed every time, never an error.
    monkeypatch.setattr(fingerprint, "_records_dir", lambda: Path("/proc/pdmesh-no"))
    assert fingerprint.file_digest(path) == fingerprint.file_digest(path)
    assert len(hashed) == 4


# -- the soak's oracle against the workers' heartbeats (loadtest/soak/fingerprints.py) -------
def worker_beat(worker_id: str, role: m.Role, fingerprint: str) -> m.Heartbeat:
    return m.Heartbeat(worker_id=worker_id, role=role, model="tiny", fingerprint=fingerprint)


def test_the_soak_refuses_only_a_worker_announcing_another_fingerprint() -> None:
    same = soak_fingerprints.compare("X", [worker_beat("p", m.Role.PREFILL, "X"),
                                           worker_beat("d", m.Role.DECODE, "X")])
    assert same["checked"] and soak_fingerprints.refusal(same) == ""
    old = soak_fingerprints.compare("X", [worker_beat("p", m.Role.PREFILL, ""),
                                          worker_beat("d", m.Role.DECODE, "X")])
    assert old["unannounced"] == ["prefill p"] and soak_fingerprints.refusal(old) == ""
    other = soak_fingerprints.compare("X", [worker_beat("p", m.Role.PREFILL, "X"),
                                            worker_beat("d", m.Role.DECODE, "Y")])
    assert other["mismatched"] == ["decode d"]
    assert "decode d: Y" in soak_fingerprints.refusal(other)


async def test_pdmesh_soak_will_not_judge_a_mesh_of_another_build(
        nats_server: NatsServer, capsys) -> None:
    """The oracle's fingerprint (its reference engine) is the workers' when they run its
    build; a decode announcing another one stops the soak before any request (exit 2)."""
    oracle = Oracle("tiny", threads=0)
    try:
        mine = soak_fingerprints.oracle_fingerprint(oracle, "tiny")
    finally:
        oracle.close()
    tiny = oracle.reference.loaded
    assert mine == engine_fingerprint(tiny, engine(tiny), spec="tiny")

    async def models(_req: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "tiny", "object": "model", "max_model_len": 4096}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    nc = await nats.connect(nats_server.url)
    prints = {"pre-1": mine, "dec-1": "sha256:000000000000|torch|torch-0|float32|cpu"}

    async def beats() -> None:
        while True:
            for worker, fp in prints.items():
                role = m.Role.PREFILL if worker.startswith("pre") else m.Role.DECODE
                await nc.publish(m.heartbeat_subject(role, worker),
                                 m.encode(worker_beat(worker, role, fp)))
            await asyncio.sleep(0.1)

    beating = asyncio.ensure_future(beats())
    try:
        args = build_parser().parse_args([
            "--base-url", f"http://127.0.0.1:{port}", "--nats-url", nats_server.url,
            "--oracle-threads", "0", "--quiet"])
        assert await _amain(args) == EXIT_USAGE
        err = capsys.readouterr().err
        assert "refusing to judge" in err and "decode dec-1" in err and mine in err
        check = await soak_fingerprints.check_fingerprints(nats_server.url, mine, 0.5)
        assert check["mismatched"] == ["decode dec-1"] and check["workers"]["prefill pre-1"]
    finally:
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)
        await nc.close()
        await runner.cleanup()
