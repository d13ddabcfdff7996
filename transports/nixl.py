"""NIXL data plane: page bytes by one-sided NIXL WRITE, everything else over a TCP link.

NIXL (`nixl-cu12` / `nixl-cu13`, `import nixl_cu12` / `nixl_cu13`, whichever is installed:
_nixl_build.py; the KV-transfer library of vLLM, SGLang and Dynamo) moves bytes by
one-sided RDMA-style WRITE (over its bundled UCX) into memory the target registered. A
one-sided write cannot be refused by the receiver, so the sender never gets the address of
a page. The receiver lends each inbound link a *staging region* of its
own (`staging_bytes`, registered with its NIXL agent); the sender writes page i into slot
i % (staging_bytes // page_bytes) of it and then sends, on the TCP link, the page's DATA
header and an 8-byte LANDED token. The receiver runs every check of the TCP transport on
the header (`ReceiveTable`: MAC, epoch, order, page id, length; core.py's loop), reads the
token, then itself copies the slot into the page, synchronously re-checking that the slot
is live right before the copy (as TCP re-checks before every `recv_into`), and checksums
the page it copied (`data_done`); the commit is verified as for TCP. A late NIXL write
therefore lands in staging only, never in a page: `fence()` returns at once, as on TCP.
When a transfer needs more slots than the region has, the receiver returns credits (an ACK
header with `aux` -1 and `page_index` = pages copied) and the sender writes slot k again
only after the page that used it was copied.

A region is lent on a link proof (below), one region per proof: a later link proving the
same reservation (id and epoch) is lent that same region, taken back from its retired
state or from the older link holding it (which ends), so a sender that reopens its link
gets the region again and links proving one reservation over and over hold one region
between them. A region is not lent on another proof while a write into it may still come:
when its link ends it is *retired* and becomes free again when the sender's NIXL
notification `pdmesh-nixl-release:<token>` arrives, which the sender sends once every
write it posted into that region has completed (or failed); a sender that never sends it
(crashed, partitioned) leaves the region retired (`staging_retired`) for `retired_s`, after
which it may be lent again: a late WRITE of that sender then lands in staging only, and
one that lands in a slot before the receiver copied it fails that page's checksum (the
transfer fails, the page is poisoned). Measured here: a NIXL/UCX write into memory the
receiver had already deregistered still lands (`UCX_TLS=tcp`), so deregistering is no
fence.

Link set-up, before the first frame (the receiver bounds it like a header): the sender sends
`PDNXHI02`, its agent name (u16 length + bytes); the receiver answers `PDNXCH01` and an
8-byte nonce; the sender answers with a *link proof*: an ACK-kind header (`aux` -2) for the
reservation it is about to send, the nonce in its `payload_checksum`, MACed under that
reservation's key. The receiver checks it against its live expectations (`ReceiveTable.
vouch`): only then does it answer `PDNXOK01`, its partial NIXL metadata for the region (u32
length + bytes), the region's address and length (u64 each) and a 16-byte release token,
or `PDNXNO01` + a reason when it has no region to lend (`max_staging` regions exist and
none is free): that send fails with `PeerUnreachable` (PEER_LOST, `unreachable`: a
receiver to route around, as one that cannot be connected to), and while no region can be
lent `accepting` is False (the worker reports not ready). A proof that fails is answered
`PDNXNR01` + the reason (u16: UNAUTHENTICATED, UNKNOWN_RESERVATION or why it ended,
BAD_HEADER for a wrong nonce) + a detail, and the link ends: whoever cannot prove a live
reservation's key never learns where a region is nor gets the metadata to WRITE into it (a
write cannot be refused, and XXH3 page checksums are not collision-resistant, so a
region's holder must be a proven sender).
The sender bounds the set-up as a whole by max(2 x `progress_timeout_s`, 1.5 s), and the
link's first WRITE by the same (UCX connects to the receiver's agent then: 21 ms median
here, against 0.05-0.5 ms for later WRITEs, which get `progress_timeout_s`).
A pooled link keeps its region for later reservations. Everything else (frames, replies,
framing, receive table, idle-link pool, fault hook) is the TCP transport's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import importlib
import logging
import os
import secrets
import struct
import sys
import time
import uuid
from collections.abc import Sequence

import numpy as np

from ._nixl_build import INSTALL_HINT, NIXL_MODULES, nixl_module
from ._sock import RawSocket, StalledError
from .base import EventCallback, PagesReady, PeerUnreachable, TransferAck, TransferPlan
from .core import Cut, Frame, FrameFilter, LoopTurns, reason_of
from .errors import FrameError, Reason, TransferError
from .framing import (
    HEADER_SIZE,
    FrameHeader,
    Kind,
    decode_header,
    encode_header,
    reservation_bytes,
)
from .receiver import Slot
from .tcp import TcpTransport

log = logging.getLogger(__name__)

nixl_import_error: Exception | None = None
NIXL_MODULE = nixl_module()  # the NIXL build in use (None: none is installed)
try:
    if NIXL_MODULE is None:
        raise ImportError(f"none of {', '.join(NIXL_MODULES)} is installed ({INSTALL_HINT})")
    _nixl = importlib.import_module(NIXL_MODULE)
    nixl_agent, nixl_agent_config = _nixl.nixl_agent, _nixl.nixl_agent_config
except ImportError as exc:  # pragma: no cover - depends on the install
    nixl_agent = nixl_agent_config = None
    nixl_import_error = exc
else:
    # NIXL logs INFO lines to stdout (where our tools print JSON and addresses): warnings
    # and up only, to stderr, unless NIXL_LOG_LEVEL asks for more.
    _nixl_log = logging.getLogger("nixl")
    if not os.environ.get("NIXL_LOG_LEVEL"):
        _nixl_log.setLevel(logging.WARNING)
    for _handler in _nixl_log.handlers:
        if isinstance(_handler, logging.StreamHandler) and _handler.stream is sys.stdout:
            _handler.setStream(sys.stderr)

_HELLO = b"PDNXHI02"
_CHALLENGE = b"PDNXCH01"  # + 8-byte nonce: prove you hold a live reservation's key
_REFUSED = b"PDNXNR01"  # + u16 reason + u16 length + detail: the proof did not hold
_OK = b"PDNXOK01"
_NO = b"PDNXNO01"
HELLO_AUX = -2  # `aux` of a link proof (an ACK-kind header, never a receiver's frame)
_TOKEN = struct.Struct("<4sI")  # b"NXLD", page index: the page's bytes are in staging
_TOKEN_MAGIC = b"NXLD"
_RELEASE = b"pdmesh-nixl-release:"
_MAX_METADATA = 1 << 20  # the most metadata bytes a sender accepts in a reply
CREDIT_AUX = -1  # `aux` of a credit (an ACK-kind header): not the transfer's final ACK
_GROUP_BYTES = 4 << 20  # pages written by one NIXL request (headers follow each request)
# NIXL's own progress thread spins (measured: 0.65 CPU s per idle second), so the transport
# drives progress itself (one call: ~3 us): every _BUSY_POLL_S while NIXL traffic is
# expected (a link was used within _BUSY_S), every _LINKED_POLL_S while links are open (a
# sender may start writing on an idle link), else every _IDLE_POLL_S (release
# notifications); asyncio's epoll wait rounds sleeps up to 1 ms unless other I/O wakes
# the loop. Over UCX's TCP transport a WRITE needs the target's progress to land.
_BUSY_POLL_S, _LINKED_POLL_S, _IDLE_POLL_S, _BUSY_S = 0.0002, 0.001, 0.02, 0.1
_SPIN_S = 0.002  # a sender re-checks a WRITE without sleeping for this long
_NEVER_FREED: list = []  # staging regions of closed transports that were never released


# UCX modules NIXL's UCX does not load unless the operator sets UCX_MODULES: the wheel's
# EFA transport module (`libuct_ib_efa`) links the system's libibverbs.so.1, which loads the
# system's libnl-route-3 beside the copy bundled with the wheel; at exit the two copies'
# destructors unregister each other's entries and the process dies with SIGSEGV
# (`rtnl_tc_unregister`), on any host with Debian's libibverbs1, RDMA device or not. EFA
# (AWS) hosts that want it set UCX_MODULES themselves.
NIXL_UCX_MODULES = "^efa"


@contextlib.contextmanager
def nixl_ucx_env():
    """The environment NIXL's UCX context is created with, restored afterwards.

    Hides the UCX settings ucxx's import injected (when ucxx was loaded in this process,
    by the ucx transport or by anything else: `ucx.UCXX_ENV`), so NIXL runs on UCX's own
    defaults or the operator's settings (measured: ucxx's UCX_RNDV_THRESH=8192 turns a NIXL
    WRITE between processes from zero-copy CMA, ~10 GB/s, into software emulation over
    tcp/lo, ~1 GB/s), and sets UCX_MODULES to NIXL_UCX_MODULES unless the operator set it."""
    injected: dict[str, str] = {}
    if "ucxx" in sys.modules:  # (else nothing was injected: leave ucxx unloaded)
        from .ucx import UCXX_ENV
        injected = dict(UCXX_ENV)
    hidden = {k: os.environ.pop(k) for k, v in injected.items() if os.environ.get(k) == v}
    added = "UCX_MODULES" not in os.environ
    if added:
        os.environ["UCX_MODULES"] = NIXL_UCX_MODULES
    try:
        yield
    finally:
        if added:
            os.environ.pop("UCX_MODULES", None)
        os.environ.update(hidden)


@dataclasses.dataclass(eq=False)
class _Region:
    """A receiver's staging region: lent to one inbound link at a time."""

    array: np.ndarray
    reg: object  # NIXL registration descriptors
    token: bytes = b""
    owner: str = ""  # the agent name of the sender it is lent to
    released: bool = False  # the owner said no write of its can still land
    proof: tuple[bytes, int] = (b"", 0)  # (reservation, epoch) of the link set-up it was lent on
    retired_at: float = 0.0  # when its last link ended without a release (monotonic)


