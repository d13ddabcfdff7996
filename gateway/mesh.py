"""The gateway's side of the mesh: submit to admission, then read the request's token stream.

The token subscription is made *before* the submit so no early token can be missed, and it
is removed in `finally` on every path (the per-request registry never outlives the request).
Leaving the `stream()` context early (client gone, stop string, deadline) publishes an
`Abort`, so every worker frees what it holds for the request (a tested path, not a timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from services import messages as m
from services.runtime import ServiceRuntime

log = logging.getLogger("pdmesh.gateway")
POLL_S = 0.1  # how often a waiting request checks that its client is still there


class MeshRejected(Exception):
    def __init__(self, rejection: m.Rejection) -> None:
        super().__init__(rejection.message)
        self.rejection = rejection


class MeshFailed(Exception):
    """An admitted request ended without finishing (a worker failed or gave up)."""

    def __init__(self, code: m.FailCode, detail: str) -> None:
        super().__init__(f"{code.name.lower()}: {detail}")
        self.code = code
        self.detail = detail


class ClientGone(Exception):
    """The HTTP client disconnected; the request is aborted across the mesh."""


class MeshUnavailable(Exception):
    """Admission did not answer (no responders or timeout)."""


@dataclass
class Submission:
    request_id: str
    events: asyncio.Queue[m.TokenEvent]
    finished: bool = False
    decode_worker: str = ""
    prefill_worker: str = ""
    got_first_token: bool = False
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (info event)


class MeshClient:
    def __init__(self, rt: ServiceRuntime, submit_timeout_s: float) -> None:
        self.rt = rt
        self.submit_timeout_s = submit_timeout_s
        self._decoder = m.Decoder(m.TokenEvent)
        self._inflight: dict[str, Submission] = {}
        rt.on_reconnect(self._fail_inflight)

    def _fail_inflight(self) -> None:
        """After a NATS reconnect, token events published while we were away are lost
        (NATS core is at-most-once), so an in-flight stream could wait forever for a
        missing seq: end every in-flight request with a clean error instead; the abort that
        follows frees its pages everywhere."""
        for sub in self._inflight.values():
            sub.events.put_nowait(m.TokenEvent(
                request_id=sub.request_id, seq=-2, fail_code=m.FailCode.INTERNAL,
                detail="control plane connection was interrupted; retry the request"))

    @contextlib.asynccontextmanager
    async def submit(self, req: m.SubmitRequest) -> AsyncIterator[Submission]:
        """Admit the request or raise MeshRejected/MeshUnavailable; yield its event queue."""
        queue: asyncio.Queue[m.TokenEvent] = asyncio.Queue()
        sub_state = Submission(request_id=req.request_id, events=queue)

        async def on_msg(msg) -> None:  # noqa: ANN001 - nats Msg
            try:
                queue.put_nowait(self._decoder.decode(msg.subject, msg.data))
            except m.MessageError as exc:
                log.warning("gateway: %s", exc)

        sub = await self.rt.nc.subscribe(m.tokens_subject(req.request_id), cb=on_msg)
        self._inflight[req.request_id] = sub_state
        try:
            try:
                reply = await self.rt.request(m.SUBMIT_SUBJECT, req, m.SubmitReply,
                                              self.submit_timeout_s)
            except TimeoutError as exc:
                raise MeshUnavailable(str(exc)) from None
            if not reply.admitted:
                assert reply.rejection is not None
                raise MeshRejected(reply.rejection)
            sub_state.decode_worker = reply.decode_worker
            sub_state.prefill_worker = reply.prefill_worker
            yield sub_state
        finally:
            self._inflight.pop(req.request_id, None)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            if not sub_state.finished:
                # Anything but a clean finish (client gone, deadline, stop string, error
                # already reported) tells every worker to let go now.
                with contextlib.suppress(Exception):
                    await self.rt.publish(m.ABORT_SUBJECT, m.Abort(
                        request_id=req.request_id, code=m.FailCode.ABORTED,
                        detail="gateway ended the request"))

    async def tokens(self, sub: Submission, deadline_s: float, alive: Callable[[], bool],
                     dead_worker: Callable[[Submission], str]) -> AsyncIterator[m.TokenEvent]:
        """Yield token events in order until one has a finish reason.

        Raises MeshFailed (a worker failed, or one serving this request stopped
        heartbeating: `dead_worker`), TimeoutError (deadline) or ClientGone (`alive` turned
        false). Both are checked every `POLL_S` whether or not tokens are flowing: a client
        that leaves a non-streaming request (nothing is written to it until the end) or a
        worker killed mid-stream is noticed at once, not after max_tokens or the deadline.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        next_check = loop.time() + POLL_S
        expected_seq = 0
        pending: dict[int, m.TokenEvent] = {}
        while True:
            now = loop.time()
            remaining = deadline - now
            if remaining <= 0:
                raise TimeoutError(f"request {sub.request_id} exceeded {deadline_s:g}s")
            if now >= next_check:
                next_check = now + POLL_S
                if not alive():
                    raise ClientGone(sub.request_id)
                # Only with nothing queued: a worker may finish and then go away.
                gone = dead_worker(sub) if sub.events.empty() else ""
                if gone:
                    raise MeshFailed(m.FailCode.PEER_RELEASED,
                                     f"worker {gone} stopped heartbeating")
            try:
                ev = await asyncio.wait_for(sub.events.get(), min(remaining, next_check - now))
            except TimeoutError:
                continue
            if ev.fail_code is not None:
                # Not marked finished: the abort that follows makes sure the other side
                # lets go too, even if the failing worker could not tell it.
                raise MeshFailed(m.FailCode(ev.fail_code), ev.detail)
            if ev.seq < 0:
                # Info event (seq -1) from prefill: how much of the prompt the prefix cache
                # served. It carries no tokens and does not end the stream.
                sub.cached_tokens = max(sub.cached_tokens, ev.cached_tokens)
                continue
            pending[ev.seq] = ev
            sub.got_first_token = True
            while expected_seq in pending:
                cur = pending.pop(expected_seq)
                expected_seq += 1
                if cur.finish is not None:
                    sub.finished = True
                yield cur
                if cur.finish is not None:
                    return
