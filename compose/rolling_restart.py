"""Rolling restart under load: restart containers one at a time while completions run.

compose/ci.sh runs this against the CI stack's two decode replicas. A bounded load
(`--concurrency` requests in flight, streaming and non-streaming, `/v1/completions` and
`/v1/chat/completions`, greedy, `ignore_eos` so that every answer is exactly `max_tokens`
long) runs through the gateway while each container in turn gets `docker restart` (SIGTERM:
the service drains, hands what outlived its drain timeout to the gateway, exits 0; the
gateway resumes those requests on the other replica) and is waited on until its healthcheck
(its /ready) passes and the gateway's /ready answers 200 again.

Every request must come back whole: HTTP 200, a finish reason, exactly `max_tokens`
completion tokens, and for a stream no error event and a closing `[DONE]`. Every answer to
one prompt must be the same text, streamed or not, resumed or not (greedy sampling; a
resumed request continues from the tokens already delivered). One summary line, a line per
restart and one per failed request (with the gateway's error body) go to stdout.

Each restart starts while the requests the previous one moved may still run on the other
replica: a restarted container keeps its hostname and its process id (1), so its worker id
(`<role>-<hostname>-<pid>`) is the one the moved requests lost, and the gateway takes it
back once it heartbeats again, so a request moved twice goes back to it.

    python compose/rolling_restart.py --url http://127.0.0.1:18000 --key KEY --model M \\
        --docker /usr/bin/docker CONTAINER [CONTAINER ...]

Exit status: 0 when every request came back whole, 1 otherwise (2: the harness itself
failed: a restart that did not come back, a load that ended before the restarts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

# (endpoint, prompt, max_tokens): request i asks PLAN[i % len(PLAN)], streamed on even
# rounds, so every prompt is asked both ways. Lengths so that a stream spans a restart.
# On CI's two cores a SmolLM2 stream gets a few tokens a second: 48 of them outlast CI's
# 3 s decode drain.
PLAN: tuple[tuple[str, str, int], ...] = (
    ("completions", "The history of the city of Paris begins", 48),
    ("chat", "Describe the water cycle in a few sentences.", 80),
    ("completions", "A recipe for bread: first,", 80),
    ("chat", "Why is the sky blue?", 48),
)
REQUEST_TIMEOUT_S = 180.0
POLL_S = 0.5


class HarnessError(Exception):
    """The harness could not run the restart it was asked for (not a request failure)."""

    def __init__(self, container: str, what: str) -> None:
        super().__init__(f"{container}: {what}")
        self.container = container
        self.what = what


@dataclass
class Reply:
    """What one request got back, streamed or not."""

    status: int = 0
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    done: bool = False  # a stream's closing `data: [DONE]` (a JSON reply: always True)
    error: str = ""  # an error event in the stream, or the error body of a non-200 reply
    reply_id: str = ""  # the gateway's id for the request (its logs name it)


@dataclass
class Result:
    index: int
    endpoint: str
    prompt: str
    max_tokens: int
    stream: bool
    started_s: float
    ended_s: float = 0.0
    reply: Reply = field(default_factory=Reply)

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.endpoint, self.prompt, self.max_tokens)


def parse_stream(lines: Iterable[str], chat: bool) -> Reply:
    """An SSE reply's text, finish reason, usage, `[DONE]` and any error event."""
    reply = Reply(status=200)
    parts = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):].strip()
        if data == "[DONE]":
            reply.done = True
            continue
        event = json.loads(data)
        if "error" in event:
            reply.error = json.dumps(event["error"])
            continue
        reply.reply_id = reply.reply_id or event.get("id", "")
        if event.get("usage"):
            reply.completion_tokens = event["usage"].get("completion_tokens")
        for choice in event.get("choices", []):
            parts.append((choice.get("delta", {}).get("content") if chat
                          else choice.get("text")) or "")
            reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
    reply.text = "".join(parts)
    return reply