@dataclasses.dataclass(eq=False)
class _Outbound:
    """A sender's view of one link: where its writes go, and what is still in flight."""

    remote: bytes  # the receiver's agent name
    address: int
    length: int
    token: bytes
    rid: str = ""  # the reservation of the transfer on the link now (for errors)
    credit: int = 0  # pages of the current transfer the receiver has copied out
    credited: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    # posted NIXL requests: (handle, registration, source arrays kept alive, frames)
    posted: collections.deque = dataclasses.field(default_factory=collections.deque)
    # Whether a WRITE on this link has completed: UCX connects to the receiver's agent at
    # the link's first WRITE, which therefore gets the set-up bound (`_setup_s`).
    connected: bool = False


class NixlTransport(TcpTransport):
    """KVTransport with page bytes moved by NIXL WRITE into receiver-owned staging; see the
    module docstring. Options: `staging_bytes` (one region, lent per inbound link; a page
    must fit), `max_staging` (regions that may exist at once), `quarantine_s` (how long the
    sender waits for a posted write to end before it gives the region up as unknown),
    `retired_s` (how long a region whose sender never released it stays retired before it
    may be lent again)."""

    scheme = "nixl"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 progress_timeout_s: float = 0.75, staging_bytes: int = 64 << 20,
                 max_staging: int = 32, quarantine_s: float = 5.0, retired_s: float = 60.0,
                 on_event: EventCallback | None = None,
                 frame_filter: FrameFilter | None = None) -> None:
        if nixl_agent is None:
            raise RuntimeError(f"nixl transport unavailable: {nixl_import_error}")
        if staging_bytes <= 0 or max_staging <= 0:
            raise ValueError("staging_bytes and max_staging must be positive")
        if retired_s <= 0:
            raise ValueError("retired_s must be positive")
        self._listening = True  # (the `accepting` of TcpTransport: the listener accepts)
        super().__init__(host, port, progress_timeout_s=progress_timeout_s,
                         on_event=on_event, frame_filter=frame_filter)
        self.staging_bytes = staging_bytes
        self.max_staging = max_staging
        self.quarantine_s = quarantine_s
        self.retired_s = retired_s
        self.name = f"pdmesh-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._agent = None
        self._free: list[_Region] = []
        self._lent: dict[RawSocket, _Region] = {}  # inbound link -> its region
        self._retired: dict[bytes, _Region] = {}  # token -> region waiting for a release
        # (reservation, epoch) of a link proof -> the one region lent on it (lent or retired)
        self._proofs: dict[tuple[bytes, int], _Region] = {}
        self._regions = 0
        self._out: dict[RawSocket, _Outbound] = {}  # outbound link -> its staging
        self._busy_until = 0.0  # progress NIXL often until then (monotonic)
        self._proving: dict[str, tuple[int, bytes]] = {}  # rid -> (epoch, key) of a send

    @property
    def staging_retired(self) -> int:
        """Regions whose last link ended without the sender's release (not lent meanwhile)."""
        return len(self._retired)

    @property
    def accepting(self) -> bool:
        """Whether a new sender can be served: the listener accepts (TcpTransport) and a
        staging region can be lent to a link proving a reservation not lent one yet. The
        worker reports not ready while this is False, so no transfer is routed here."""
        return self._listening and self._can_lend()  # guard: nixl-staging-ready

    @accepting.setter
    def accepting(self, value: bool) -> None:
        self._listening = value

    async def start(self) -> str:
        if self._agent is None:
            with nixl_ucx_env():
                self._agent = nixl_agent(self.name, nixl_agent_config(
                    enable_prog_thread=False, backends=["UCX"]))
            if "UCX" not in self._agent.backends:
                raise RuntimeError("nixl transport: NIXL's UCX backend did not start")
            self._spawn(self._progress())
        await super().start()
        self.address = f"nixl://{self.host}:{self.port}"
        return self.address

    # -- receiver: staging regions -------------------------------------------------------
    def _can_lend(self) -> bool:
        """A region is free, may still be made, or was retired `retired_s` ago."""
        return bool(self._free or self._regions < self.max_staging or self._expired())

    def _expired(self) -> _Region | None:
        """The region retired longest ago, if that was `retired_s` ago or more."""
        oldest = min(self._retired.values(), key=lambda r: r.retired_at, default=None)
        if oldest is not None and time.monotonic() - oldest.retired_at >= self.retired_s:
            return oldest
        return None

    def _lend(self, owner: str, proof: tuple[bytes, int]) -> _Region | None:
        """A region for a link whose set-up proved `proof` (reservation, epoch). One region
        per proof: the region already lent on it is lent again (taken back from its
        retired state, or from the older link holding it, which ends), so links proving
        one reservation over and over hold one region between them. Else a free region, a
        new one (up to `max_staging`), or the region retired longest ago once `retired_s`
        passed (a late WRITE of its former sender can then land only in staging, where
        the copy's page checksum fails the transfer it disturbs); None when none is."""
        held = self._proofs.get(proof)
        if held is not None and self._take_back(held):  # guard: nixl-staging-per-reservation
            region = held
        else:
            region = self._spare()
            if region is None:
                return None
            self._forget(region)
            region.proof = proof
            self._proofs[proof] = region
        region.token, region.owner, region.released = secrets.token_bytes(16), owner, False
        return region

    def _spare(self) -> _Region | None:
        if self._free:
            return self._free.pop()
        if self._regions < self.max_staging:
            array = np.zeros(self.staging_bytes, np.uint8)
            reg = self._agent.register_memory([(array.ctypes.data, array.nbytes, 0, "")],
                                              "DRAM")
            self._regions += 1
            return _Region(array, reg)
        region = self._expired()
        if region is not None:
            del self._retired[region.token]
            log.warning("nixl: staging region of %s not released within %ss; lent again",
                        region.owner, self.retired_s)
        return region

    def _take_back(self, region: _Region) -> bool:
        """Detach `region` (lent on a proof being made again) from its retired state or from
        the link holding it, whose serving task is cancelled (the link ends). False when
        that link now carries another reservation (the proof's transfer ended there)."""
        if self._retired.get(region.token) is region:
            del self._retired[region.token]
            return True
        link = next((c for c, r in self._lent.items() if r is region), None)
        if link is None:
            return False
        conn_id = next((i for i, c in self._links.items() if c is link), None)
        slot = self._table.bound_slot(conn_id) if conn_id is not None else None
        if slot is not None and slot.key != region.proof[0]:
            return False
        del self._lent[link]  # its end retires nothing: the region is lent on
        task = self._link_tasks.get(conn_id) if conn_id is not None else None
        if task is not None:  # (else its task was cancelled already: it is ending)
            task.cancel()  # its `finally` fails what it carried and closes it
        return True

    def _forget(self, region: _Region) -> None:
        """The region is no longer the one lent on its proof."""
        if self._proofs.get(region.proof) is region:
            del self._proofs[region.proof]

    def _retire(self, region: _Region) -> None:
        if region.released:  # guard: nixl-staging-retire
            self._forget(region)
            self._free.append(region)
        else:
            region.retired_at = time.monotonic()
            self._retired[region.token] = region

    def _busy(self) -> None:
        self._busy_until = time.monotonic() + _BUSY_S

    async def _progress(self) -> None:
        """Drives NIXL (its progress thread is off): lets WRITEs into our staging land and
        frees retired regions as their senders' release notifications arrive."""
        while True:
            try:
                notifs = self._agent.get_new_notifs()
            except Exception:  # keep driving: a lost peer shows on its link
                log.exception("nixl: progress failed")
                notifs = {}
            for sender, messages in notifs.items():
                for message in messages:
                    self._released(sender, message)
            if time.monotonic() < self._busy_until:
                await asyncio.sleep(_BUSY_POLL_S)
            else:
                await asyncio.sleep(_LINKED_POLL_S if self._lent or self._out else _IDLE_POLL_S)

    def _released(self, sender: str, message: bytes) -> None:
        if not message.startswith(_RELEASE):
            return
        token = message[len(_RELEASE):]
        region = self._retired.get(token)
        if region is not None and region.owner == sender:
            del self._retired[token]
            self._forget(region)
            self._free.append(region)
            return
        for region in self._lent.values():  # released before the link's end was seen
            if region.token == token and region.owner == sender:
                region.released = True

    async def _greet(self, conn: RawSocket) -> None:
        """The link's set-up (receiver side): the sender proves it holds the key of a live
        reservation (a header MACed under it, over our nonce), then it is lent a staging
        region. Nobody else learns where the region is or gets its NIXL metadata: a
        one-sided write cannot be refused, so only a proven sender may ever hold them."""
        head = bytearray(len(_HELLO) + 2)
        await conn.recv_exact(memoryview(head), None)
        if bytes(head[:len(_HELLO)]) != _HELLO:
            raise ConnectionAbortedError("not a nixl link (bad hello)")
        (size,) = struct.unpack_from("<H", head, len(_HELLO))
        name = bytearray(size)
        await conn.recv_exact(memoryview(name), self.progress_timeout_s)
        nonce = secrets.token_bytes(8)
        await conn.send_all([_CHALLENGE, nonce], self.progress_timeout_s)
        proof = bytearray(HEADER_SIZE)
        await conn.recv_exact(memoryview(proof), self.progress_timeout_s)
        try:
            h = decode_header(proof)
        except FrameError as exc:
            h, reason, detail = None, Reason.BAD_HEADER, f"link proof: {exc.detail}"
        if h is not None:
            if (h.kind is not Kind.ACK or h.aux != HELLO_AUX
                    or h.payload_checksum != int.from_bytes(nonce, "little")):
                reason, detail = Reason.BAD_HEADER, "not a link proof for this challenge"
            else:
                reason, detail = self._table.vouch(h)  # guard: nixl-link-proof
        if reason is not Reason.OK:
            self.stats.frames_rejected[reason] += 1
            data = detail.encode()[:1024]
            await conn.send_all([_REFUSED, struct.pack("<HH", int(reason), len(data)), data],
                                self.progress_timeout_s)
            raise ConnectionRefusedError(f"nixl link refused: {reason.name}: {detail}")
        self._busy()
        try:
            region = self._lend(name.decode(errors="replace"), (h.reservation, h.epoch))
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own error types
            raise ConnectionAbortedError(f"no staging region: {exc!r}") from None
        if region is None:
            detail = f"all {self.max_staging} staging regions are in use or retired".encode()
            await conn.send_all([_NO, struct.pack("<H", len(detail)), detail],
                                self.progress_timeout_s)
            raise ConnectionRefusedError("no staging region to lend")
        self._lent[conn] = region  # from here on, the link's end retires the region
        try:
            md = self._agent.get_partial_agent_metadata(region.reg, True, [])
        except Exception as exc:  # noqa: BLE001
            raise ConnectionAbortedError(f"no NIXL metadata: {exc!r}") from None
        await conn.send_all([_OK, struct.pack("<I", len(md)), md,
                             struct.pack("<QQ", region.array.ctypes.data, region.array.nbytes),
                             region.token], self.progress_timeout_s)

    async def _recv_header(self, conn: RawSocket, progress_s: float | None,
                           idle: bool = False) -> bytes | None:
        if conn not in self._lent:
            await self._greet(conn)  # under the caller's header timeout (unbound link)
        self._busy()  # a sender on this link may be writing its next pages now
        header = await super()._recv_header(conn, progress_s, idle=idle)
        self._busy()
        return header

    async def _recv_token(self, conn: RawSocket, h: FrameHeader) -> None:
        token = bytearray(_TOKEN.size)
        await conn.recv_exact(memoryview(token), self.progress_timeout_s)
        if _TOKEN.unpack(token) != (_TOKEN_MAGIC, h.page_index):
            raise ConnectionAbortedError(f"bad LANDED token for page {h.page_index}")

    async def _drain(self, conn: RawSocket, length: int) -> None:
        # A rejected DATA frame: its bytes (if any) are in staging, never looked at.
        token = bytearray(_TOKEN.size)
        await conn.recv_exact(memoryview(token), self.progress_timeout_s)
        self.stats.bytes_drained += length

    async def _recv_page(self, conn: RawSocket, slot: Slot, h: FrameHeader) -> None:
        region = self._lent[conn]
        t = slot.target
        slots = region.array.nbytes // t.page_bytes
        view = slot.dest(h)  # counts as touched (poisoned on failure), as TCP's
        await self._recv_token(conn, h)
        if slots == 0:
            raise ConnectionAbortedError(f"page of {t.page_bytes} bytes, staging "
                                         f"{region.array.nbytes}")
        start = (h.page_index % slots) * t.page_bytes
        # Synchronous from this check to the end of the copy: a fence cannot slip in.
        if slot.live:  # guard: nixl-staging-copy
            view[:] = region.array[start:start + t.page_bytes]
        if t.num_pages > slots and slot.live and h.page_index + 1 < t.num_pages:
            # The sender may reuse this page's slot now.
            credit = encode_header(Kind.ACK, h.reservation, h.epoch, page_index=h.page_index + 1,
                                   aux=CREDIT_AUX, key=t.key)
            await conn.send_all([credit], self.progress_timeout_s)

    def _discard(self, conn: RawSocket) -> None:
        conn.close()
        region = self._lent.pop(conn, None)
        if region is not None:
            self._retire(region)
        out = self._out.pop(conn, None)
        if out is not None:
            if out.posted and not self._closed:
                self._spawn(self._release_after_writes(out))
            elif not out.posted:
                self._release(out)

    # -- sender ------------------------------------------------------------------------
    async def _open(self, address: str, rid: str) -> RawSocket:
        conn = await super()._open(address, rid)
        try:
            # Bounded as a whole, like UCX's connect (a frozen receiver fails the send).
            out = await asyncio.wait_for(self._hello(conn, rid, address), self._setup_s())
        except TransferError:
            conn.close()
            raise
        except (OSError, EOFError, ValueError, RuntimeError, TimeoutError) as exc:
            conn.close()
            raise TransferError(rid, Reason.PEER_LOST,
                                f"nixl set-up with {address}: {exc!r}") from None
        self._out[conn] = out
        return conn

    async def send(self, address: str, plan: TransferPlan, page_buffers: Sequence[memoryview],
                   ready: PagesReady | None = None) -> TransferAck:
        # The link set-up of this send (if it opens a link) proves the plan's key.
        self._proving[plan.reservation_id] = (plan.epoch, plan.key)
        try:
            return await super().send(address, plan, page_buffers, ready)
        finally:
            self._proving.pop(plan.reservation_id, None)

    def _setup_s(self) -> float:
        """The bound of a link's set-up: the hello, and the link's first WRITE (UCX
        connects then; measured here: 21 ms median against 0.05-0.5 ms for later WRITEs)."""
        return max(2 * self.progress_timeout_s, 1.5)

    async def _hello(self, conn: RawSocket, rid: str, address: str = "") -> _Outbound:
        """The link's set-up (sender side; the caller bounds it as a whole). A receiver with
        no staging region to lend fails the send with PeerUnreachable (`unreachable`: the
        caller routes around that receiver as around one it cannot connect to)."""
        self._busy()
        name = self.name.encode()
        await conn.send_all([_HELLO, struct.pack("<H", len(name)), name], None)
        head = bytearray(len(_OK))
        await conn.recv_exact(memoryview(head), None)
        if bytes(head) == _CHALLENGE:
            nonce = bytearray(8)
            await conn.recv_exact(memoryview(nonce), None)
            epoch, key = self._proving.get(rid, (0, b""))
            await conn.send_all([encode_header(
                Kind.ACK, reservation_bytes(rid), epoch, aux=HELLO_AUX,
                payload_checksum=int.from_bytes(nonce, "little"), key=key)], None)
            await conn.recv_exact(memoryview(head), None)
        if bytes(head) == _REFUSED:
            code = bytearray(4)
            await conn.recv_exact(memoryview(code), None)
            reason, size = struct.unpack("<HH", code)
            detail = bytearray(size)
            await conn.recv_exact(memoryview(detail), None)
            raise TransferError(rid, reason_of(reason),
                                f"nixl link refused: {detail.decode(errors='replace')}")
        if bytes(head) == _NO:
            size = bytearray(2)
            await conn.recv_exact(memoryview(size), None)
            detail = bytearray(struct.unpack("<H", size)[0])
            await conn.recv_exact(memoryview(detail), None)
            raise PeerUnreachable(  # guard: nixl-refusal-unreachable
                rid, Reason.PEER_LOST, f"nixl set-up with {address}: no staging region: "
                f"{detail.decode(errors='replace')}")
        if bytes(head) != _OK:
            raise ConnectionAbortedError("not a nixl receiver (bad reply to hello)")
        size = bytearray(4)
        await conn.recv_exact(memoryview(size), None)
        (md_len,) = struct.unpack("<I", size)
        if md_len > _MAX_METADATA:
            raise ConnectionAbortedError(f"{md_len} bytes of NIXL metadata")
        md = bytearray(md_len)
        await conn.recv_exact(memoryview(md), None)
        tail = bytearray(16 + 16)
        await conn.recv_exact(memoryview(tail), None)
        address, length = struct.unpack_from("<QQ", tail)
        try:
            remote = self._agent.add_remote_agent(bytes(md))
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own error types
            raise ConnectionAbortedError(f"NIXL metadata refused: {exc!r}") from None
        return _Outbound(remote, address, length, bytes(tail[16:]))

    async def _read_reply(self, link: RawSocket) -> tuple[FrameHeader, str]:
        """The receiver's final reply; credits before it move the sender's window."""
        out = self._out.get(link)
        while True:
            h, detail = await super()._read_reply(link)
            if h.kind is Kind.ACK and h.aux == CREDIT_AUX and h.token_count == 0:
                if out is not None and h.page_index > out.credit:
                    out.credit = h.page_index
                    out.credited.set()
                continue
            return h, detail

    def _slots(self, out: _Outbound, frame: Frame) -> int:
        """Staging slots for this transfer's pages (TransferError when a page is too big)."""
        if frame.header:
            with contextlib.suppress(FrameError):  # (a fault may have corrupted it)
                out.rid = str(uuid.UUID(bytes=decode_header(frame.header).reservation))
        page_bytes = len(frame.payload)
        slots = out.length // page_bytes
        if slots == 0:
            raise TransferError(out.rid, Reason.INVALID_PLAN,
                                f"page of {page_bytes} bytes does not fit the receiver's "
                                f"staging region of {out.length} bytes")
        return slots

    def _post(self, out: _Outbound, sources: list, slots_at: list[int], page_bytes: int,
              frames: list) -> None:
        """One NIXL WRITE of `sources` (byte views) into staging slots `slots_at`."""
        arrays = [np.frombuffer(s, np.uint8) for s in sources]
        local = np.array([(a.ctypes.data, a.nbytes, 0) for a in arrays], dtype=np.uint64)
        remote = np.array([(out.address + k * page_bytes, a.nbytes, 0)
                           for a, k in zip(arrays, slots_at, strict=True)], dtype=np.uint64)
        agent = self._agent
        try:
            reg = agent.register_memory(local, "DRAM")
        except Exception as exc:  # noqa: BLE001
            raise ConnectionError(f"NIXL cannot register the pages: {exc!r}") from None
        try:
            handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, "DRAM"),
                                           agent.get_xfer_descs(remote, "DRAM"), out.remote)
            state = agent.transfer(handle)
        except Exception as exc:  # noqa: BLE001
            agent.deregister_memory(reg)
            raise ConnectionError(f"NIXL WRITE not posted: {exc!r}") from None
        out.posted.append((handle, reg, arrays, frames))
        if state == "ERR":
            raise ConnectionError("NIXL WRITE failed")

    async def _written(self, out: _Outbound, wait_s: float) -> list:
        """Wait for the oldest posted WRITE to complete (at most `wait_s`); returns its
        frames. StalledError when it did not, ConnectionError when it failed."""
        handle, reg, _arrays, frames = out.posted[0]
        if not out.connected:  # the link's first WRITE: UCX connects first
            wait_s = max(wait_s, self._setup_s())
        self._busy()
        loop = asyncio.get_running_loop()
        started = loop.time()
        while True:
            state = self._agent.check_xfer_state(handle)
            if state == "DONE":
                break
            if state == "ERR":
                raise ConnectionError("NIXL WRITE failed")
            waited = loop.time() - started
            if waited > wait_s:
                raise StalledError(f"NIXL WRITE not complete within {wait_s}s")
            # Yield only (a page lands in well under 2 ms), then sleep: any sleep is ~1 ms.
            await asyncio.sleep(0 if waited < _SPIN_S else 0.0002)
        out.posted.popleft()
        out.connected = True
        self._agent.release_xfer_handle(handle)
        self._agent.deregister_memory(reg)
        return frames

    async def _landed(self, conn: RawSocket, out: _Outbound, wait: bool) -> None:
        """Send the headers and LANDED tokens of completed WRITEs, oldest first (waiting for
        the oldest when `wait`)."""
        batch: list[bytes | memoryview] = []
        while out.posted:
            if not wait and self._agent.check_xfer_state(out.posted[0][0]) == "PROC":
                break
            for frame in await self._written(out, self.progress_timeout_s):
                h = decode_header(frame.header)
                batch += [frame.header, _TOKEN.pack(_TOKEN_MAGIC, h.page_index)]
                self.stats.bytes_sent += h.payload_len
                self.stats.frames_sent += 1
            wait = False
        if batch:
            await conn.send_all(batch, self.progress_timeout_s)

    async def _stream(self, conn: RawSocket, frames, reply: asyncio.Task) -> None:
        """The fault-free send of some of a transfer's frames (all of them, or, for a
        streamed send, one segment of pages at a time and then the COMMIT): pages written
        in groups of up to 4 MiB (one NIXL request each, several posted at once), each
        group's headers and tokens sent as soon as its WRITE completed; a staging slot is
        written again only after the receiver copied the page that used it (credits)."""
        out = self._out[conn]
        slots = 0
        turns = LoopTurns(self.loop_turn_s)
        group: list[Frame] = []
        group_bytes = 0

        def flush() -> None:
            nonlocal group_bytes
            if group:
                self._post(out, [f.payload for f in group], [f.index % slots for f in group],
                           len(group[0].payload), list(group))
                group.clear()
                group_bytes = 0

        try:
            for frame in frames:
                if not len(frame.payload):  # the COMMIT: every page first
                    flush()
                    while out.posted and not reply.done():
                        await self._landed(conn, out, wait=True)
                    if reply.done():
                        return
                    await conn.send_all([frame.header], self.progress_timeout_s)
                    self.stats.frames_sent += 1
                    continue
                if not slots:
                    slots = self._slots(out, frame)
                i = frame.index
                if i == 0:  # a new transfer on this link: no credit yet
                    out.credit = 0
                    out.credited.clear()
                if group_bytes >= _GROUP_BYTES:
                    flush()
                while i - out.credit >= slots:  # the slot is still the receiver's
                    flush()
                    if out.posted:
                        await self._landed(conn, out, wait=True)
                        continue
                    if reply.done():
                        return
                    out.credited.clear()
                    try:
                        async with asyncio.timeout(self.progress_timeout_s):
                            await out.credited.wait()
                    except TimeoutError:
                        raise StalledError("no credit from the receiver") from None
                if reply.done():
                    return
                group.append(frame)
                group_bytes += len(frame.payload)
                await self._landed(conn, out, wait=False)
                await turns.take()
            flush()
            while out.posted and not reply.done():  # the end of a segment: all of it goes
                await self._landed(conn, out, wait=True)
        finally:
            # Stopped early (a NACK, a lost link, the deadline): the sender's pages may be
            # released once send() returns, so let its WRITEs end first (bounded; one not
            # ended is left to `_release_after_writes`, which then sends no release).
            group.clear()
            await self._quiesce(out)

    async def _quiesce(self, out: _Outbound) -> None:
        try:
            while out.posted:
                await self._written(out, self.progress_timeout_s)
        except OSError:
            pass

    async def _send_frame(self, conn: RawSocket, frame: Frame) -> None:
        """One frame through the fault hook: its payload written (and waited for) first,
        then its header and LANDED token; a payload without a header (`stall_payload`)
        gets just the token, a header without a payload just goes out."""
        out = self._out[conn]
        buffers: list[bytes | memoryview] = []
        if frame.header:
            buffers.append(frame.header)
        if len(frame.payload):
            slots = self._slots(out, frame)
            self._post(out, [frame.payload], [frame.index % slots], len(frame.payload), [])
            await self._written(out, self.progress_timeout_s)
            buffers.append(_TOKEN.pack(_TOKEN_MAGIC, frame.index))
            self.stats.bytes_sent += len(frame.payload)
        await conn.send_all(buffers, self.progress_timeout_s)
        self.stats.frames_sent += 1

    async def _cut(self, conn: RawSocket, cut: Cut) -> None:
        """End the stream inside a frame: whole headers go out, whole payloads are written
        and announced, a partial header goes out as bytes, a partial payload is written
        without its token; then the link is closed."""
        out = self._out[conn]
        index, payload_len = 0, 0  # of the last header sent; its payload comes next
        items = [(memoryview(b), True) for b in cut.whole] + [(memoryview(cut.partial), False)]
        for view, whole in items:
            if not view.nbytes:
                continue
            if not payload_len:  # a header, or the head of one
                if whole:
                    with contextlib.suppress(FrameError):  # a corrupted one: no payload known
                        h = decode_header(view)
                        index, payload_len = h.page_index, h.payload_len
                await conn.send_all([view], self.progress_timeout_s)
                continue
            slots = max(1, out.length // payload_len)
            self._post(out, [view], [index % slots], payload_len, [])
            await self._written(out, self.progress_timeout_s)
            payload_len = 0
            if whole:
                await conn.send_all([_TOKEN.pack(_TOKEN_MAGIC, index)], self.progress_timeout_s)
        conn.close(reset=cut.reset)

    # -- releasing a region ------------------------------------------------------------
    def _release(self, out: _Outbound) -> None:
        """No write of ours into that region can still land: tell its receiver."""
        try:
            self._agent.send_notif(out.remote, _RELEASE + out.token)
        except Exception as exc:  # noqa: BLE001 - the receiver may be gone: nothing to free
            log.debug("nixl release notification not sent: %r", exc)

    async def _release_after_writes(self, out: _Outbound) -> None:
        """After a link ended with WRITEs in flight: wait for each to end, then release.
        A WRITE still not ended `quarantine_s` later leaves the region to its receiver
        (no release is sent: the receiver keeps it retired)."""
        try:
            while out.posted:
                await self._written(out, self.quarantine_s)
        except (OSError, ConnectionError):
            log.warning("nixl: a WRITE into %r did not end; its staging region stays "
                        "retired at the receiver", out.remote)
            return
        self._release(out)

    async def close(self) -> None:
        await super().close()
        for region in self._lent.values():
            self._retire(region)
        self._lent.clear()
        # A region not known quiet may still get a late WRITE (even through the agent's
        # end: UCX over shared memory or TCP does not check the registration at the
        # target): it is never freed while the process lives.
        _NEVER_FREED.extend(self._retired.values())
        self._retired.clear()
