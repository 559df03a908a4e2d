"""A GPU model's lend and fill through rings (peers/staged.py, the lender's
``stage`` op in peers/server.py, the fill's control channel in peers/__init__.py), on
the CPU: the rings are host memory, the NIXL agent a stand-in that copies, so what is
checked here is the protocol and the fill's bookkeeping (chunks, slots reused only once
copied out, pieces hashed only once every byte of them landed, the padding zeroed, the
fingerprint). tests/test_gpu_peers.py runs the same on the GPU, with NIXL."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from conftest import eventually
from safetensors.torch import save_file

from weightcache.backends.base import StagedRing
from weightcache.errors import LoadFailed, NoSpace
from weightcache.loader import Checkpoint, Progress, fingerprint_files, open_checkpoint
from weightcache.peers import LendChannel, staged
from weightcache.peers.fill import Lent, Staged
from weightcache.peers.server import serve_lend
from weightcache.peers.transport import TransferFailed, Transport
from weightcache.peers.wire import PeerError, check_reply, encode_frame, recv, send

SLOT = 64 * 1024


def write(tmp: Path) -> Path:
    """Tensors a fill meets: ones smaller than the kernel takes (<= 240 bytes, hashed on
    the host), one spanning many slots, and padding between them."""
    g = torch.Generator().manual_seed(7)
    tensors = {"tiny": torch.randn(10, generator=g).to(torch.bfloat16),
               "a": torch.randn(1000, generator=g).to(torch.bfloat16),
               "big": torch.randn(300_000, generator=g).to(torch.bfloat16),
               "odd": torch.randn(333, generator=g).to(torch.bfloat16),
               "empty": torch.zeros(0, dtype=torch.bfloat16),
               "b": torch.randn(40_000, generator=g).to(torch.bfloat16)}
    path = tmp / "m.safetensors"
    save_file(tensors, str(path))
    return path


def arena_of(ckpt: Checkpoint, padding: int) -> bytearray:
    """The lender's arena: every tensor's file bytes at its arena offset, ``padding`` between."""
    end = max(t.arena_offset + t.nbytes for t in ckpt.tensors)
    out = bytearray([padding]) * end
    with open(ckpt.files[0].path, "rb") as f:
        data = f.read()
    for t in ckpt.tensors:
        out[t.arena_offset : t.arena_offset + t.nbytes] = data[t.file_offset : t.file_offset + t.nbytes]
    return out


def addr(buf: Any) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


class HostRing:
    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.slots, self.slot_bytes = slots, slot_bytes
        self.buf = bytearray(slots * slot_bytes)
        self.base = addr(self.buf)

    def addr(self, slot: int) -> int:
        return self.base + slot * self.slot_bytes


class HostLanding:
    """backends/cuda_staging.py's Landing in host memory, checking the fill's order as it goes."""

    memory = "DRAM"
    device_id = 0

    def __init__(self, arena: bytearray, slots: int, slot_bytes: int) -> None:
        self.arena = arena
        self.ring = HostRing(slots, slot_bytes)
        self.landed = bytearray(len(arena))  # 1 where a byte has landed
        self.slot_busy = [False] * slots  # read into, not yet copied out
        self.hashed: dict[Any, bytes] = {}
        self.closed = False

    def context(self) -> AbstractContextManager[None]:
        return nullcontext()

    def wait(self, slot: int) -> None:
        assert not self.slot_busy[slot], f"slot {slot} read into again before its bytes were copied out"
        self.slot_busy[slot] = True

    def land(self, slot: int, offset: int, nbytes: int) -> None:
        assert self.slot_busy[slot]
        self.arena[offset : offset + nbytes] = self.ring.buf[slot * self.ring.slot_bytes : slot * self.ring.slot_bytes + nbytes]
        self.landed[offset : offset + nbytes] = b"\x01" * nbytes
        self.slot_busy[slot] = False

    def hash_landed(self, pieces: Sequence[tuple[Any, int, int]]) -> None:
        for key, offset, nbytes in pieces:
            assert all(self.landed[offset : offset + nbytes]), f"piece {key} hashed before all of it landed"
            assert key not in self.hashed
            self.hashed[key] = xxhash.xxh3_128_digest(bytes(self.arena[offset : offset + nbytes]))

    def zero(self, gaps: Sequence[tuple[int, int]]) -> None:
        for offset, nbytes in gaps:
            self.arena[offset : offset + nbytes] = bytes(nbytes)

    def digests(self) -> dict[Any, bytes]:
        return dict(self.hashed)

    def close(self) -> None:
        self.closed = True


class RingBackend:
    """What StagedFill uses of a backend."""

    device = "cuda:0"

    def __init__(self, arena: bytearray) -> None:
        self.arena = arena
        self.landing: HostLanding | None = None

    def dma_landing(self, arena: Any, slots: int, slot_bytes: int) -> HostLanding:
        self.landing = HostLanding(self.arena, slots, slot_bytes)
        return self.landing


class CopyingAgent:
    """A NIXL agent whose reads copy (memmove) from the far address to the near one when
    they complete, newest first: a read is done once it is the newest posted or the one
    posted after it is done (so a chunk's slot may be asked for again while the chunk
    before it in that slot is still in flight)."""

    def __init__(self) -> None:
        self.posted: list[tuple[int, int, int]] = []
        self.done: set[int] = set()

    def add_remote_agent(self, md: bytes) -> str:
        return "peer"

    def remove_remote_agent(self, name: str) -> None:
        pass

    def register_memory(self, regions: list[Any], memory: str) -> str:
        return "reg"

    def deregister_memory(self, handle: str) -> None:
        pass

    def get_xfer_descs(self, descs: list[Any], memory: str) -> list[Any]:
        return descs

    def initialize_xfer(self, op: str, local: list[Any], far: list[Any], remote: str) -> int:
        (dst, n, _), (src, m, _) = local[0], far[0]
        assert n == m
        self.posted.append((dst, src, n))
        return len(self.posted)

    def transfer(self, h: int) -> str:
        return "PROC"

    def check_xfer_state(self, h: int) -> str:
        if h not in self.done and (h == len(self.posted) or h + 1 in self.done):
            dst, src, n = self.posted[h - 1]
            ctypes.memmove(dst, src, n)
            self.done.add(h)
        return "DONE" if h in self.done else "PROC"

    def release_xfer_handle(self, h: int) -> None:
        pass


def transport() -> Transport:
    t = Transport.__new__(Transport)  # no NIXL: the read loop over a copying stand-in
    t.agent = CopyingAgent()  # type: ignore[assignment]
    t._reading = threading.Lock()
    return t


class HostStages:
    """The lender's side in the fill's thread: ``request`` stages at once, into the
    lender's host ring, from its arena; refuses to overwrite a slot the fill has not read."""

    def __init__(self, arena: bytearray, ring: HostRing) -> None:
        self.arena, self.ring = arena, ring
        self.requests: list[tuple[int, int, int, int]] = []

    def request(self, seq: int, slot: int, offset: int, nbytes: int) -> None:
        self.requests.append((seq, slot, offset, nbytes))
        start = slot * self.ring.slot_bytes
        self.ring.buf[start : start + nbytes] = self.arena[offset : offset + nbytes]

    def staged(self, seq: int, stall_s: float) -> bool:
        assert any(r[0] == seq for r in self.requests), f"chunk {seq} waited for before it was asked for"
        return True