def parse_json(status: int, body: str, chat: bool) -> Reply:
    """A non-streaming reply (or any error reply)."""
    reply = Reply(status=status, done=True)
    try:
        doc = json.loads(body)
    except ValueError:
        reply.error = body[:400]
        return reply
    if status != 200 or "error" in doc:
        reply.error = json.dumps(doc.get("error", doc))[:400]
        return reply
    choice = doc["choices"][0]
    reply.text = choice["message"]["content"] if chat else choice["text"]
    reply.finish_reason = choice.get("finish_reason")
    reply.completion_tokens = doc.get("usage", {}).get("completion_tokens")
    reply.reply_id = doc.get("id", "")
    return reply


def problem(result: Result) -> str:
    """Why `result` is not a whole answer ("" when it is)."""
    r = result.reply
    if r.status != 200:
        return f"HTTP {r.status}: {r.error}"
    if r.error:
        return f"error event in the stream: {r.error}"
    if not r.done:
        return "the stream ended without [DONE]"
    if r.finish_reason not in ("length", "stop"):
        return f"finish_reason {r.finish_reason!r}"
    if r.completion_tokens != result.max_tokens:
        return f"{r.completion_tokens} completion tokens, want {result.max_tokens}"
    return ""


def mismatches(results: Sequence[Result]) -> list[str]:
    """Answers that differ from the first whole answer to the same prompt."""
    first: dict[tuple[str, str, int], Result] = {}
    out = []
    for res in sorted(results, key=lambda r: r.index):
        if problem(res):
            continue
        seen = first.setdefault(res.key, res)
        if res.reply.text != seen.reply.text:
            out.append(f"request {res.index} ({res.reply.reply_id}) answered {res.endpoint} "
                       f"{res.prompt!r} with {res.reply.text[:80]!r}, request {seen.index} "
                       f"with {seen.reply.text[:80]!r}")
    return out


class Load:
    """Requests, `concurrency` at a time, as many as `allow()` granted so far (at most
    `max_requests` in all), until `close()`."""

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str,
                 concurrency: int, max_requests: int) -> None:
        self.session, self.url, self.model = session, url.rstrip("/"), model
        self.concurrency, self.max_requests = concurrency, max_requests
        self.results: list[Result] = []
        self.in_flight: dict[int, float] = {}  # request index -> its start (s since t0)
        self.t0 = time.monotonic()
        self.issued = 0
        self._allowed = 0
        self._closed = False
        self._changed = asyncio.Condition()

    async def allow(self, count: int) -> None:
        """Grant `count` more requests (never beyond `max_requests`)."""
        async with self._changed:
            self._allowed = min(self.max_requests, self._allowed + count)
            self._changed.notify_all()

    async def close(self) -> None:
        """No request beyond those granted; the workers end once those are done."""
        async with self._changed:
            self._closed = True
            self._changed.notify_all()

    def since(self) -> float:
        return time.monotonic() - self.t0

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            for _ in range(self.concurrency):
                tg.create_task(self._worker())

    async def _next(self) -> int | None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.issued < self._allowed or self._closed)
            if self.issued >= self._allowed:
                return None
            index, self.issued = self.issued, self.issued + 1
            self.in_flight[index] = self.since()
            return index

    async def _worker(self) -> None:
        while (index := await self._next()) is not None:
            try:
                self.results.append(await self._one(index))
            finally:
                del self.in_flight[index]

    async def _one(self, index: int) -> Result:
        endpoint, prompt, max_tokens = PLAN[index % len(PLAN)]
        stream = (index // len(PLAN)) % 2 == 0
        chat = endpoint == "chat"
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens,
                                "temperature": 0, "ignore_eos": True, "stream": stream}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if stream:
            body["stream_options"] = {"include_usage": True}
        res = Result(index, endpoint, prompt, max_tokens, stream, time.monotonic() - self.t0)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            async with self.session.post(self.url + path, json=body) as resp:
                text = await resp.text()
                if stream and resp.status == 200:
                    res.reply = parse_stream(text.splitlines(), chat)
                else:
                    res.reply = parse_json(resp.status, text, chat)
        except (aiohttp.ClientError, TimeoutError) as exc:
            res.reply = Reply(error=f"{type(exc).__name__}: {exc}")
        res.ended_s = time.monotonic() - self.t0
        return res


