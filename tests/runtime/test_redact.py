"""No credential in a log line: URL passwords, Authorization values, bearer tokens and the
values of secret settings are masked by `services/runtime/redact.py`, which the config feeds
and `pdmesh serve` installs on its log handlers."""

from __future__ import annotations

import io
import logging
import secrets

import pytest

from pdmesh.services.runtime import redact
from pdmesh.services.runtime.config import resolve, resolve_nats
from pdmesh.services.runtime.settings import SETTINGS


@pytest.mark.parametrize(("text", "clean"), [
    ("cannot start: NATS at nats://admin:S3cretPW@127.0.0.1:1: unreachable",
     "cannot start: NATS at nats://admin:***@127.0.0.1:1: unreachable"),
    ("nats://a:p1@h1:4222,tls://b:p%40ss@h2:4222", "nats://a:***@h1:4222,tls://b:***@h2:4222"),
    ("url='wss://u:pa:ss@host/x'", "url='wss://u:***@host/x'"),
    ("Authorization: Bearer sk-live-123", "Authorization: Bearer ***"),
    ("{'Authorization': 'Bearer sk-live-123', 'Host': 'x'}",
     "{'Authorization': 'Bearer ***', 'Host': 'x'}"),
    ("authorization=Basic dXNlcjpwYXNz", "authorization=Basic ***"),
    ("Invalid header value: b'Bearer sk-dev-alice...'", "Invalid header value: b'Bearer ***'"),
])
def test_credentials_in_text_are_masked(text: str, clean: str) -> None:
    assert redact.redact(text) == clean
    assert redact.redact(clean) == clean  # masking twice changes nothing


@pytest.mark.parametrize("text", [
    "http://127.0.0.1:8000/v1/completions", "nats://127.0.0.1:4222,nats://10.0.0.2:4222",
    "user@example.com wrote 12 tokens", "the first token came after 31 ms",
    "mailto:someone@example.com", "Authorization header missing",
])
def test_ordinary_text_is_left_alone(text: str) -> None:
    assert redact.redact(text) == text


def test_a_registered_value_is_masked_wherever_it_appears() -> None:
    value = secrets.token_hex(16)
    assert redact.redact(f"x{value}y") == f"x{value}y"
    redact.register(value)
    assert redact.redact(f"x{value}y {value}") == "x***y ***"
    redact.register("abc")  # too short to mask everywhere: not registered
    assert redact.redact("abcdef abc") == "abcdef abc"


def test_the_config_registers_every_secret_setting_and_nats_url_passwords() -> None:
    password, url_password, salt = (secrets.token_urlsafe(12), secrets.token_urlsafe(12),
                                    secrets.token_hex(32))
    assert {s.field for s in SETTINGS if s.secret} == {"nats_password", "signing_key",
                                                       "salt_key", "kv_tier_key"}
    resolve("gateway", {}, {"PDMESH_NATS_PASSWORD": password, "PDMESH_NATS_USER": "gw",
                            "PDMESH_SALT_KEY": salt,
                            "PDMESH_NATS_URL": f"nats://gw:{url_password}@10.0.0.9:4222"})
    text = f"pw {password} url-pw {url_password} salt {salt}"
    assert redact.redact(text) == "pw *** url-pw *** salt ***"
    other = secrets.token_urlsafe(12)
    resolve_nats({"nats_url": f"tls://tools:{other}@h:4222"}, {})
    assert other not in redact.redact(f"password was {other}")


def _capture(logger_name: str) -> tuple[logging.Logger, io.StringIO, logging.Handler]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger, stream, handler


def test_the_filter_masks_message_arguments_and_exceptions() -> None:
    logger, stream, handler = _capture("pdmesh.test_redact")
    secret = secrets.token_hex(12)
    redact.register(secret)
    try:
        redact.install(logger)
        redact.install(logger)  # once per handler
        assert sum(isinstance(f, redact.RedactFilter) for f in handler.filters) == 1
        logger.info("connecting to %s with %r", "nats://svc:Hunter22@h:4222",
                    {"Authorization": "Bearer sk-prod-9f8a7b"})
        try:
            raise RuntimeError(f"key {secret} refused")
        except RuntimeError:
            logger.exception("failed: Authorization: Bearer %s", "sk-prod-9f8a7b")
        logger.info("stack", stack_info=True, extra={})
    finally:
        logger.removeHandler(handler)
    out = stream.getvalue()
    for leak in ("Hunter22", "sk-prod-9f8a7b", secret):
        assert leak not in out, out
    assert "nats://svc:***@h:4222" in out and "RuntimeError: key *** refused" in out


def test_install_covers_the_root_handlers_basic_config_makes() -> None:
    root = logging.getLogger()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root.addHandler(handler)
    try:
        redact.install()
        assert any(isinstance(f, redact.RedactFilter) for f in handler.filters)
        logging.getLogger("pdmesh.some.child").warning("url nats://u:Topsecret1@h")
    finally:
        root.removeHandler(handler)
    assert "Topsecret1" not in stream.getvalue() and "nats://u:***@h" in stream.getvalue()
