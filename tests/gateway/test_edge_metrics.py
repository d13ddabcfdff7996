"""The gateway's API port serves only the API: no /metrics (per-tenant usage) to anyone, and
/health and /ready say healthy and ready or not, nothing more. Metrics and the details live
on the metrics port, bound to loopback by default. A real gateway (scripted mesh, real
nats-server)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.support.meshproc import NatsServer
from tests.support.scripted_mesh import gateways


async def _finish(mesh, request_id: str) -> None:
    await mesh.token(request_id, 0, finish=True)


async def _get(url: str, key: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as http, http.get(url, headers=headers) as resp:
        return resp.status, await resp.text()


async def test_an_unauthenticated_scrape_of_the_api_port_gets_nothing_per_tenant(
        nats_server: NatsServer) -> None:
    async with gateways(nats_server.url) as start:
        run = await start(_finish)
        status, _, _ = await run.post({"prompt": "Hi", "max_tokens": 1})  # alice's usage
        assert status == 200
        for key in (None, "sk-dev-bob"):  # anyone, and another tenant
            status, body = await _get(run.base + "/metrics", key)
            assert status == 404, body[:300]
            assert "tenant" not in body and "pdmesh:" not in body
        status, body = await _get(run.base + "/health")
        assert (status, body) == (200, '{"status": "healthy"}')
        status, body = await _get(run.base + "/ready")
        assert (status, body) == (200, '{"ready": true}')
        # The operators' port: the tenant series and the details.
        rt = run.gw.rt
        assert rt.metrics_port not in (0, rt.http_port)
        status, body = await _get(run.metrics_url)
        assert status == 200
        assert 'pdmesh:tokens_total{kind="prompt",model_name="tiny",tenant="alice"}' in body
        status, body = await _get(run.metrics_url.replace("/metrics", "/health"))
        assert status == 200 and '"role": "gateway"' in body and "worker_id" in body
        # Bound to loopback's 127.0.0.1 alone (the default --metrics-host).
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.2", rt.metrics_port)