async def _docker(docker: str, *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        docker, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode().strip()


async def _until(what: str, container: str, timeout_s: float,
                 check: Callable[[], bool | Awaitable[bool]]) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        ok = check()
        if ok if isinstance(ok, bool) else await ok:
            return
        if time.monotonic() >= deadline:
            raise HarnessError(container, f"{what} not within {timeout_s:g}s")
        await asyncio.sleep(POLL_S)


async def roll(load: Load, session: aiohttp.ClientSession, url: str, docker: str,
               containers: Sequence[str], per_restart: int, ready_timeout_s: float
               ) -> list[str]:
    """Restart `containers` one at a time, `per_restart` requests granted to the load at
    each restart's start; a line per restart."""
    lines = []
    for container in containers:
        await load.allow(per_restart)
        # Streams under way, past their prefill (the oldest started a second ago).
        await _until("the load running", container, ready_timeout_s,
                     lambda c=container: _under_way(load, c))
        carried = set(load.in_flight)
        t0 = time.monotonic()
        rc, out = await _docker(docker, "restart", container)
        if rc:
            raise HarnessError(container, f"docker restart exited {rc}: {out}")
        await _until("healthy again", container, ready_timeout_s,
                     lambda c=container: _healthy(docker, c))
        await _until("the gateway ready", container, ready_timeout_s,
                     lambda: _ready(session, url))
        lines.append(f"restarted {container[:12]} in {time.monotonic() - t0:.1f}s "
                     f"({len(carried)} requests in flight at its start)")
    return lines


def _under_way(load: Load, container: str) -> bool:
    if load.issued >= load.max_requests and not load.in_flight:
        raise HarnessError(container, f"the load ended before this restart ({load.issued} "
                           "requests): raise --max-requests")
    return (len(load.in_flight) >= min(2, load.concurrency)
            and load.since() - min(load.in_flight.values()) >= 1.0)


async def _healthy(docker: str, container: str) -> bool:
    rc, state = await _docker(docker, "inspect", "-f",
                              "{{.State.Status}} {{.State.Health.Status}}", container)
    if rc or not state.startswith("running"):
        raise HarnessError(container, f"not running after its restart: {state}")
    return state == "running healthy"


async def _ready(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url.rstrip("/") + "/ready") as resp:
            return resp.status == 200
    except aiohttp.ClientError:
        return False


async def main_async(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.key}"}
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    t0 = time.monotonic()
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
        load = Load(session, args.url, args.model, args.concurrency, args.max_requests)
        runner = asyncio.create_task(load.run())
        lines: list[str] | None = None
        try:
            lines = await roll(load, session, args.url, args.docker, args.containers,
                               args.per_restart, args.ready_timeout_s)
            # Once every replica is back, one more round: the restarted ones serve too.
            await load.allow(args.concurrency)
        except HarnessError as exc:
            print(f"[compose-ci] rolling restart: harness failed: {exc}")
        finally:
            await load.close()
            await runner
        if lines is None:
            return 2
    seconds = time.monotonic() - t0
    results = sorted(load.results, key=lambda r: r.index)
    failed = [(r, p) for r in results if (p := problem(r))]
    differ = mismatches(results)
    for line in lines:
        print(f"[compose-ci]   {line}")
    for res, why in failed:
        print(f"[compose-ci]   FAILED request {res.index} ({res.endpoint}, "
              f"{'stream' if res.stream else 'json'}, max_tokens {res.max_tokens}, "
              f"{res.started_s:.1f}-{res.ended_s:.1f}s, id {res.reply.reply_id or '?'}): {why}")
    for line in differ:
        print(f"[compose-ci]   MISMATCH {line}")
    streams = sum(r.stream for r in results)
    print(f"[compose-ci] rolling restart: requests={len(results)} ok={len(results) - len(failed)} "
          f"failed={len(failed)} mismatched={len(differ)} restarts={len(lines)} "
          f"seconds={seconds:.0f} (streams {streams}, concurrency {args.concurrency})")
    return 1 if failed or differ else 0


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the gateway's base URL")
    parser.add_argument("--key", required=True, help="an API key of the stack's tenants")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--docker", default="docker", help="the docker CLI")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--per-restart", type=int, default=8,
                        help="requests granted to the load at each restart's start")
    parser.add_argument("--max-requests", type=int, default=40)
    parser.add_argument("--ready-timeout-s", type=float, default=240.0)
    parser.add_argument("containers", nargs="+", help="restarted in this order")
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
