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
              "test_over_capacity_prompt_is_rejected_before_any_worker_hears_of_it",),
             # The gateway applies the same context rule before any control message: a
             # layer in front of this one, removed with it.
             more=(("gateway/app.py",
                    "            over = context_rejection(len(ids), max_tokens, "
                    "self.served_context() or 1 << 62)",
                    "            over = None"),)),
    Mutation("capacity-audit", "start-up audit clamps context to the real pool (I5)",
             "services/protocol/capacity.py", "    if configured_context <= pool_capacity_tokens:",
             "    if True:",
             (ISO + "test_admission_guards.py::test_capacity_audit_clamps_to_the_real_pool",)),
    Mutation("decode-gate", "decode refuses what its pool/context cannot hold",
             "services/protocol/capacity.py",
             '    """Why a decode worker cannot ever hold this request ("" when it can)."""\n',
             '    """Why a decode worker cannot ever hold this request ("" when it can)."""\n'
             '    return ""\n',
             (ISO + "test_admission_guards.py::"
              "test_admission_bypassed_the_workers_still_refuse",)),
    # Five checks stop the 1-token stub (frame token count, commit token count, commit
    # coverage, the commit digest over every expected page, the sender's check of the ACK);
    # the mutation removes all of them.
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
                    "h.reservation == key"),
                   # The digest covers every expected page, so a missing one fails it too.
                   ("transports/receiver.py",
                    "        elif h.payload_checksum != commit_digest("
                    "[slot.page_checksums.get(i, 0)\n",
                    "        elif False and h.payload_checksum != commit_digest("
                    "[slot.page_checksums.get(i, 0)\n"))),
    # Per-page checks and the commit digest back each other up: disable the hash itself.
    Mutation("checksum", "XXH3-64 checksums of every page (and the commit digest)",
             "transports/framing.py",
             "checksum = xxhash.xxh3_64_intdigest  # accepts any buffer",
             "checksum = lambda data: 0  # noqa  # accepts any buffer",
             (ISO + "test_data_plane_faults.py::"
              "test_faulty_transfer_fails_only_that_request[corrupt_payload]",)),
    Mutation("commit-digest", "a COMMIT commits only if its digest matches every page's "
             "checksum as landed (the only check of DEFERRED pages: ucx's)",
             "transports/receiver.py",
             "        elif h.payload_checksum != commit_digest([slot.page_checksums.get(i, 0)\n"
             "                                                   for i in range(t.num_pages)]):\n"
             "            reason, detail = Reason.BAD_CHECKSUM, \"commit digest mismatch\"",
             "        elif False:\n            pass",
             ("tests/transports/test_deferred_checksums.py::"
              "test_a_deferred_page_that_differs_from_the_senders_fails_the_commit",)),
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
             "            self.fail(slot, Reason.FENCED, \"fenced by the receiver\")\n",
             "            return\n",
             (ISO + "test_late_write.py::test_late_frames_never_land_in_the_next_lease",)),
    # A slot that already failed (deadline, duplicate connection) while a posted UCX receive
    # into its pages is still in flight: fence() must wait for that write.
    Mutation("fence-inflight", "fence waits for a failed slot's write in flight (late write)",
             "transports/receiver.py",
             "            slot = self._draining.get(key) or self._quarantined.get(key)",
             "            slot = None",
             ("tests/transports/test_fence_race.py::"
              "test_table_fence_waits_for_a_write_in_flight_of_a_failed_slot",
              "tests/transports/test_fence_race.py::"
              "test_late_payload_never_lands_in_the_next_lease")),
    Mutation("lease-read-check", "pool read check: owner + epoch + written length (I2)",
             "kvstore/pool.py",
             "            return\n        ok = epochs == lease.epoch",
             "            return\n        ok = epochs == epochs",
             ("tests/kvstore",)),
    Mutation("lease-read-check-fast", "the pool's one-comparison epoch check says yes only "
             "when every page carries the lease's epoch (I2)",
             "kvstore/pool.py",
             "        return epochs.tobytes() == KVPool._epoch_pattern(lease, len(epochs))"
             "[:epochs.nbytes]",
             "        return True",
             ("tests/kvstore",)),
    Mutation("lease-read-check-inline", "the read check's fast path passes only a lease "
             "whose every page carries its epoch (I2)",
             "kvstore/pool.py",
             "            if (epochs.tobytes() == cached[1][:8 * count]",
             "            if (True",
             ("tests/kvstore",)),
    Mutation("lease-read-check-inline-written", "the read check's fast path passes only "
             "tokens this lease wrote in this epoch (I2)",
             "kvstore/pool.py",
             "                    and num_tokens <= self._prefix_written.get(lease.lease_id, 0)):",
             "                    and True):",
             ("tests/kvstore",)),
    # A decode step checks all its requests at once (check_decode_batch): one gather of
    # every page's epoch, compared with each lease's epoch repeated.
    Mutation("decode-batch-epochs", "a decode step's batched check passes only leases whose "
             "every page read or written carries their epoch (I2)",
             "kvstore/pool.py",
             "            batch_failed = self._page_epoch[indices[0]].tobytes() != expected[0]",
             "            batch_failed = False",
             ("tests/kvstore/test_decode_batch_checks.py",),
             more=(("kvstore/pool.py",
                    "                self._page_epoch[np.concatenate(indices)].tobytes() "
                    "!= b\"\".join(expected))",
                    "                False)"),)),
    Mutation("decode-batch-written", "a decode step appends only at a lease's written "
             "length, so it reads only tokens written in this epoch (I2, the incident)",
             "kvstore/pool.py",
             "                    and written.get(lease.lease_id, -1) == position\n", "",
             ("tests/kvstore/test_decode_batch_checks.py",)),
    Mutation("decode-batch-capacity", "a decode step writes only inside the lease's pages",
             "kvstore/pool.py",
             "                    and 0 <= position < len(lease.page_ids) * size\n", "",
             ("tests/kvstore/test_decode_batch_checks.py",)),
    Mutation("decode-mark-epoch", "marking a decode step's token written checks that its "
             "page carries the lease's epoch (I2)",
             "kvstore/pool.py",
             "                if epochs[page_id] == lease.epoch "
             "and page_written[page_id] == offset:",
             "                if page_written[page_id] == offset:",
             ("tests/kvstore/test_decode_batch_checks.py",)),
    Mutation("lease-write-check", "pool write check of a decode step's one token: the page "
             "carries the lease's epoch (I2)",
             "kvstore/pool.py",
             "            if self._page_epoch[lease.page_array[first]] != lease.epoch:\n"
             "                self._check_pages(lease, first, last, shared_ok=False)\n",
             "",
             ("tests/kvstore",)),
    # Admission frees the reservation of a request whose dispatch it cannot send on the
    # reserve subject it may publish to; the old Release on prefill's subject was refused.
    Mutation("payload-cancel", "a reservation whose dispatch exceeds NATS's max_payload is "
             "freed at once under NATS auth (I6)",
             "services/admission/service.py",
             "            await self.rt.publish(m.reserve_subject(decode.worker_id), "
             "m.ReserveCancel(\n"
             "                request_id=req.request_id, nonce=ticket.nonce,\n"
             "                outcome=m.Outcome(code=m.Code.INVALID, detail=str(exc))))",
             "            await self.rt.publish(m.release_subject(decode.worker_id), m.Release(\n"
             "                request_id=req.request_id, reservation_id=res.reservation."
             "reservation_id,\n"
             "                outcome=m.Outcome(code=m.Code.INVALID, detail=str(exc))))",
             (ISO + "test_admission_payload.py",)),
    # The native decode attention reads K/V in place through each request's page table:
    # hand every request the last request's pages (a cross-request read, the incident's
    # class of bug) and the oracle tests must see it.
    Mutation("native-page-table", "native decode attention reads only the request's own "
             "pages (I3, I4)",
             "services/engine/runner.py",
             "return DecodeAttention.over_pool(tensor, self.page_tokens, self.gather, "
             "self.lengths)",
             "return DecodeAttention.over_pool(tensor, self.page_tokens, "
             "[self.gather[-1]] * len(self.gather), self.lengths)",
             ("tests/engine/test_isolation.py::"
              "test_paged_decode_logits_bits_equal_reference_alone_and_batched",
              "tests/engine/test_isolation.py::test_disaggregated_equals_reference")),
    # The native K/V append writes through raw addresses: each row's must be its own slot.
    Mutation("native-kv-append", "a decode row's K and V land in its own request's slot "
             "(I3)",
             "services/engine/runner.py",
             "np.multiply(slots, row_bytes, out=out[:, 0])",
             "np.multiply(slots[:, :1], row_bytes, out=out[:, 0])",
             ("tests/engine/test_native_pointwise.py::"
              "test_the_k_v_append_targets_are_each_rows_own_slot",
              "tests/engine/test_native_pointwise.py::"
              "test_a_decode_step_writes_only_its_rows_own_slots",
              "tests/engine/test_isolation.py::"
              "test_paged_decode_logits_bits_equal_reference_alone_and_batched")),
    Mutation("native-linear-rows", "a decode row's matmul outputs are its own row's (I4: "
             "no request gets another's values)",
             "services/engine/kernels/decode_linear.c",
             "out[(g * x_rows + b) * n + j0 + a] = sums[a * x_rows + b];",
             "out[(g * x_rows + b) * n + j0 + a] = sums[a * x_rows];",
             ("tests/engine/test_native_linear.py::"
              "test_a_rows_bits_do_not_depend_on_the_other_rows_or_threads",
              "tests/engine/test_isolation.py::"
              "test_paged_decode_logits_bits_equal_reference_alone_and_batched")),
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
             "services/protocol/tickets.py",
             "        if not hmac.compare_digest(expected, ticket.signature):",
             "        if False:",
             ("tests/protocol/test_tickets.py",
              ISO + "test_admission_guards.py::test_forged_ticket_is_refused_by_decode")),
    # The authenticated data plane, the dispatch grant, robust listeners.
    Mutation("frame-mac", "every data-plane header is MACed under the reservation's key; "
             "a frame without it changes nothing", "transports/receiver.py",
             "        if slot is not None and not mac_ok(h, slot.target.key):",
             "        if False:",
             ("tests/transports/test_auth.py::test_frames_without_the_key_change_nothing",)),
    Mutation("ack-mac", "the sender releases its pages only on an authenticated ACK",
             "transports/core.py", "                if not mac_ok(h, plan.key):",
             "                if False:",
             ("tests/transports/test_auth.py::"
              "test_sender_rejects_an_unauthenticated_ack_and_oversized_reply",)),
    Mutation("reply-bound", "a reply header cannot size an allocation on the sender",
             "transports/core.py", "        if h.kind not in (Kind.ACK, Kind.NACK):",
             "        if False:",
             ("tests/transports/test_auth.py::"
              "test_sender_rejects_an_unauthenticated_ack_and_oversized_reply",)),
    Mutation("drain-bound", "UCX drains no more than live transfers allow",
             "transports/core.py", "        if length > allowed:", "        if False:",
             ("tests/transports/test_auth.py::test_ucx_drains_no_more_than_live_transfers_allow",)),
    Mutation("dispatch-grant", "prefill refuses a dispatch whose prompt or reservation "
             "differs from what admission granted", "services/protocol/tickets.py",
             "    if not hmac.compare_digest(expected, dispatch.grant):", "    if False:",
             ("tests/protocol/test_tickets.py",)),
    Mutation("accept-loop", "the TCP accept loop survives accept errors (EMFILE)",
             "transports/tcp.py", "            except OSError as exc:\n"
             "                self.stats.accept_errors += 1",
             "            except ZeroDivisionError as exc:\n"
             "                self.stats.accept_errors += 1",
             ("tests/transports/test_listener.py::"
              "test_accept_loop_survives_running_out_of_file_descriptors",)),
    Mutation("header-timeout", "an unbound inbound link must send a header in time",
             "transports/core.py",
             "                        header = await timed(self._recv_header(link, None),\n"
             "                                             self.header_timeout_s)",
             "                        header = await self._recv_header(link, None)",
             ("tests/transports/test_listener.py::"
              "test_idle_connection_flood_is_bounded_in_count_and_time",)),
    Mutation("unbound-cap", "at most max_unbound_links unbound inbound links",
             "transports/core.py", "        if len(unbound) >= self.max_unbound_links:",
             "        if False:",
             ("tests/transports/test_listener.py::"
              "test_idle_connection_flood_is_bounded_in_count_and_time",)),
    Mutation("ready-data-plane", "a worker whose data plane cannot accept reports not ready",
             "services/runtime/worker.py",
             "        return bool(getattr(self.transport, \"accepting\", True))",
             "        return True",
             ("tests/transports/test_listener.py::"
              "test_worker_reports_not_ready_while_its_data_plane_cannot_accept",)),
    Mutation("dead-worker", "gateway ends a stream whose decode worker died",
             "gateway/generation.py",
             "            if worker and self.gw.registry.get(worker) is None:",
             "            if False:",
             (ISO + "test_worker_loss.py::test_decode_killed_mid_stream",)),
    Mutation("abort-on-disconnect", "a client that leaves aborts its request across the mesh",
             "gateway/mesh.py", "            if not sub_state.finished:", "            if False:",
             ("tests/gateway/test_disconnect.py",)),
    Mutation("prefix-salt", "prefix-cache keys are per tenant salt (I7)",
             "kvstore/prefix_cache.py",
             "        root = self._roots.get(cache_salt) if cache_salt else None",
             "        root = next(iter(self._roots.values()), None) if cache_salt else None",
             ("tests/prefix",)),
    Mutation("first-token-range", "the commit's first token is range-checked before any "
             "batch", "services/decode/service.py",
             "        if not 0 <= result.first_token < vocab:", "        if False:",
             (ISO + "test_data_plane_faults.py::"
              "test_faulty_transfer_fails_only_that_request[first_token_out_of_range]",
              ISO + "test_data_plane_faults.py::"
              "test_faulty_transfer_fails_only_that_request[first_token_negative]")),
    Mutation("tail-zero", "no earlier tenant's KV leaves prefill in a last page's tail",
             "services/prefill/service.py",
             "        pool.page_tensor(lease, n_pages - 1)[:, :, tail:].zero_()",
             "        pass", ("tests/prefill/test_tail.py",)),
    # Publishing first (as before) loses the lease when the publish raises.
    Mutation("release-before-telling", "decode frees a lease before it publishes the end",
             "services/decode/service.py",
             "        assert outcome is not None\n        self.scheduler.discard(dreq)\n",
             "        assert outcome is not None\n        await self.rt.publish("
             "m.tokens_subject(dreq.request_id), event or m.StreamFailed("
             "request_id=dreq.request_id, outcome=outcome))\n"
             "        self.scheduler.discard(dreq)\n",
             ("tests/decode/test_release_before_telling.py",)),
    Mutation("quarantine", "a lease whose fence cannot finish never returns to the free list",
             "services/decode/service.py",
             "            self.pool.quarantine(lease, outcome.label)",
             "            self.pool.release(lease, outcome.label)",
             ("tests/decode/test_release_before_telling.py::"
              "test_a_lease_whose_fence_cannot_finish_is_quarantined_not_reused",)),
    Mutation("unreachable-set-aside", "admission routes around a worker prefill cannot reach",
             "services/admission/registry.py",
             "                   if e.beat.role is role and not self.is_set_aside(e.beat, now)]",
             "                   if e.beat.role is role]",
             ("tests/admission/test_registry.py",)),
    Mutation("dev-credentials", "a production start refuses the dev secret and dev keys",
             "services/runtime/config.py", "    if found and not allowed:", "    if False:",
             ("tests/ops/test_launcher.py::test_dev_credentials_are_refused_unless_allowed",)),
    Mutation("gateway-context", "an over-context prompt is refused before any control "
             "message (no submit over NATS's max payload)", "gateway/app.py",
             "            over = context_rejection(len(ids), max_tokens, "
             "self.served_context() or 1 << 62)",
             "            over = None", ("tests/gateway/test_long_prompt.py",)),
    Mutation("nats-auth", "pdmesh up's NATS requires credentials", "services/ops/launcher.py",
             'nats_server_binary(), "-c", str(conf), "-a",', 'nats_server_binary(), "-a",',
             (ISO + "test_nats_auth.py::test_nats_refuses_a_client_without_credentials",
              ISO + "test_nats_auth.py::test_a_reader_cannot_watch_the_control_plane")),
    Mutation("nats-permissions", "each NATS identity may use only its role's subjects",
             "services/ops/natsauth.py",
             "                     f\"      permissions: {{ {', '.join(perms)} }} }}\")",
             "                     f\"      }}\")",
             (ISO + "test_nats_auth.py::test_a_reader_cannot_watch_the_control_plane",
              ISO + "test_nats_auth.py::"
              "test_the_gateway_cannot_dispatch_and_no_one_forges_a_heartbeat")),
    Mutation("route-auth", "a NATS node without the route password gets no route",
             "services/ops/natsauth.py",
             "            f\"  authorization {{ user: {json.dumps(ROUTE_USER)}, \"\n"
             "            f\"password: {json.dumps(password)} }}\\n\"\n",
             "", (ISO + "test_nats_auth.py::test_cluster_routes_need_the_route_password",)),
    Mutation("tls-first", "a service with a CA never sends its password in clear",
             "services/runtime/service.py", "tls=tls, tls_handshake_first=tls is not None,",
             "tls=tls, tls_handshake_first=False,",
             ("tests/ops/test_certs.py::test_a_service_with_a_ca_never_talks_to_nats_in_clear",)),
    Mutation("colocated-token-range", "a colocated worker rechecks token ids like prefill",
             "services/colocated/service.py",
             "        if min(d.prompt_ids) < 0 or max(d.prompt_ids) >= vocab:",
             "        if False:", ("tests/colocated/test_gate.py",)),
    Mutation("progress-liveness", "decode frees a reservation whose prefill stopped progressing",
             "services/decode/service.py",
             "            elif now - dreq.progress_at > self.cfg.prefill_stall_s:",
             "            elif False:",
             ("tests/decode/test_progress_liveness.py::"
              "test_a_reservation_without_progress_is_freed_after_the_stall_limit",)),
    Mutation("stream-read-check", "a streamed send reads a page only after the pool's read check",
             "services/prefill/service.py",
             "    pool.check_readable(lease, num_tokens)\n    if first_token is None:",
             "    if first_token is None:",
             ("tests/prefill/test_tail.py::"
              "test_a_streamed_send_gets_no_page_before_the_pool_says_it_is_written",)),
    Mutation("abort-stops-prefill", "an abort stops the prefill at the next chunk boundary",
             "services/prefill/service.py",
             "        if life.is_terminal or not job.windows:",
             "        if not job.windows:",
             ("tests/prefill/test_long_prompts.py::"
              "test_an_abort_mid_prefill_stops_it_within_a_chunk_and_frees_the_leases",),
             # The same check after each chunk's compute: removed with it.
             more=(("services/prefill/service.py",
                    "        if life.is_terminal:\n            self._stop_compute(job)\n"
                    "            return\n        if job.windows:",
                    "        if job.windows:"),)),
    Mutation("stream-pause", "a streamed transfer's link waits across a PAUSE only while "
             "its slot is live (elsewhere the progress timeout holds)",
             "transports/core.py",
             "                paused = bool(h.flags & PAUSE)",
             "                paused = False",
             ("tests/transports/test_streaming.py::"
              "test_pages_released_in_steps_arrive_and_commit_verified",
              "tests/transports/test_streaming.py::"
              "test_fence_between_chunks_stops_the_sender_and_nothing_lands_after",
              "tests/transports/test_streaming.py::"
              "test_receiver_deadline_ends_a_paused_transfer_and_tells_the_sender"),
             more=(("transports/core.py", "        paused = bool(run[-1].flags & PAUSE)",
                    "        paused = False"),)),
    Mutation("nixl-staging-copy", "nixl: a page is copied out of staging only while its "
             "transfer is live (a late one-sided write never reaches a page)",
             "transports/nixl.py",
             "        if slot.live:\n            view[:] = region.array[start:start + "
             "t.page_bytes]",
             "        if True:\n            view[:] = region.array[start:start + t.page_bytes]",
             ("tests/transports/test_fence_race.py::"
              "test_late_payload_never_lands_in_the_next_lease",)),
    Mutation("nixl-staging-retire", "nixl: a staging region is lent again only after its "
             "sender's release (its writes have ended)",
             "transports/nixl.py",
             "        if region.released:\n            self._free.append(region)",
             "        if True:\n            self._free.append(region)",
             ("tests/transports/test_nixl.py::"
              "test_a_region_is_lent_again_only_after_its_senders_release",)),
    Mutation("nixl-link-proof", "nixl: a staging region (and its NIXL metadata) is lent only "
             "to a sender that proves it holds a live reservation's key",
             "transports/nixl.py",
             "                reason, detail = self._table.vouch(h)",
             '                reason, detail = Reason.OK, ""',
             ("tests/transports/test_nixl.py::"
              "test_a_peer_without_a_live_reservations_key_gets_no_staging_region",)),
    Mutation("ucx-service-futures", "service processes run ucxx with its futures (an idle "
             "worker's posted UCX receive is not polled by the event loop)",
             "transports/__init__.py",
             '        os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")',
             "        pass",
             ("tests/isolation/test_ucx_mesh.py::"
              "test_idle_workers_do_not_spin_after_transfers[ucx]",)),
    Mutation("reserve-cancel", "a reservation admission gave up on is cancelled on that "
             "decode worker alone (a broadcast Abort also ended the request where the retry "
             "placed it)",
             "services/admission/service.py",
             "            # worker's failure event would end the client's request.)\n"
             "            await self.rt.publish(m.reserve_subject(decode.worker_id), "
             "m.ReserveCancel(\n"
             "                request_id=req.request_id, nonce=ticket.nonce,\n",
             "            # worker's failure event would end the client's request.)\n"
             "            await self.rt.publish(m.ABORT_SUBJECT, m.Abort(\n"
             "                request_id=req.request_id,\n",
             ("tests/isolation/test_worker_loss.py::"
              "test_a_decode_answering_after_the_reserve_timeout_costs_the_request_nothing",)),
    Mutation("reserve-cancel-quiet", "decode frees a cancelled reservation without a failure "
             "on the request's token stream (admission answers the client)",
             "services/decode/service.py",
             "        dreq.quiet = True\n",
             "",
             ("tests/isolation/test_worker_loss.py::"
              "test_a_decode_answering_after_the_reserve_timeout_costs_the_request_nothing",)),
    Mutation("ucx-error-mode", "UCX endpoints without peer error handling only where every "
             "transport survives a lost peer (on InfiniBand an unhandled error can abort "
             "the process)",
             "transports/ucx.py",
             '    return "none" if active and active <= _NO_ERRH_SAFE else "peer"',
             '    return "none"',
             ("tests/transports/test_ucx_error_mode.py::"
              "test_auto_is_none_only_where_every_ucx_transport_survives_a_lost_peer",)),
    Mutation("loop-turns", "a receiver gives its event loop turns even when the link always "
             "has the next bytes (decode's streams and fence() are not held for a whole "
             "transfer)",
             "transports/core.py",
             "                await turns.take()  # a link that is always full must not "
             "hold the loop\n",
             "",
             ("tests/transports/test_loop_turns.py::"
              "test_a_receiver_whose_link_is_always_full_gives_the_loop_turns",)),
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
