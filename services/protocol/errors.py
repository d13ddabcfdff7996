"""Errors shared by the services, each with the fields a caller needs to act on it."""

from __future__ import annotations

from typing import Any


class PdmeshError(Exception):
    """Base class: every pdmesh error renders as one clear line."""


class ConfigError(PdmeshError, ValueError):
    """A setting has a bad value; raised once at start, before anything runs."""

    def __init__(self, field: str, value: Any, reason: str) -> None:
        super().__init__(f"bad setting {field}={value!r}: {reason}")
        self.field = field
        self.value = value
        self.reason = reason


class StartupError(PdmeshError):
    """A service could not start (NATS unreachable, port in use, capacity mismatch...)."""

    def __init__(self, service: str, what: str, detail: str) -> None:
        super().__init__(f"{service}: cannot start: {what}: {detail}")
        self.service = service
        self.what = what
        self.detail = detail


class TicketError(PdmeshError):
    """An admission ticket failed verification (forged, expired, replayed, wrong worker)."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"ticket for {request_id} refused: {reason}")
        self.request_id = request_id
        self.reason = reason
