"""Errors and reason codes of the KV data plane (one place, each with fields)."""

from __future__ import annotations

import enum


class Reason(enum.IntEnum):
    """Why a transfer failed. Sent on the wire in NACK frames: never renumber, only append."""

    OK = 0
    STALE_EPOCH = 1  # frame epoch differs from the live reservation's epoch
    UNKNOWN_RESERVATION = 2  # no live expectation for that reservation id (foreign / finished)
    OUT_OF_RANGE = 3  # page index beyond the prompt's pages or dest page id not the leased one
    DUPLICATE = 4  # page (or sequence number) already received
    MISORDERED = 5  # a gap: frame ahead of the next expected page / sequence number
    BAD_CHECKSUM = 6  # payload checksum (or commit digest) mismatch
    LENGTH_MISMATCH = 7  # payload length or token count differs from the expectation
    INCOMPLETE = 8  # commit before every prompt page was written
    PEER_LOST = 9  # connection reset / closed / no progress within the progress timeout
    DEADLINE = 10  # the transfer's deadline passed before a verified commit
    FENCED = 11  # the receiver fenced the reservation (abort)
    BAD_HEADER = 12  # header malformed (magic, version, kind, header checksum, sizes)
    CLOSED = 13  # the local transport was closed
    INVALID_PLAN = 14  # the sender's plan / buffers are inconsistent (nothing was sent)
    QUARANTINED = 15  # a write into the pages may still land: they must never be re-leased
    UNAUTHENTICATED = 16  # a header's MAC does not verify under the live reservation's key
    ABORTED = 17  # the sender's producer gave up before every page was final (`PagesReady.fail`)


class FrameError(ValueError):
    """A frame header is malformed (the receiver answers with Reason.BAD_HEADER and closes
    the connection)."""

    reason = Reason.BAD_HEADER

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class AuthError(FrameError):
    """A header's MAC does not verify under the live reservation's key: the frame is
    dropped and its connection closed; the reservation it names is not touched."""

    reason = Reason.UNAUTHENTICATED


class LinkIdle(TimeoutError):
    """Internal: nothing of the next frame arrived within the wait (nothing was consumed;
    the next read resumes). Raised only to callers that asked for it (`idle=True`);
    anywhere else it reads as a stalled peer (a TimeoutError)."""


class TransferError(Exception):
    """A transfer failed. Raised by `send()` and set on the future returned by `expect()`.

    `pages_poisoned` lists destination page ids that had received bytes of this failed
    transfer and were overwritten with the poison pattern before the error was reported.
    """

    def __init__(
        self,
        reservation_id: str,
        reason: Reason,
        detail: str = "",
        pages_poisoned: tuple[int, ...] = (),
    ) -> None:
        super().__init__(f"{reason.name} reservation={reservation_id}: {detail}")
        self.reservation_id = reservation_id
        self.reason = reason
        self.detail = detail
        self.pages_poisoned = pages_poisoned

    @property
    def unreachable(self) -> bool:
        """Whether the send failed because the receiver cannot be reached or cannot take a
        transfer now (a connect failure: PEER_LOST, detail `connect <address>: ...`; or a
        `PeerUnreachable` refusal), not because of this transfer: the caller routes around
        that receiver (admission sets it aside) instead of sending it the next one."""
        connect = self.detail.startswith("connect ")  # the transports' connect failures
        return self.reason is Reason.PEER_LOST and connect  # guard: transport-unreachable