@pytest.fixture
def small_rings() -> Iterator[None]:  # the fills below use 3 slots of SLOT bytes
    yield


def fill(path: Path, lender_arena: bytearray, expected: str, max_bytes_per_s: int | None = None,
         progress: Progress | None = None) -> tuple[str | None, RingBackend, HostStages]:
    ckpt = open_checkpoint(path)
    lender_ring = HostRing(4, SLOT)  # a lender's ring bigger than the borrower's: the smaller is used
    lent = Lent(b"md", "VRAM", 0, (), Staged(lender_ring.base, lender_ring.slots, lender_ring.slot_bytes))
    backend = RingBackend(bytearray(b"\xee") * len(lender_arena))  # the borrower's arena: garbage until filled
    stages = HostStages(lender_arena, lender_ring)
    f = staged.StagedFill(transport(), backend, lent, expected, lambda: None, stages, timeout_s=60,  # type: ignore[arg-type]
                          max_bytes_per_s=max_bytes_per_s, slots=3, slot_bytes=SLOT)
    return f(ckpt, None, progress or Progress(ckpt.arena_bytes)), backend, stages  # type: ignore[arg-type]


def test_a_staged_fill_lands_every_tensor_byte_and_checks_the_fingerprint(tmp_path: Path, small_rings: None) -> None:
    path = write(tmp_path)
    ckpt = open_checkpoint(path)
    fp = fingerprint_files(path)
    lender = arena_of(ckpt, padding=0xAB)  # the lender's padding: not covered by the fingerprint
    got, backend, stages = fill(path, lender, fp)
    assert got == fp
    assert backend.landing is not None and backend.landing.closed
    assert bytes(backend.arena) == bytes(arena_of(ckpt, padding=0))  # every tensor byte, the padding zeroed
    chunks = -(-len(lender) // SLOT)
    assert chunks > 6  # several rounds of the 3 slots
    assert sorted(r[0] for r in stages.requests) == list(range(chunks))  # asked as slots free: in any order
    assert all(seq % 3 == slot for seq, slot, _, _ in stages.requests)


def test_a_gpu_arena_fills_from_a_lenders_host_memory_that_holds_only_the_tensors(tmp_path: Path, small_rings: None) -> None:
    """A host lender's file arena lends its tensors' bytes (regions), not the padding
    between them: the fill reads what the regions hold, chunk by chunk, and zeroes the rest."""
    path = write(tmp_path)
    ckpt = open_checkpoint(path)
    lender = arena_of(ckpt, padding=0xAB)
    base = addr(lender)
    regions = tuple(sorted((t.arena_offset, base + t.arena_offset, t.nbytes) for t in ckpt.tensors if t.nbytes))
    backend = RingBackend(bytearray(b"\xee") * len(lender))
    t = transport()
    f = staged.StagedFill(t, backend, Lent(b"md", "DRAM", 0, regions), fingerprint_files(path), lambda: None,  # type: ignore[arg-type]
                          HostStages(lender, HostRing(1, SLOT)), timeout_s=60, slots=3, slot_bytes=SLOT)
    assert f(ckpt, None, Progress(ckpt.arena_bytes)) == fingerprint_files(path)  # type: ignore[arg-type]
    assert bytes(backend.arena) == bytes(arena_of(ckpt, padding=0))
    reads = t.agent.posted  # type: ignore[attr-defined]
    assert sum(n for _, _, n in reads) == sum(t.nbytes for t in ckpt.tensors)  # the tensors' bytes, once each


def test_a_host_lenders_regions_that_miss_a_tensor_fail_before_any_read(tmp_path: Path, small_rings: None) -> None:
    """A lender whose regions leave a tensor's bytes out would leave arena bytes unwritten
    (a GPU arena's, unmapped, for the hash kernels to read): refused before the first read."""
    path = write(tmp_path)
    ckpt = open_checkpoint(path)
    lender = arena_of(ckpt, padding=0)
    base = addr(lender)
    regions = tuple(sorted((t.arena_offset, base + t.arena_offset, t.nbytes) for t in ckpt.tensors if t.nbytes and t.name != "b"))
    t = transport()
    f = staged.StagedFill(t, RingBackend(bytearray(len(lender))), Lent(b"md", "DRAM", 0, regions), fingerprint_files(path),  # type: ignore[arg-type]
                          lambda: None, HostStages(lender, HostRing(1, SLOT)), timeout_s=60, slots=3, slot_bytes=SLOT)
    with pytest.raises(LoadFailed, match="its regions do not hold tensor 'b'"):
        f(ckpt, None, Progress(ckpt.arena_bytes))  # type: ignore[arg-type]
    assert t.agent.posted == []  # type: ignore[attr-defined]


def test_this_daemons_own_failure_to_land_is_raised_as_itself_not_as_the_peers(tmp_path: Path, small_rings: None) -> None:
    """Growing the arena for a chunk found no room (NoSpace): the read stops, and the fill
    raises NoSpace, which the load path treats as any fill's, not as the peer's failure."""
    path = write(tmp_path)
    ckpt = open_checkpoint(path)
    lender = arena_of(ckpt, padding=0)

    class NoRoom(HostLanding):
        def land(self, slot: int, offset: int, nbytes: int) -> None:
            if offset >= 2 * SLOT:
                raise NoSpace("no room on cuda:0 for the arena")
            super().land(slot, offset, nbytes)

    backend = RingBackend(bytearray(len(lender)))
    backend.dma_landing = lambda arena, slots, slot_bytes: NoRoom(backend.arena, slots, slot_bytes)  # type: ignore[method-assign]
    lender_ring = HostRing(3, SLOT)
    f = staged.StagedFill(transport(), backend, Lent(b"md", "VRAM", 0, (), Staged(lender_ring.base, 3, SLOT)),  # type: ignore[arg-type]
                          fingerprint_files(path), lambda: None, HostStages(lender, lender_ring), timeout_s=60, slots=3,
                          slot_bytes=SLOT)
    with pytest.raises(NoSpace, match="no room on cuda:0"):
        f(ckpt, None, Progress(ckpt.arena_bytes))  # type: ignore[arg-type]


def test_a_lenders_tiny_slots_are_refused() -> None:
    """The chunk is the smaller of the two sides' slots: a lender's 1-byte slot would cut a
    10 GB fill into 10^10 chunks."""
    with pytest.raises(ValueError, match="slots of 2097152"):
        Lent.parse({"metadata": b"", "memory": "VRAM", "device_id": 0, "regions": [],
                    "staged": {"addr": 4096, "slots": 8, "slot_bytes": 1}})
    assert Lent.parse({"metadata": b"", "memory": "VRAM", "device_id": 0, "regions": [],
                       "staged": {"addr": 4096, "slots": 8, "slot_bytes": 2**21}}).staged == Staged(4096, 8, 2**21)


def test_no_reads_to_make_touches_no_transport() -> None:
    t = transport()
    t.read(b"md", [], "VRAM", 0, "DRAM", 0, window=8, on_done=lambda d, n: None, stop=lambda: None, deadline=time.monotonic() + 1)
    assert t.agent.posted == []  # type: ignore[attr-defined]


def test_a_capped_fill_lands_and_reports_its_progress_as_it_goes(tmp_path: Path, small_rings: None) -> None:
    """The rate cap holds posting back without holding up the reads in flight: each chunk
    lands (and shows in ``status``'s progress) as its read completes, not at the end."""
    path = write(tmp_path)
    ckpt = open_checkpoint(path)
    lender = arena_of(ckpt, padding=0)
    progress = Progress(len(lender))
    seen: list[int] = []
    running = threading.Event()
    running.set()

    def watch() -> None:
        while running.is_set():
            seen.append(progress.done)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    t0 = time.monotonic()
    try:
        got, _, _ = fill(path, lender, fingerprint_files(path), max_bytes_per_s=len(lender) * 2, progress=progress)
    finally:
        running.clear()
        watcher.join()
    assert got == fingerprint_files(path)
    assert progress.done == sum(t.nbytes for t in ckpt.tensors)  # the tensors' bytes, not the padding landed with them
    assert time.monotonic() - t0 >= 0.4  # ~0.5 s at the cap
    assert len({x for x in seen if 0 < x < len(lender)}) >= 3, sorted(set(seen))


def test_a_wrong_byte_from_the_peer_fails_the_fill(tmp_path: Path, small_rings: None) -> None:
    path = write(tmp_path)
    ckpt = open_checkpoint(path)
    lender = arena_of(ckpt, padding=0)
    big = next(t for t in ckpt.tensors if t.name == "big")
    lender[big.arena_offset + big.nbytes - 1] ^= 1  # the last byte of a tensor spanning many slots
    with pytest.raises(LoadFailed, match="do not match this checkpoint's fingerprint"):
        fill(path, lender, fingerprint_files(path))


def test_a_peer_that_stops_answering_stage_fails_within_stall_s() -> None:
    async def main() -> None:
        server_got: list[dict[str, Any]] = []

        async def lender(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while (msg := await recv(reader)) is not None:
                server_got.append(msg)  # never answers

        srv = await asyncio.start_server(lender, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        ch = LendChannel(asyncio.get_running_loop(), reader, writer)
        task = asyncio.ensure_future(ch.run())
        ch.request(0, 0, 0, 4096)
        t0 = time.monotonic()
        with pytest.raises(TransferFailed, match=r"did not stage bytes within 0\.3 s"):
            await until_staged(ch, 0, 0.3)
        assert 0.3 <= time.monotonic() - t0 < 5
        assert server_got == [{"op": "stage", "seq": 0, "slot": 0, "offset": 0, "nbytes": 4096}]
        task.cancel()
        writer.close()
        srv.close()

    asyncio.run(main())


async def until_staged(ch: LendChannel, seq: int, stall_s: float) -> None:
    """Poll as the fill's read loop does, until staged (or TransferFailed)."""
    while not ch.staged(seq, stall_s):
        await asyncio.sleep(0.001)


async def _lend_pair(ring: StagedRing | None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, asyncio.Task[None],
                                                      asyncio.Server]:
    """serve_lend on one end of a loopback connection; the task ends when the lend does."""
    done = asyncio.get_running_loop().create_future()

    async def lender(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await serve_lend(reader, writer, ring, time.monotonic() + 30)
        finally:
            writer.close()
            done.set_result(None)

    srv = await asyncio.start_server(lender, "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.sockets[0].getsockname()[1])
    return reader, writer, asyncio.ensure_future(asyncio.wait_for(done, 30)), srv


@pytest.mark.parametrize(("request_", "why"), [
    ({"slot": 4, "offset": 0, "nbytes": 10}, "slot 4 is not one of this lend's 4"),
    ({"slot": -1, "offset": 0, "nbytes": 10}, "slot -1 is not one of"),
    ({"slot": 0, "offset": 0, "nbytes": SLOT + 1}, f"do not fit one slot ({SLOT})"),
    ({"slot": 0, "offset": 0, "nbytes": 0}, "0 bytes do not fit one slot"),
    ({"slot": 0, "offset": 1_000_000 - 10, "nbytes": 11}, "not within the arena (1000000)"),
    ({"slot": 0, "offset": -5, "nbytes": 10}, "not within the arena"),
    ({"slot": 0, "offset": "0", "nbytes": 10}, "stage needs integers"),
    ({"slot": True, "offset": 0, "nbytes": 10}, "stage needs integers"),
])
async def test_a_lender_refuses_a_stage_outside_its_ring_or_arena_and_ends_the_lend(request_: dict[str, Any], why: str) -> None:
    staged_calls: list[tuple[int, int, int]] = []
    def stage(slot: int, offset: int, nbytes: int, done: Callable[[str | None], None]) -> None:
        staged_calls.append((slot, offset, nbytes))
        done(None)

    ring = StagedRing(0x1000, 4, SLOT, 1_000_000, stage)
    reader, writer, ended, srv = await _lend_pair(ring)
    await send(writer, {"op": "stage", "seq": 0, "slot": 1, "offset": 4096, "nbytes": 100})  # a good one first
    assert check_reply(await recv(reader), "stage") == {"ok": True, "seq": 0}
    await send(writer, {"op": "stage", "seq": 1, **request_})
    with pytest.raises(PeerError, match=re.escape(why)) as exc:
        check_reply(await recv(reader), "stage")
    assert exc.value.code == "BAD_REQUEST"
    await ended  # the lend is over: its lease goes
    assert await recv(reader) is None
    assert staged_calls == [(1, 4096, 100)]  # the refused one never reached the ring
    writer.close()
    srv.close()


async def test_a_lender_takes_every_stage_asked_before_the_first_copy_is_done_and_answers_in_order() -> None:
    """Stages are pipelined (cuda_staging.py's Note [stages pipelined]): each request goes
    to the ring as it arrives, not after the one before is answered; the answers come in
    the order asked, whatever order the copies finish in."""
    handed: list[tuple[int, Callable[[str | None], None]]] = []

    def stage(slot: int, offset: int, nbytes: int, done: Callable[[str | None], None]) -> None:
        handed.append((slot, done))

    ring = StagedRing(0x1000, 4, SLOT, 1_000_000, stage)
    reader, writer, ended, srv = await _lend_pair(ring)
    for seq in range(4):
        await send(writer, {"op": "stage", "seq": seq, "slot": seq, "offset": 4096 * seq, "nbytes": 100})
    for _ in range(2000):  # all four reach the ring with none of them copied yet (up to 10 s on a busy machine)
        if len(handed) == 4:
            break
        await asyncio.sleep(0.005)
    assert [slot for slot, _ in handed] == [0, 1, 2, 3]
    for slot in (2, 1, 3):  # copies finishing out of order: nothing may be answered before stage 0
        handed[slot][1](None)
    first = asyncio.ensure_future(recv(reader))
    await asyncio.wait((first,), timeout=0.2)
    assert not first.done()
    handed[0][1](None)
    got = [check_reply(await first, "stage")["seq"]] + [check_reply(await recv(reader), "stage")["seq"] for _ in range(3)]
    assert got == [0, 1, 2, 3]
    await send(writer, {"op": "done"})
    assert await recv(reader) == {"ok": True}
    await ended
    writer.close()
    srv.close()


async def test_a_borrower_cannot_ask_more_stages_than_the_ring_has_slots_before_their_replies() -> None:
    handed: list[Callable[[str | None], None]] = []
    ring = StagedRing(0x1000, 4, SLOT, 1_000_000, lambda _slot, _offset, _nbytes, done: handed.append(done))
    reader, writer, ended, srv = await _lend_pair(ring)
    for seq in range(5):
        await send(writer, {"op": "stage", "seq": seq, "slot": seq % 4, "offset": 0, "nbytes": 100})
    for _ in range(2000):
        if len(handed) == 4:
            break
        await asyncio.sleep(0.005)
    for done in handed:
        done(None)
    assert [check_reply(await recv(reader), "stage")["seq"] for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(PeerError, match=r"more than 4 stages asked before their replies") as exc:
        check_reply(await recv(reader), "stage")
    assert exc.value.code == "BAD_REQUEST"
    await asyncio.wait_for(ended, 5)
    assert len(handed) == 4  # the fifth never reached the ring
    writer.close()
    srv.close()


async def test_a_lend_ended_by_its_deadline_leaves_no_task_reading_the_borrowers_frames() -> None:
    """The deadline cancels the lend with a stage's copy pending: neither the reply sender
    nor the pending read of the next request outlives it (that read would take the
    borrower's next frame)."""
    ring = StagedRing(0x1000, 4, SLOT, 1_000_000, lambda _slot, _offset, _nbytes, _done: None)  # never copied
    ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    before = set(asyncio.all_tasks())

    async def lender(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(TimeoutError):
            await serve_lend(reader, writer, ring, time.monotonic() + 0.3)
        ended.set_result(None)

    srv = await asyncio.start_server(lender, "127.0.0.1", 0)
    _reader, writer = await asyncio.open_connection("127.0.0.1", srv.sockets[0].getsockname()[1])
    await send(writer, {"op": "stage", "seq": 0, "slot": 0, "offset": 0, "nbytes": 100})
    await asyncio.wait_for(ended, 5)

    def left() -> list[asyncio.Task[Any]]:  # the lend's reader and reply sender, still running
        return [t for t in asyncio.all_tasks() - before if t is not asyncio.current_task() and not t.done()
                and ("recv" in repr(t.get_coro()) or "_answer_in_order" in repr(t.get_coro()))]

    async def none_left() -> bool:  # a cancelled task ends a few turns of the loop later
        return not left()

    await eventually(none_left)
    writer.close()
    srv.close()


async def test_a_failed_copy_is_answered_in_its_turn_and_ends_the_lend() -> None:
    def stage(slot: int, offset: int, nbytes: int, done: Callable[[str | None], None]) -> None:
        threading.Thread(target=done, args=("the lender's copy failed: CUDA_ERROR_ILLEGAL_ADDRESS" if slot == 1 else None,)).start()

    ring = StagedRing(0x1000, 4, SLOT, 1_000_000, stage)
    reader, writer, ended, srv = await _lend_pair(ring)
    for seq in range(3):
        await send(writer, {"op": "stage", "seq": seq, "slot": seq, "offset": 0, "nbytes": 100})
    assert check_reply(await recv(reader), "stage") == {"ok": True, "seq": 0}
    with pytest.raises(PeerError, match="stage: the lender's copy failed: CUDA_ERROR_ILLEGAL_ADDRESS") as exc:
        check_reply(await recv(reader), "stage")
    assert exc.value.code == "BAD_REQUEST"
    await asyncio.wait_for(ended, 5)  # the lend is over (its lease goes), stage 2 never answered
    assert await recv(reader) is None
    writer.close()
    srv.close()


async def test_a_lend_from_host_memory_takes_no_stage_and_done_ends_it() -> None:
    reader, writer, ended, srv = await _lend_pair(None)
    await send(writer, {"op": "stage", "seq": 0, "slot": 0, "offset": 0, "nbytes": 1})
    with pytest.raises(PeerError, match="a lend takes done, not 'stage'"):
        check_reply(await recv(reader), "stage")
    await ended
    writer.close()
    srv.close()


async def test_a_borrower_that_never_reads_the_replies_cannot_hold_a_lend_past_its_deadline() -> None:
    """The deadline holds for the lender's replies too, not only for its reads of requests:
    a borrower that asks and never reads would otherwise block the reply's drain for good,
    holding the lend's lease and ring."""
    ended: asyncio.Future[float] = asyncio.get_running_loop().create_future()
    ring = StagedRing(0x1000, 4, SLOT, 1_000_000, lambda _slot, _offset, _nbytes, done: done(None))

    async def lender(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        t0 = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await serve_lend(reader, writer, ring, t0 + 1.0)
        ended.set_result(time.monotonic() - t0)
        writer.close()

    srv = await asyncio.start_server(lender, "127.0.0.1", 0)
    _reader, writer = await asyncio.open_connection("127.0.0.1", srv.sockets[0].getsockname()[1])
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    frame = encode_frame({"op": "stage", "seq": 0, "slot": 0, "offset": 0, "nbytes": 1})
    sender = asyncio.ensure_future(_send_forever(writer, frame))
    took = await asyncio.wait_for(ended, 20)
    sender.cancel()
    assert 0.9 <= took < 5, took
    writer.close()
    srv.close()


async def _send_forever(writer: asyncio.StreamWriter, frame: bytes) -> None:
    with contextlib.suppress(OSError, ConnectionError):
        while True:
            writer.write(frame * 64)
            await writer.drain()


async def test_a_lender_frame_over_the_limit_stops_the_fill_at_once() -> None:
    async def lender(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await recv(reader)
        writer.write((64 * 2**20).to_bytes(4, "big"))  # a frame header past the 16 MiB limit
        await writer.drain()
        await asyncio.sleep(5)  # and keeps the connection open: the fill must stop on the header, not on a close

    srv = await asyncio.start_server(lender, "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.sockets[0].getsockname()[1])
    ch = LendChannel(asyncio.get_running_loop(), reader, writer)
    task = asyncio.ensure_future(ch.run())
    ch.request(0, 0, 0, 10)
    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match="FrameTooLarge"):
        await until_staged(ch, 0, 30)
    assert time.monotonic() - t0 < 5
    await task
    writer.close()
    srv.close()


async def test_the_fill_channel_wakes_on_its_stage_and_stops_on_a_refusal() -> None:
    async def lender(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        msg = await recv(reader)
        assert msg is not None
        writer.write(encode_frame({"ok": True, "seq": msg["seq"]}))
        await recv(reader)
        writer.write(encode_frame({"ok": False, "error": {"code": "BAD_REQUEST", "message": "stage: slot 9 is not one of this lend's 8"}}))
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(lender, "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.sockets[0].getsockname()[1])
    ch = LendChannel(asyncio.get_running_loop(), reader, writer)
    task = asyncio.ensure_future(ch.run())
    ch.request(0, 0, 0, 10)
    assert not ch.staged(0, 10)  # asked, not answered yet
    await until_staged(ch, 0, 10)
    ch.request(1, 9, 0, 10)
    with pytest.raises(TransferFailed, match="slot 9 is not one of this lend's 8"):
        await until_staged(ch, 1, 10)
    await task
    assert ch.closed
    writer.close()
    srv.close()
