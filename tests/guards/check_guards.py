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
    name: str
    guard: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


ISO = "tests/isolation/"
MUTATIONS = [
    Mutation("admission-context", "admission rejects prompt+max_tokens > live context (I1)",
             "services/admission/policy.py", "    if total > context:", "    if False:",
             (ISO + "test_admission_guards.py::"
              "test_over_capacity_prompt_is_rejected_before_any_worker_hears_of_it",)),
    Mutation("capacity-audit", "start-up audit clamps context to the real pool (I5)",
             "services/capacity.py", "    if configured_context <= pool_capacity_tokens:",
             "    if True:",
             (ISO + "test_admission_guards.py::test_capacity_audit_clamps_to_the_real_pool",)),
    Mutation("decode-gate", "decode refuses what its pool/context cannot hold",
             "services/capacity.py", '    if total > served_context:\n        return f"',
             '    if False:\n        return f"',
             (ISO + "test_admission_guards.py::"
              "test_admission_bypassed_the_workers_still_refuse",)),
    Mutation("commit-length", "receiver commits only the announced token count (incident stub)",
             "transports/receiver.py", "        elif h.token_count != t.num_tokens:",
             "        elif False:",
             (ISO + "test_data_plane_faults.py::"
              "test_faulty_transfer_fails_only_that_request[stub_transfer]",)),
    Mutation("commit-coverage", "receiver commits only when every page arrived",
             "transports/receiver.py",
             "        elif h.page_index != t.num_pages or len(slot.page_checksums) != t.num_pages:",
             "        elif False:",
             (ISO + "test_data_plane_faults.py::"
              "test_faulty_transfer_fails_only_that_request[commit_first]",
              ISO + "test_data_plane_faults.py::"
              "test_faulty_transfer_fails_only_that_request[drop_frame]")),
    Mutation("payload-checksum", "xxh3 payload checksum per page",
             "transports/receiver.py", "        if actual != h.payload_checksum:",
             "        if False:",
             (ISO + "test_data_plane_faults.py::"
              "test_faulty_transfer_fails_only_that_request[corrupt_payload]",)),
    Mutation("epoch", "frames must name the live lease's epoch",
             "transports/receiver.py", "        if h.epoch != t.epoch:\n            reason, detail"
             " = Reason.STALE_EPOCH, f\"epoch {h.epoch} != live {t.epoch}\"\n        elif slot.conn_id"
             " is not None", "        if False:\n            pass\n        elif slot.conn_id is not None",
             # The commit's own epoch check still fails a wholly stale transfer on the mesh;
             # the conformance test also asserts no stale byte touched the pages.
             ("tests/transports/test_conformance.py::test_stale_epoch",)),
    Mutation("fence", "fence: no byte lands in a lease after abort (late write)",
             "transports/receiver.py",
             "        self.fail(slot, Reason.FENCED, \"fenced by the receiver\")\n"
             "        await slot.finalized.wait()", "        return",
             (ISO + "test_late_write.py::test_late_frames_never_land_in_the_next_lease",)),
    Mutation("lease-read-check", "pool read check: owner + epoch + written length (I2)",
             "kvstore/pool.py", "        epochs = self._page_epoch[pages]\n        ok = epochs == lease.epoch",
             "        epochs = self._page_epoch[pages]\n        ok = epochs == epochs",
             ("tests/kvstore",)),
    Mutation("release-on-reject", "prefill's rejection frees decode at once (I6)",
             "services/prefill/service.py",
             "        await self.rt.publish(m.release_subject(d.ticket.decode_worker), m.Release(",
             "        if False: await self.rt.publish(m.release_subject(d.ticket.decode_worker), "
             "m.Release(",
             (ISO + "test_admission_guards.py::"
              "test_asymmetric_prefill_rejection_frees_decode_within_a_second",)),
    Mutation("ticket-signature", "tickets are HMAC-signed by admission",
             "services/tickets.py", "        if not hmac.compare_digest(expected, ticket.signature):",
             "        if False:",
             ("tests/unit/test_tickets.py",
              ISO + "test_admission_guards.py::test_forged_ticket_is_refused_by_decode")),
    Mutation("dead-worker", "gateway ends a stream whose decode worker died",
             "gateway/generation.py", "            if worker and self.gw.registry.get(worker) is None:",
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
    path = REPO / m.path
    original = path.read_text()
    if original.count(m.old) != 1:
        return "STALE", 0.0, f"snippet not found exactly once in {m.path}"
    t0 = time.monotonic()
    try:
        path.write_text(original.replace(m.old, m.new))
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p",
                               "no:cacheprovider", "--timeout", "240", *m.tests], cwd=REPO,
                              capture_output=True, text=True, timeout=600)
    finally:
        path.write_text(original)
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
