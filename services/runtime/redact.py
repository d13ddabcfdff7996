"""Credentials kept out of log lines and error text.

`redact(text)` hides three things:
- the password of a URL's userinfo: `nats://user:pass@host` -> `nats://user:***@host`;
- the credentials of an `Authorization` header (`Authorization: Bearer sk-...` ->
  `Authorization: Bearer ***`, also in a dict's or a bytes' repr) and any `Bearer <token>`;
- every value given to `register`: config.py registers the value of each setting marked
  `secret` in settings.py (the NATS password, the signing and salt keys) and the passwords
  of its NATS URLs. Values shorter than `MIN_SECRET_CHARS` are not registered: replacing
  them wherever they occur would rewrite ordinary text.

`RedactFilter` applies `redact` to a log record: its message with the arguments merged in,
its exception text and its stack text. `install()` puts one on every handler of the root
logger (what `logging.basicConfig` made); `pdmesh serve` and `pdmesh up` call it, and so
may any other entry point that configures logging.
"""

from __future__ import annotations

import logging
import re
import threading
from urllib.parse import unquote, urlsplit

__all__ = ["MASK", "MIN_SECRET_CHARS", "RedactFilter", "install", "redact", "register",
           "register_url", "registered", "url_password"]

MASK = "***"
MIN_SECRET_CHARS = 6

# scheme://user:password@ : the user part has no ':', '/' or '@'; the password no '@' or
# '/' (RFC 3986 userinfo holds neither unencoded).
_URL_PASSWORD = re.compile(
    r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/@'\"<>]*:)[^\s@/'\"<>]+(?=@)")
# An Authorization header, as text (`Authorization: Basic x`) or in a repr
# (`'Authorization': 'Bearer x'`, `authorization=x`): the scheme name is kept.
_AUTH_HEADER = re.compile(
    r"(?P<head>\bauthorization\b['\"]?\s*[:=]\s*(?:(?-i:b)?['\"])?(?:(?:bearer|basic)\s+)?+)"
    r"(?!\*\*\*)[^\s'\",;]+", re.IGNORECASE)
_BEARER = re.compile(r"(?P<head>\bbearer\s+)(?!\*\*\*)[^\s'\",;]+", re.IGNORECASE)

_lock = threading.Lock()
_secrets: set[str] = set()
_pattern: re.Pattern[str] | None = None


def register(secret: str | None) -> None:
    """Hide `secret` in every text `redact` rewrites after this call (ignored when shorter than
    MIN_SECRET_CHARS)."""
    global _pattern
    if not secret or len(secret) < MIN_SECRET_CHARS:
        return
    with _lock:
        if secret in _secrets:
            return
        _secrets.add(secret)
        # Longest first, so a secret containing another is hidden whole.
        _pattern = re.compile("|".join(re.escape(s) for s in
                                       sorted(_secrets, key=len, reverse=True)))


def url_password(url: str) -> str:
    """The password in `url`'s userinfo, percent-decoded ('' when there is none)."""
    try:
        return unquote(urlsplit(url.strip()).password or "")
    except ValueError:
        return ""


def register_url(url: str) -> None:
    """Register the password of `url`'s userinfo, as written and percent-decoded."""
    match = _URL_PASSWORD.search(url)
    if match:
        register(url[match.end("head"):match.end()])
    register(url_password(url))


def registered() -> int:
    """How many values `register` holds."""
    with _lock:
        return len(_secrets)


def redact(text: str) -> str:
    """`text` with URL passwords, Authorization credentials, bearer tokens and every
    registered value replaced by MASK."""
    if not text:
        return text
    text = _URL_PASSWORD.sub(lambda m: m["head"] + MASK, text)
    text = _AUTH_HEADER.sub(lambda m: m["head"] + MASK, text)
    text = _BEARER.sub(lambda m: m["head"] + MASK, text)
    pattern = _pattern
    if pattern is not None:
        text = pattern.sub(MASK, text)
    return text


class RedactFilter(logging.Filter):
    """Rewrites each record it sees: the message is merged with its arguments and redacted
    (the record then has no arguments), the exception and stack text are formatted and
    redacted. Never drops a record."""

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - logging reports a bad format string itself
            return True
        record.msg, record.args = redact(message), None  # guard: redact-filter
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


def install(logger: logging.Logger | None = None) -> None:
    """Put a RedactFilter on every handler of `logger` (default: the root logger) that has
    none yet."""
    target = logging.getLogger() if logger is None else logger
    for handler in target.handlers:
        if not any(isinstance(f, RedactFilter) for f in handler.filters):
            handler.addFilter(RedactFilter())
