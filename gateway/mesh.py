"""The gateway's side of the mesh: submit to admission, then read the request's token stream.

The token subscription is made *before* the submit so no early token can be missed, and it
is removed on every path (the per-request registry never outlives the request; a finished
request's subscription stays up to PHASE_LINGER_S in an owned task, for prefill's
`PhaseTiming`, which may trail the last token). Leaving the `submit()` context early
(client gone, stop string, no progress) publishes an `Abort`, so every worker frees what it
holds for the request (a tested path, not a timeout). Liveness is progress: see `tokens()`;
a worker that stops heartbeating fails its requests, judged by `WorkerLiveness` only while
the gateway could hear it.
A submit that would not fit the NATS server's max payload is refused before anything is
sent (`MeshTooLarge`).

Only the request's own workers can write its stream: each submit carries a fresh stream key
(services/protocol/streamauth.py) that admission gives only to the prefill and decode worker
it chose, and an event without its MAC is dropped and counted
(`pdmesh:refused_messages_total{service="gateway",kind="stream_mac"}`). The gateway holds
even those workers to the request: no more than `max_tokens` tokens reach the client (the
stream ends with `length` there, `kind="over_max_tokens"`), nothing after a stop token (an
end-of-sequence token unless `ignore_eos`, or one of `stop_token_ids`, once `min_tokens` are
out: the stream ends with `stop` there, `kind="past_stop"`), and decode's first token must be
the one prefill sampled and reported logprobs for (else the request fails,
`kind="first_token_mismatch"`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats.errors
from nats.aio.msg import Msg

from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol import streamauth
from pdmesh.services.runtime.service import ServiceRuntime

log = logging.getLogger("pdmesh.gateway")
POLL_S = 0.1  # how often a waiting request checks that its client is still there
SUBMIT_OVERHEAD_BYTES = 1024  # subject, reply inbox and headers on top of the message
PHASE_LINGER_S = 2.0  # a finished request's stream waits this long for prefill's timing
LOOP_LAG_S = 0.5  # a loop tick this late: the gateway was not processing its messages
FLUSH_TIMEOUT_S = 1.0  # the round trip that reads what NATS already sent, before a verdict
DRAIN_YIELDS = 3  # loop turns given to queued heartbeat callbacks after that round trip
MAX_HEARD = 4096  # worker ids remembered for liveness before the silent ones are forgotten
# How long decode's first token (which carries no logprobs) waits for prefill's report of it
# when the request asked for logprobs: the two come from different workers.
FIRST_REPORT_WAIT_S = 5.0


class MeshRejected(Exception):
    """Admission refused the request before anything was allocated."""

    def __init__(self, rejection: m.Rejected) -> None:
        super().__init__(rejection.outcome.detail)
        self.rejection = rejection
        self.outcome = rejection.outcome
        self.retry_after_s = rejection.retry_after_s


class MeshFailed(Exception):
    """An admitted request ended without finishing (a worker failed or gave up)."""

    def __init__(self, outcome: m.Outcome) -> None:
        super().__init__(f"{outcome.label}: {outcome.detail}")
        self.outcome = outcome
        self.code = outcome.code
        self.detail = outcome.detail


class ClientGone(Exception):
    """The HTTP client disconnected; the request is aborted across the mesh."""


class MeshUnavailable(Exception):
    """Admission did not answer (no responders or timeout)."""


class RequestStalled(TimeoutError):
    """No event of this request for too long: before its first token, no progress from
    prefill for --prefill-stall-s; after it, no token for --request-timeout-s."""

    def __init__(self, sub: Submission, silent_s: float) -> None:
        if sub.got_first_token:
            what = (f"no token for {silent_s:.1f}s from decode worker {sub.decode_worker} "
                    "(--request-timeout-s)")
        else:
            done, total = sub.progress
            what = (f"no progress for {silent_s:.1f}s from prefill worker "
                    f"{sub.prefill_worker or '?'} (--prefill-stall-s; last reported "
                    f"{done}/{total} prompt tokens)")
        super().__init__(f"request {sub.request_id} stalled: {what}")
        self.request_id = sub.request_id


class MeshTooLarge(Exception):
    """The request's control message is over the NATS server's max payload. The mesh's own
    servers accept any prompt up to natsauth.MAX_CONTEXT_TOKENS (their `max_payload` is set
    for it), so this means a NATS configured with a smaller limit, or a body with an outsize
    list (stop_token_ids): a clear 413, never a 500, and nothing was sent."""

    def __init__(self, request_id: str, size: int, limit: int) -> None:
        super().__init__(f"the request's control message is {size} bytes, over the mesh's "
                         f"NATS max_payload of {limit} bytes; send a shorter prompt or fewer "
                         f"token ids, or raise max_payload on the mesh's NATS server")
        self.request_id, self.size, self.limit = request_id, size, limit


class WorkerLiveness:
    """Which of a request's workers stopped heartbeating, judged only while the gateway
    could hear them.

    A heartbeat the gateway has not processed yet (its loop was busy, or the callback still
    waits its turn) is not a missing one. Before it blames a worker whose last heartbeat is
    older than the TTL, the check makes a NATS round trip (whatever the server sent before
    its PONG has been read) and gives the queued callbacks a few loop turns; then it blames
    the worker only if, for the whole last TTL, its loop kept up (no tick of `watch()` more
    than LOOP_LAG_S late, and none overdue now). A worker that died is caught a TTL after
    its last heartbeat; a gateway that cannot make the round trip, or whose own loop stalled,
    blames no one (the request ends by its progress clocks in `tokens()` if the worker is
    really gone).
    """

    def __init__(self, rt: ServiceRuntime, ttl_s: float) -> None:
        self.rt, self.ttl_s = rt, ttl_s
        self.lagged_at = -math.inf  # ... of the last tick of watch() found late
        self.ticked_at = time.monotonic()
        # Worker id -> when its last heartbeat arrived, whatever it said: a draining or
        # not-ready worker (which the capacity registry drops at once) is still alive and
        # still serving what it holds.
        self.heard: dict[str, float] = {}

    def observe(self, beat: m.Heartbeat) -> None:
        self.heard[beat.worker_id] = time.monotonic()
        if len(self.heard) > MAX_HEARD:  # forget the long silent (ids of past workers)
            now = time.monotonic()
            self.heard = {w: t for w, t in self.heard.items() if now - t <= self.ttl_s}

    def heard_since(self, worker: str, since: float) -> bool:
        """A heartbeat of `worker` arrived after `since` (time.monotonic())."""
        return self.heard.get(worker, -math.inf) > since

    def _silent(self, worker: str) -> bool:
        """No heartbeat from `worker` within the TTL (draining or not)."""
        heard = self.heard.get(worker)
        return heard is None or time.monotonic() - heard > self.ttl_s

    async def watch(self) -> None:
        """Tick every POLL_S; remember when a tick came late (the loop was stalled)."""
        self.ticked_at = time.monotonic()
        while True:
            await asyncio.sleep(POLL_S)
            now = time.monotonic()
            if now - self.ticked_at > POLL_S + LOOP_LAG_S:
                self.lagged_at = now
            self.ticked_at = now

    def listening(self, now: float) -> bool:
        """The loop kept up throughout the last TTL (so a missing heartbeat is missing)."""
        return (now - self.lagged_at > self.ttl_s
                and now - self.ticked_at <= POLL_S + LOOP_LAG_S)

    async def dead(self, workers: Iterable[str]) -> str:
        """The first of `workers` that stopped heartbeating, or "" (none, or no verdict)."""
        stale = [w for w in workers if w and self._silent(w)]
        if not stale:
            return ""
        try:
            await self.rt.nc.flush(timeout=FLUSH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - no round trip: the gateway cannot hear anyone
            return ""
        for _ in range(DRAIN_YIELDS):
            await asyncio.sleep(0)
        if not self.listening(time.monotonic()):  # guard: liveness-listening
            return ""
        for worker in stale:
            if self._silent(worker):  # guard: dead-worker
                return worker
        return ""


@dataclass
class Submission:
    request_id: str
    events: asyncio.Queue[m.LocalStreamEvent]
    finished: bool = False
    decode_worker: str = ""
    prefill_worker: str = ""
    got_first_token: bool = False
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (info event)
    admitted_at: float | None = None  # time.monotonic() of admission's answer
    queued_s: float | None = None  # admission's arrival-to-dispatch time, where it says
    # The first token's logprobs: sampled on prefill, which sends them in FirstTokenLogprobs.
    first_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    progress: tuple[int, int] = (0, 0)  # prefill's last (done_tokens, total_tokens)
    timing_seen: bool = False  # prefill's PhaseTiming arrived (and was observed)
    max_tokens: int = 0  # the most tokens the client gets (0: no limit)
    stop_ids: frozenset[int] = frozenset()  # tokens that end the generation ...
    min_tokens: int = 0  # ... once this many are out
    first_token_id: int | None = None  # what prefill sampled (FirstTokenLogprobs)
    wants_first_report: bool = False  # logprobs asked for: prefill reports the first token
    # The prompt's own logprobs by position (PromptLogprobs; echo with logprobs), taken only
    # for positions 1 .. prompt_len - 1 (a misbehaving prefill's others are dropped).
    prompt_logprobs: dict[int, tuple[float, list[tuple[int, float]]]] = field(
        default_factory=dict)
    prompt_len: int = 0
    tokens_out: int = 0  # tokens yielded so far (a resumed choice's: its earlier ones too)
    overstepped: bool = False  # the gateway cut decode's stream (not a clean finish)
    nats_sub: Any = None  # the token stream's subscription
    released: bool = False  # `let_go` ran


class MeshClient:
    def __init__(self, rt: ServiceRuntime, submit_timeout_s: float,
                 on_phase_timing: Callable[[m.PhaseTiming], None] | None = None,
                 eos_token_ids: Iterable[int] = ()) -> None:
        self.rt = rt
        self.eos_token_ids = frozenset(eos_token_ids)
        self.submit_timeout_s = submit_timeout_s
        self.on_phase_timing = on_phase_timing  # called once per request that reports one
        self._decoder: m.Decoder[m.StreamEvent] = m.Decoder(m.StreamEvent)
        self._inflight: dict[str, Submission] = {}
        rt.on_reconnect(self._fail_inflight)

    def _fail_inflight(self) -> None:
        """After a NATS reconnect, token events published while we were away are lost
        (NATS core is at-most-once), so an in-flight stream could wait forever for a
        missing seq: end every in-flight request with a clean error instead; the abort that
        follows frees its pages everywhere."""
        self.interrupt_all("control plane connection was interrupted; retry the request")

    def interrupt_all(self, detail: str) -> int:
        """End every in-flight stream with a clean error (`StreamInterrupted`); how many."""
        for sub in self._inflight.values():
            sub.events.put_nowait(m.StreamInterrupted(request_id=sub.request_id,
                                                      detail=detail))
        return len(self._inflight)

    @contextlib.asynccontextmanager
    async def submit(self, req: m.SubmitRequest,
                     headers: dict[str, str] | None = None) -> AsyncIterator[list[Submission]]:
        """Admit the request, every choice of it together, or raise MeshRejected /
        MeshUnavailable; yield one Submission (event queue) per choice, choice 0 first.
        `headers` go on the NATS submit (a test mesh's fault header), with the current
        span's `traceparent` when tracing is on."""
        # Checked before anything is sent or subscribed: nats-py raises MaxPayloadError
        # only after it registered the reply future (which then stays behind).
        size, limit = len(m.encode(req)) + SUBMIT_OVERHEAD_BYTES, self.rt.nc.max_payload
        if size > limit:
            raise MeshTooLarge(req.request_id, size, limit)
        stop_ids = frozenset(req.sampling.stop_token_ids) | (
            frozenset() if req.sampling.ignore_eos else self.eos_token_ids)
        choices = [m.SubmitChoice(request_id=req.request_id, stream_key=req.stream_key,
                                  sampling=req.sampling), *req.choices]
        held: list[Submission] = []
        try:
            for choice in choices:
                state = Submission(request_id=choice.request_id, events=asyncio.Queue(),
                                   max_tokens=req.max_tokens, stop_ids=stop_ids,
                                   min_tokens=req.sampling.min_tokens,
                                   prompt_len=len(req.prompt_ids),
                                   wants_first_report=choice.sampling.logprobs is not None)
                state.nats_sub = await self._listen(state, choice.stream_key)
                held.append(state)
                self._inflight[choice.request_id] = state
            if self.rt.trace is not None:
                self.rt.trace.emit("submit", req=req.request_id)
            if self.rt.tracing.enabled:  # admission continues the request's trace
                headers = self.rt.tracing.headers(into=headers)
            try:
                reply = await self.rt.request(m.SUBMIT_SUBJECT, req, m.SubmitReply,
                                              self.submit_timeout_s, headers=headers)
            except TimeoutError as exc:
                raise MeshUnavailable(str(exc)) from None
            except nats.errors.MaxPayloadError:  # headers larger than allowed for
                raise MeshTooLarge(req.request_id, len(m.encode(req)),
                                   self.rt.nc.max_payload) from None
            if isinstance(reply, m.Rejected):
                raise MeshRejected(reply)
            placed = {p.request_id: p for p in reply.choices}
            placed[req.request_id] = m.Placement(request_id=req.request_id,
                                                 decode_worker=reply.decode_worker,
                                                 prefill_worker=reply.prefill_worker)
            now = time.monotonic()
            for state in held:
                where = placed.get(state.request_id)
                if where is None:
                    raise MeshUnavailable(f"admission placed no worker for choice "
                                          f"{state.request_id}")
                state.admitted_at = now
                state.queued_s = reply.queued_s
                state.decode_worker = where.decode_worker
                state.prefill_worker = where.prefill_worker
            yield list(held)
        finally:
            for state in held:
                await self.let_go(state)

    async def _listen(self, state: Submission, stream_key: str) -> Any:
        """Subscribe to the choice's token stream, taking only events MACed under its key."""
        key = streamauth.parse_key(stream_key)
        decoder, queue = self._decoder, state.events

        async def on_msg(msg: Msg) -> None:
            if not streamauth.verify(key, msg.subject, msg.data, msg.headers):
                self.rt.refuse("stream_mac", f"an event on {msg.subject} without its MAC")
                return
            try:
                queue.put_nowait(decoder.decode(msg.subject, msg.data))
            except m.MessageError as exc:
                log.warning("gateway: %s", exc)

        return await self.rt.nc.subscribe(m.tokens_subject(state.request_id), cb=on_msg)

    async def let_go(self, sub_state: Submission) -> None:
        """The choice's reply is over (or it is resumed elsewhere): stop listening (after
        prefill's timing, when it may still come) and, unless it finished cleanly, tell
        every worker to let go. Idempotent."""
        if sub_state.released:
            return
        sub_state.released = True
        sub = sub_state.nats_sub
        self._inflight.pop(sub_state.request_id, None)
        if (sub_state.finished and not sub_state.timing_seen
                and sub_state.prefill_worker != sub_state.decode_worker):
            self.rt.spawn(self._linger(sub_state, sub), f"linger:{sub_state.request_id}")
        else:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if not sub_state.finished:  # guard: abort-on-disconnect
            # Anything but a clean finish (client gone, deadline, stop string, error
            # already reported) tells every worker to let go now.
            with contextlib.suppress(Exception):
                await self.rt.publish(m.ABORT_SUBJECT, m.Abort(
                    request_id=sub_state.request_id, outcome=m.Outcome(
                        code=m.Code.ABORTED, detail="gateway ended the request")))

    async def tokens(self, sub: Submission, stall_s: float, idle_s: float,
                     alive: Callable[[], bool], dead_worker: Callable[[Submission], Awaitable[str]]
                     ) -> AsyncIterator[m.TokenEvent]:
        """Yield token events in order until one has a finish reason.

        Liveness is progress, not a fixed end-to-end deadline (a long prompt with a long
        generation runs as long as it moves): until the first token, the request ends when
        the mesh sent nothing for it (prefill's `PrefillProgress` comes at least every
        heartbeat) for `stall_s`; after it, when no event came for `idle_s`.
        Raises RequestStalled (either), MeshFailed (a worker failed; or one serving this
        request stopped heartbeating, as `dead_worker` (`WorkerLiveness.dead`) judges it:
        `Code.WORKER_LOST`, which the caller may resume) or ClientGone (`alive` turned
        false).
        Both are checked every `POLL_S` whether or not tokens are flowing: a client that
        leaves a non-streaming request (nothing is written to it until the end) or a worker
        killed mid-stream is noticed at once, not after max_tokens or a deadline.
        """
        loop = asyncio.get_running_loop()
        last_event = loop.time()
        next_check = last_event + POLL_S
        expected_seq = 0
        pending: dict[int, m.TokenEvent] = {}
        report_by: float | None = None  # seq 0 held for prefill's first-token report until
        while True:
            now = loop.time()
            limit_s = idle_s if sub.got_first_token else stall_s
            # Only with nothing queued: a slow loop must not blame the mesh for its delay.
            if now - last_event >= limit_s and sub.events.empty():
                raise RequestStalled(sub, now - last_event)
            if report_by is not None and now >= report_by:
                raise MeshFailed(m.Outcome(code=m.Code.INTERNAL, detail=(
                    "prefill's report of the first token (its logprobs) did not come")))
            if now >= next_check:
                next_check = now + POLL_S
                if not alive():
                    raise ClientGone(sub.request_id)
                # Only with nothing queued: a worker may finish and then go away (also not
                # when the check's own drain brought in its events).
                gone = await dead_worker(sub) if sub.events.empty() else ""
                if gone and sub.events.empty():
                    raise MeshFailed(m.Outcome(code=m.Code.WORKER_LOST, worker=gone,
                                               detail=f"worker {gone} stopped heartbeating"))
            if not sub.events.empty():  # already here: no timer
                ev = sub.events.get_nowait()
            else:
                wake = next_check if report_by is None else min(next_check, report_by)
                try:  # (asyncio.timeout, not wait_for: no task per event)
                    async with asyncio.timeout(max(wake - now, 0.001)):
                        ev = await sub.events.get()
                except TimeoutError:
                    continue
            last_event = loop.time()
            match ev:
                case m.StreamFailed(outcome=outcome):
                    # Not marked finished: the abort that follows makes sure the other side
                    # lets go too, even if the failing worker could not tell it.
                    raise MeshFailed(outcome)
                case m.StreamInterrupted(detail=detail):
                    raise MeshFailed(m.Outcome(code=m.Code.INTERRUPTED, detail=detail))
                case m.PrefixCacheInfo(cached_tokens=cached):
                    # How much of the prompt the prefix cache served: no tokens, no end.
                    sub.cached_tokens = max(sub.cached_tokens, cached)
                    continue
                case m.FirstTokenLogprobs(token_id=token_id, logprobs=logprobs):
                    # Prefill's logprobs of the first token (decode's seq 0 carries none);
                    # a seq 0 held for it goes on below.
                    sub.first_token_id, sub.first_logprobs = token_id, logprobs
                case m.TokenEvent():
                    pending[ev.seq] = ev
                    sub.got_first_token = True
                case m.PrefillProgress(done_tokens=done, total_tokens=total):
                    sub.progress = (done, total)  # its arrival is what keeps us waiting
                    continue
                case m.PhaseTiming():
                    self._timing_seen(sub, ev)
                    continue
                case m.PromptLogprobs():
                    _take_prompt_logprobs(sub, ev)
                    continue
            while expected_seq in pending:
                if self._unreported(sub, pending, expected_seq):  # guard: first-report-wait
                    if report_by is None:
                        report_by = loop.time() + FIRST_REPORT_WAIT_S
                    break
                report_by = None
                cur = self._held_to_the_request(sub, pending.pop(expected_seq), expected_seq)
                expected_seq += 1
                if cur.finish is not None and not sub.overstepped:
                    sub.finished = True
                sub.tokens_out += len(cur.token_ids)
                yield cur
                if cur.finish is not None:
                    return

    async def prompt_logprobs(self, sub: Submission, prompt_len: int, wait_s: float
                              ) -> list[tuple[float, list[tuple[int, float]]]] | None:
        """Positions 1 .. prompt_len - 1 of the prompt's logprobs once they are all in
        (prefill's events may trail decode's last token: they are read for up to
        `wait_s`); None if some never came."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while not all(i in sub.prompt_logprobs for i in range(1, prompt_len)):
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return None
            try:
                ev = await asyncio.wait_for(sub.events.get(), left)
            except TimeoutError:
                return None
            if isinstance(ev, m.PromptLogprobs):
                _take_prompt_logprobs(sub, ev)
        return [sub.prompt_logprobs[i] for i in range(1, prompt_len)]

    @staticmethod
    def _unreported(sub: Submission, pending: dict[int, m.TokenEvent], seq: int) -> bool:
        """Decode's first token, without logprobs, when the request asked for them and
        prefill's report (FirstTokenLogprobs: the token it sampled, its logprobs) is not in
        yet: prefill and decode publish from different connections, so decode's event may
        come first. It is held until the report comes (then the token is checked against
        it, and its logprobs are the reply's) or FIRST_REPORT_WAIT_S passed (a failure:
        the reply would lack them)."""
        return (seq == 0 and sub.wants_first_report and sub.first_token_id is None
                and not pending[seq].logprobs)

    def _held_to_the_request(self, sub: Submission, ev: m.TokenEvent,
                             seq: int) -> m.TokenEvent:
        """The event as the client may see it: decode's first token must be prefill's, and
        nothing past `max_tokens` (the stream ends there with `length`; an over-long
        stream is not marked finished, so the exit aborts whatever decode still holds)."""
        if (seq == 0 and sub.first_token_id is not None and ev.token_ids
                and ev.token_ids[0] != sub.first_token_id):  # guard: first-token-agrees
            self.rt.refuse("first_token_mismatch", f"{sub.request_id}: decode's first token "
                           f"{ev.token_ids[0]}, prefill's {sub.first_token_id}")
            raise MeshFailed(m.Outcome(code=m.Code.INTERNAL, detail=(
                "decode's first token is not the one prefill sampled")))
        for i, token in enumerate(ev.token_ids):
            stops = token in sub.stop_ids and sub.tokens_out + i >= sub.min_tokens
            if stops:  # guard: gateway-stop
                if i + 1 < len(ev.token_ids) or ev.finish is None:
                    self.rt.refuse("past_stop", f"{sub.request_id}: tokens after a stop token")
                    sub.overstepped = True  # not a clean finish: abort on exit
                    return msgspec.structs.replace(ev, token_ids=ev.token_ids[:i + 1],
                                                   logprobs=ev.logprobs[:i + 1],
                                                   finish=m.FINISHED_STOP)
                break
        room = sub.max_tokens - sub.tokens_out
        n = len(ev.token_ids)
        if sub.max_tokens and (n > room or (  # guard: gateway-max-tokens
                n == room and ev.finish is None)):
            if n > room:
                self.rt.refuse("over_max_tokens", f"{sub.request_id}: more than "
                               f"{sub.max_tokens} tokens")
            sub.overstepped = True  # not decode's clean finish: abort on exit
            return msgspec.structs.replace(ev, token_ids=ev.token_ids[:room],
                                           logprobs=ev.logprobs[:room],
                                           finish=m.FINISHED_LENGTH)
        return ev

    def _timing_seen(self, sub: Submission, timing: m.PhaseTiming) -> None:
        if not sub.timing_seen:
            sub.timing_seen = True
            if self.on_phase_timing is not None:
                self.on_phase_timing(timing)

    async def _linger(self, sub: Submission, nats_sub: Any) -> None:
        """Wait up to PHASE_LINGER_S for a finished request's PhaseTiming (prefill sends it
        after decode's ack, which races decode's tokens), then unsubscribe."""
        loop = asyncio.get_running_loop()
        until = loop.time() + PHASE_LINGER_S
        try:
            while (left := until - loop.time()) > 0:
                try:
                    ev = await asyncio.wait_for(sub.events.get(), left)
                except TimeoutError:
                    return
                if isinstance(ev, m.PhaseTiming):
                    self._timing_seen(sub, ev)
                    return
        finally:
            with contextlib.suppress(Exception):
                await nats_sub.unsubscribe()


def _take_prompt_logprobs(sub: Submission, ev: m.PromptLogprobs) -> None:
    """Keep the prompt logprobs of positions the prompt has (1 .. prompt_len - 1)."""
    for pos, entry in enumerate(ev.logprobs, ev.start):
        if 1 <= pos < sub.prompt_len:
            sub.prompt_logprobs[pos] = entry
