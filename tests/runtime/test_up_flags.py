"""`pdmesh up`: --torch-threads reaches the workers, and the gateway gets a metrics port of
its own (the API port + 100 when free, else another free one; --metrics-port when given),
which compose's topology shares. Nothing is started."""

from __future__ import annotations

import argparse
import socket

import pytest

from pdmesh.services.ops import cli
from pdmesh.services.ops.launcher import Launcher, free_port
from pdmesh.services.ops.topology import mesh_services
from pdmesh.services.protocol.errors import StartupError
from pdmesh.services.runtime.settings import up_settings


def _up_env(**flags: str) -> dict[str, dict[str, str]]:
    args = argparse.Namespace(**{s.field: None for s in up_settings()})
    for field, value in flags.items():
        setattr(args, field, value)
    return cli.up_env(cli.up_configs(args, colocated=False, env={}), allow_dev=True)


def test_up_takes_torch_threads_and_hands_them_to_the_workers_only(
        capsys: pytest.CaptureFixture[str]) -> None:
    # Parsed and resolved like any flag; the start then stops at an argument check.
    assert cli.main(["up", "--torch-threads", "2", "--prefill", "0"]) == 2
    assert "--prefill and --decode must be at least 1" in capsys.readouterr().err
    env = _up_env(torch_threads="2")
    assert env["prefill"]["PDMESH_TORCH_THREADS"] == env["decode"]["PDMESH_TORCH_THREADS"] == "2"
    assert "PDMESH_TORCH_THREADS" not in env["gateway"] | env["admission"]


def test_up_hands_decode_torch_threads_to_decode_only() -> None:
    env = _up_env(torch_threads="2", decode_torch_threads="1")
    assert env["decode"]["PDMESH_DECODE_TORCH_THREADS"] == "1"
    assert env["decode"]["PDMESH_TORCH_THREADS"] == env["prefill"]["PDMESH_TORCH_THREADS"] == "2"
    assert "PDMESH_DECODE_TORCH_THREADS" not in env["prefill"] | env["gateway"]


def test_up_leaves_a_core_to_the_mesh_when_no_thread_count_is_given(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No --decode-torch-threads and no --torch-threads: decode's engine (a colocated
    worker's decode steps) takes the cores less one (the gateway, NATS and its own loop
    publish while a step runs), at least 1; prefill keeps torch's default; a given count
    wins."""
    for cores, want in ((2, 1), (1, 1), (16, 15)):
        monkeypatch.setattr(cli.os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        env = _up_env()
        assert env["decode"]["PDMESH_DECODE_TORCH_THREADS"] == str(want), cores
        assert env["prefill"]["PDMESH_TORCH_THREADS"] == "0"
    assert _up_env(torch_threads="2")["decode"]["PDMESH_DECODE_TORCH_THREADS"] == "0"
    assert _up_env(decode_torch_threads="2")["decode"]["PDMESH_DECODE_TORCH_THREADS"] == "2"
    args = argparse.Namespace(**{s.field: None for s in up_settings()})
    colocated = cli.up_env(cli.up_configs(args, colocated=True, env={}), allow_dev=True)
    assert colocated["colocated"]["PDMESH_DECODE_TORCH_THREADS"] == "15"
    assert colocated["colocated"]["PDMESH_TORCH_THREADS"] == "0"


def test_a_decode_worker_takes_its_own_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """--decode-torch-threads wins over --torch-threads on a decode worker; prefill keeps
    --torch-threads."""
    import torch

    from pdmesh.services.decode.service import DecodeService
    from pdmesh.services.prefill.service import PrefillService
    from pdmesh.services.runtime.config import resolve

    before = torch.get_num_threads()
    try:
        common = {"model": "tiny", "torch_threads": 2, "kv_tokens": 256}
        DecodeService(resolve("decode", {**common, "decode_torch_threads": 1}, {}))
        assert torch.get_num_threads() == 1
        PrefillService(resolve("prefill", common, {}))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def _launcher(gateway_port: int, **flags: str) -> Launcher:
    return Launcher(nats_url="nats://127.0.0.1:4222", gateway_port=gateway_port, prefill=1,
                    decode=1, env=_up_env(**flags))


def _port_pair() -> int:
    """A free port whose + 100 is free too."""
    for _ in range(100):
        port = free_port()
        if port + 100 <= 65535:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 100))
                except OSError:
                    continue
            return port
    raise AssertionError("no free pair of ports")


def test_the_gateway_gets_a_metrics_port_of_its_own() -> None:
    port = _port_pair()
    assert _launcher(port).choose_metrics_port() == port + 100
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 100))
        taken.listen()
        other = _launcher(port).choose_metrics_port()
        assert other not in (0, port, port + 100)
        with pytest.raises(StartupError, match=f"metrics port {port + 100}.*in use"):
            _launcher(port, metrics_port=str(port + 100)).choose_metrics_port()
    given = free_port()
    assert _launcher(port, metrics_port=str(given)).choose_metrics_port() == given
    # The launcher's choice is what the gateway's process is handed; compose's is 8100.
    launcher = _launcher(port)
    launcher.metrics_port = given
    gateway = mesh_services(gateway_port=port, metrics_port=given)[-1]
    assert launcher.child_env(gateway, {})["PDMESH_METRICS_PORT"] == str(given)
    assert mesh_services()[-1].env["PDMESH_METRICS_PORT"] == "8100"


def test_loadtest_looks_for_the_metrics_where_up_puts_them() -> None:
    from pdmesh.loadtest.client import default_metrics_url

    assert default_metrics_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8100/metrics"
    assert default_metrics_url("http://10.0.0.1:9000/") == "http://10.0.0.1:9100/metrics"
    assert default_metrics_url("http://[::1]:8000") == "http://[::1]:8100/metrics"


async def test_a_colocated_worker_prefills_and_decodes_on_their_own_thread_counts() -> None:
    """A colocated engine thread switches between --torch-threads (its prefill chunks) and
    --decode-torch-threads (its decode steps), call by call."""
    import torch

    from pdmesh.services.colocated.service import build
    from pdmesh.services.runtime.config import resolve

    before = torch.get_num_threads()
    try:
        svc = build(resolve("colocated", {"model": "tiny", "torch_threads": 2,
                                          "decode_torch_threads": 1, "kv_tokens": 256}, {}))
        assert (svc.prefill_threads, svc.decode_threads) == (2, 1)
        assert await svc.compute(torch.get_num_threads, threads=svc.decode_threads) == 1
        assert await svc.compute(torch.get_num_threads) == 1  # no count: left as it is
        assert await svc.compute(torch.get_num_threads, threads=svc.prefill_threads) == 2
        svc._compute.shutdown(wait=True)
    finally:
        torch.set_num_threads(before)
