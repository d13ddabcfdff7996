"""Show that each isolation guard is load-bearing: remove it, run its test, expect a failure.

    .venv/bin/python tests/guards/check_guards.py            # all guards (~10 min)
    .venv/bin/python tests/guards/check_guards.py fence ticket  # some of them

Each mutation replaces one exact snippet in one file (the guard), runs the named tests with
pytest, and restores the file in `finally` whatever happens. A guard passes this check when
its tests FAIL with the guard removed (and they pass on the untouched tree: `make test`).
This is a developer tool, not part of the suite: it edits the working tree while it runs.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutation:
    """Replace `old` by `new` in `path` (plus any `more` edits) and run `tests`."""

    name: str
    guard: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    more: tuple[tuple[str, str, str], ...] = ()

    @property
    def edits(self) -> tuple[tuple[str, str, str], ...]:
        return ((self.path, self.old, self.new), *self.more)


ISO = "tests/isolation/"
MUTATIONS = [
    # The policy's later checks (prefill and decode gates) would still reject, so the
    # mutation removes the decision itself: every request goes straight to the workers.
    Mutation("admission-decides", "admission decides before any worker hears of it (I1)",
             "services/admission/service.py",
             "                decision = self.policy.decide(req, prefills, decodes, headers)",
             "                decision = Admitted(prefill=prefills[0], decode=decodes[0])",
             (ISO + "test_admission_guards.py::"
              "test_over_capacity_prompt_is_rejected_before_any_worker_hears_of_it",)),
    Mutation("capacity-audit", "start-up audit clamps context to the real pool (I5)",
             "services/capacity.py", "    if configured_context <= pool_capacity_tokens:",
             "    if True:",
             (ISO + "test_admission_guards.py::test_capacity_audit_clamps_to_the_real_pool",)),
    Mutation("decode-gate", "decode refuses what its pool/context cannot hold",
             "services/capacity.py",
             '    """Why a decode worker cannot ever hold this request ("" when it can)."""\n',
             '    """Why a decode worker cannot ever hold this request ("" when it can)."""\n'
             '    return ""\n',
             (ISO + "test_admission_guards.py::"
              "test_admission_bypassed_the_workers_still_refuse",)),
    # Four checks stop the 1-token stub (frame token count, commit token count, commit
    # coverage, the sender's check of the ACK); the mutation removes all of them.
    Mutation("commit-verification", "commit needs the announced token count and every page "
             "(the incident's 1-token stub)", "transports/receiver.py",
             "        elif h.token_count != t.num_tokens:\n"
             "            reason, detail = Reason.LENGTH_MISMATCH, f\"{h.token_count} tokens != "
             "{t.num_tokens}\"\n"
             "        elif h.page_index != t.num_pages or len(slot.page_checksums) != "
             "t.num_pages:\n"
             "            reason = Reason.INCOMPLETE\n"
             "            detail = f\"{len(slot.page_checksums)} of {t.num_pages} pages written\"",
             "        elif False:\n            pass",
             (ISO + "test_data_plane_faults.py::"
              "test_faulty_transfer_fails_only_that_request[stub_transfer]",),
             # The sender also refuses an ACK that echoes another token count.
             # So do the per-frame token count and the sender's check of the ACK's echo.
             more=(("transports/receiver.py",
                    "        elif h.token_count != tokens_in_page(h.page_index, t.num_tokens, "
                    "t.page_tokens):\n            reason, detail = Reason.LENGTH_MISMATCH, "
                    "f\"page {h.page_index}: {h.token_count} tokens\"",
                    "        elif False:\n            pass"),
                   ("transports/core.py", "h.kind is Kind.ACK and h.reservation == key and "
                    "h.token_count == plan.num_tokens", "h.kind is Kind.ACK and "
                    "h.reservation == key"))),
    # Per-page checks and the commit digest back each other up: disable the hash itself.
    Mutation("checksum", "XXH3-64 checksums of every page (and the commit digest)",
             "transports/framing.py",
             "checksum = xxhash.xxh3_64_intdigest  # accepts any buffer",
             "checksum = lambda data: 0  # noqa  # accepts any buffer",
             (ISO + "test_data_plane_faults.py::"
              "test_faulty_transfer_fails_only_that_request[corrupt_payload]",)),
    Mutation("epoch", "frames must name the live lease's epoch",
             "transports/receiver.py",
             "        if h.epoch != t.epoch:\n            reason, detail"
             " = Reason.STALE_EPOCH, f\"epoch {h.epoch} != live {t.epoch}\"\n"
             "        elif slot.conn_id is not None",
             "        if False:\n            pass\n        elif slot.conn_id is not None",
             # The commit's own epoch check still fails a wholly stale transfer on the mesh;
             # the conformance test also asserts no stale byte touched the pages.
             ("tests/transports/test_conformance.py::test_stale_epoch",)),
    Mutation("fence", "fence: no byte lands in a lease after abort (late write)",
             "transports/receiver.py",
             "        self.fail(slot, Reason.FENCED, \"fenced by the receiver\")\n"
             "        await slot.finalized.wait()", "        return",
             (ISO + "test_late_write.py::test_late_frames_never_land_in_the_next_lease",)),
    Mutation("lease-read-check", "pool read check: owner + epoch + written length (I2)",
             "kvstore/pool.py",
             "        epochs = self._page_epoch[pages]\n        ok = epochs == lease.epoch",
             "        epochs = self._page_epoch[pages]\n        ok = epochs == epochs",
             ("tests/kvstore",)),
    # Prefill's Release and the gateway's Abort both free decode at once: remove both.
    Mutation("release-on-reject", "a rejection on one side frees the other at once (I6)",
             "services/prefill/service.py",
             "            await self.rt.publish(m.release_subject(d.ticket.decode_worker), "
             "m.Release(",
             "            if False: await self.rt.publish(m.release_subject("
             "d.ticket.decode_worker), m.Release(",
             (ISO + "test_admission_guards.py::"
              "test_asymmetric_prefill_rejection_frees_decode_within_a_second",),
             more=(("gateway/mesh.py", "            if not sub_state.finished:",
                    "            if False:"),)),
    Mutation("ticket-signature", "tickets are HMAC-signed by admission",
             "services/tickets.py",
             "        if not hmac.compare_digest(expected, ticket.signature):",
             "        if False:",
             ("tests/unit/test_tickets.py",
              ISO + "test_admission_guards.py::test_forged_ticket_is_refused_by_decode")),
    Mutation("dead-worker", "gateway ends a stream whose decode worker died",
             "gateway/generation.py",
             "            if worker and self.gw.registry.get(worker) is None:",
             "            if False:",
             (ISO + "test_worker_loss.py::test_decode_killed_mid_stream",)),
    Mutation("abort-on-disconnect", "a client that leaves aborts its request across the mesh",
             "gateway/mesh.py", "            if not sub_state.finished:", "            if False:",
             ("tests/gateway/test_gateway_disconnect.py",)),
    Mutation("prefix-salt", "prefix-cache keys are per tenant salt (I7)",
             "kvstore/prefix_cache.py",
             "        root = self._roots.get(cache_salt) if cache_salt else None",
             "        root = next(iter(self._roots.values()), None) if cache_salt else None",
             ("tests/prefix",)),
]


def run(m: Mutation) -> tuple[str, float, str]:
    originals = {path: (REPO / path).read_text() for path, _, _ in m.edits}
    mutated = dict(originals)
    for path, old, new in m.edits:
        if mutated[path].count(old) != 1:
            return "STALE", 0.0, f"snippet not found exactly once in {path}"
        mutated[path] = mutated[path].replace(old, new)
    t0 = time.monotonic()
    try:
        for path, text in mutated.items():
            (REPO / path).write_text(text)
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p",
                               "no:cacheprovider", "--timeout", "240", *m.tests], cwd=REPO,
                              capture_output=True, text=True, timeout=600)
    finally:
        for path, text in originals.items():
            (REPO / path).write_text(text)
    tail = [ln for ln in proc.stdout.splitlines() if ln.strip()][-1:]
    verdict = "LOAD-BEARING" if proc.returncode != 0 else "NOT CAUGHT"
    return verdict, time.monotonic() - t0, tail[0] if tail else ""


def main(argv: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not argv or m.name in argv]
    bad = 0
    for m in chosen:
        verdict, seconds, tail = run(m)
        bad += verdict in ("NOT CAUGHT", "STALE")
        print(f"{m.name:22} {verdict:13} {seconds:6.1f}s  {m.guard}  [{tail}]", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
