"""Run by tests/gateway/test_edge_limits.py in its own process (RLIMIT_NOFILE is
process-wide): a service's HTTP port with no file descriptor left for `HOLD_S`, while the
test's clients wait in its listen backlog; then descriptors are free again. Prints `PORT
<n>` once the descriptors are gone, and after a line on stdin one JSON object: the log
records that mention accept() and the accept errors counted."""

from __future__ import annotations

import asyncio
import json
import logging
import sys

from pdmesh.services.runtime.config import resolve
from pdmesh.services.runtime.service import ServiceRuntime, counter_total
from tests.support.emfile_process import no_file_descriptors

HOLD_S = 2.0


class Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


async def main() -> dict:
    counted = Count()
    logging.getLogger().addHandler(counted)
    logging.getLogger().setLevel(logging.INFO)
    rt = ServiceRuntime(resolve("admission", {"http_host": "127.0.0.1", "http_port": 0}, {}))
    await rt.start_http()
    with no_file_descriptors():
        print(f"PORT {rt.http_port}", flush=True)
        await asyncio.sleep(HOLD_S)  # the clients connect; every accept() fails meanwhile
    await asyncio.to_thread(sys.stdin.readline)  # the test has its answers
    metrics = getattr(rt, "edge_metrics", None)
    errors = counter_total(metrics.accept_errors) if metrics else None
    await rt.drain("test over")
    return {"accept_lines": [line for line in counted.lines if "accept" in line],
            "lines": len(counted.lines), "accept_errors": errors}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())), flush=True)
