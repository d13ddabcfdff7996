"""Configuration: one validated frozen config; README documents every setting."""

from __future__ import annotations

import pytest

from pdmesh.services.protocol.errors import ConfigError
from pdmesh.services.runtime.config import SETTINGS, markdown_table, resolve
from tests.support.meshproc import REPO


def test_readme_documents_every_setting() -> None:
    readme = (REPO / "README.md").read_text()
    assert markdown_table() in readme, "README settings table is stale: regenerate it with " \
        "`python -m pdmesh.services.runtime.config`"
    for s in SETTINGS:
        assert s.env in readme and s.flag in readme


def test_precedence_flag_over_env_over_default() -> None:
    env = {"PDMESH_TRANSPORT": "ucx", "PDMESH_KV_TOKENS": "100"}
    cfg = resolve("decode", {"kv_tokens": "64"}, env)
    assert cfg.transport == "ucx" and cfg.kv_tokens == 64 and cfg.page_tokens == 16
    assert cfg.kv_pages == 4
    assert cfg.http_port == 8103
    assert resolve("gateway", {}, {"PDMESH_GATEWAY_PORT": "9000"}).http_port == 9000


@pytest.mark.parametrize("env,field", [
    ({"PDMESH_TRANSPORT": "smoke"}, "transport"),
    ({"PDMESH_KV_TOKENS": "-1"}, "kv_tokens"),
    ({"PDMESH_KV_TOKENS": "lots"}, "kv_tokens"),
    ({"PDMESH_HTTP_PORT": "70000"}, "http_port"),
    ({"PDMESH_NATS_URL": "http://x"}, "nats_url"),
    ({"PDMESH_WORKER_ID": "a.b"}, "worker_id"),
    ({"PDMESH_FAULTS": "bypass_admission"}, "faults"),
])
def test_bad_settings_name_the_field(env: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve("decode", {}, env)
    assert info.value.field == field


def test_faults_need_explicit_permission() -> None:
    cfg = resolve("admission", {}, {"PDMESH_FAULTS": "bypass_admission",
                                    "PDMESH_ALLOW_FAULTS": "1"})
    assert cfg.fault_set == {"bypass_admission"}
