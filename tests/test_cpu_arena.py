"""The CPU backend's two arenas (backends/cpu.py, Note [page-cache arenas]): a checkpoint
whose files nobody untrusted can change is served from its own page cache (wire kind
"file"), anything else is copied into a sealed memfd. What an engine sees when a file is
replaced or rewritten while attached, what a model keeps resident, and that published
weights still get memory of their own."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import json
import mmap
import os
import struct
from pathlib import Path

import msgpack
import pytest
import torch
from safetensors.torch import load_file, save_file

from weightcache import Client
from weightcache.backends import page_cache
from weightcache.backends.cpu import CpuBackend
from weightcache.backends.page_cache import populate_supported
from weightcache.client.mapping import file_tensor_views, map_files
from weightcache.errors import BadRequest, CorruptCheckpoint
from weightcache.loader import open_source, parse_checkpoint, read_checkpoint
from weightcache.protocol.arena import SEGMENT, FileArenaDesc, parse_arena
from weightcache.tools.bench_measure import memfd_bytes, page_cache_bytes
from weightcache.tools.synth import write_checkpoint

MIB = 2**20
PAGE = mmap.PAGESIZE

pytestmark = pytest.mark.skipif(not populate_supported(), reason="page-cache arenas need MADV_POPULATE_READ (Linux >= 5.14)")


def same(attached, expected) -> bool:
    return set(attached) == set(expected) and all(
        attached[k].dtype == v.dtype and attached[k].shape == v.shape
        and torch.equal(attached[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
        for k, v in expected.items())


def snapshot(path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors as copies (load_file maps the file: a later rewrite would show)."""
    return {k: v.clone() for k, v in load_file(str(path)).items()}


def proc_status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def held(pid: int, path: Path) -> int:
    """How many of the daemon's fds are open on ``path``."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.path.realpath(f"/proc/{pid}/fd/{fd}") == str(path)
        except OSError:
            pass
    return n


def misaligned_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """A valid safetensors file whose BF16 tensor starts at an odd byte (not what
    safetensors writes, but nothing forbids it): it cannot be viewed in place."""
    a = torch.tensor([7], dtype=torch.uint8)
    b = torch.arange(64, dtype=torch.float32).to(torch.bfloat16)
    header = json.dumps({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                         "b": {"dtype": "BF16", "shape": [64], "data_offsets": [1, 129]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + a.numpy().tobytes() + b.view(torch.uint8).numpy().tobytes())
    return {"a": a, "b": b}


# -- in process: the backend and the client's mapping, without a daemon ----------------------


def load_in_process(path: Path, backend: CpuBackend):
    """A load as the daemon does it (bind, read, seal) and an attach as the client maps it."""
    from weightcache.client.mapping import attached_model
    from weightcache.protocol.arena import parse_attach

    with open_source(path) as opened:
        ckpt = parse_checkpoint(opened)
        arena = backend.allocate(ckpt.arena_bytes, "t")
        backend.bind_files(arena, ckpt, opened)
        read_checkpoint(ckpt, opened, backend.writer(arena, 1 << 20), threads=2, chunk=1 << 20)
        backend.seal(arena)
    fds, desc = backend.export(arena)
    reply = {"lease": 1, "fingerprint": ckpt.fingerprint, "device": "cpu", "arena": desc, "tensors": msgpack.unpackb(ckpt.encoded_tables()[0])}
    return arena, attached_model("t", parse_attach(reply, fds))


def test_a_trusted_checkpoint_is_served_from_its_page_cache(ckpts):
    backend = CpuBackend("cpu")
    for name in ("a", "sharded"):  # one file; three files through an index
        arena, m = load_in_process(ckpts[name], backend)
        try:
            assert m.arena_kind == "file" and arena.fd == -1  # no memfd: no copy
            files = [ckpts[name]] if name == "a" else sorted(Path(ckpts[name]).parent.glob("*.safetensors"))
            expected = {k: v for f in files for k, v in load_file(str(f)).items()}
            assert same(m, expected)
        finally:
            del m
            backend.free(arena)


def test_without_mlock_the_pages_are_served_populated(ckpts, monkeypatch, caplog):
    def refused(addr: int, length: int) -> int:  # what RLIMIT_MEMLOCK without CAP_IPC_LOCK gives
        ctypes.set_errno(12)
        return -1

    monkeypatch.setattr(page_cache._libc, "mlock", refused)
    backend = CpuBackend("cpu")
    arena, m = load_in_process(ckpts["a"], backend)
    try:
        assert m.arena_kind == "file" and arena.locked == 0 and same(m, load_file(str(ckpts["a"])))
        assert "mlock refused" in caplog.text
    finally:
        del m
        backend.free(arena)


def test_page_cache_off_copies_into_a_sealed_memfd(ckpts):
    backend = CpuBackend("cpu", page_cache=False)
    arena, m = load_in_process(ckpts["a"], backend)
    try:
        assert m.arena_kind == "memfd" and arena.files is None and "off" in arena.fallback
        assert same(m, load_file(str(ckpts["a"])))
    finally:
        del m
        backend.free(arena)


def test_files_others_can_change_are_copied(tmp_path):
    p = write_checkpoint(tmp_path / "m.safetensors", MIB, 8, seed=3)
    backend = CpuBackend("cpu")
    p.chmod(0o664)
    arena, m = load_in_process(p, backend)
    assert m.arena_kind == "memfd" and "writable by its group or others (mode 664)" in arena.fallback
    assert arena.fallback.endswith(f"; chmod go-w {p}")  # what the operator can do, in the same line
    assert same(m, load_file(str(p)))
    del m
    backend.free(arena)
    p.chmod(0o644)
    if os.geteuid() == 0:  # only root can give a file away
        os.chown(p, 65534, 65534)
        arena, m = load_in_process(p, backend)
        assert m.arena_kind == "memfd" and "owned by uid 65534" in arena.fallback and "; chown it to root" in arena.fallback
        assert same(m, load_file(str(p)))
        del m
        backend.free(arena)


def test_an_immutable_file_is_served_whoever_may_write_it(tmp_path):
    from weightcache.loader.sources import FS_IMMUTABLE_FL, inode_flags

    p = write_checkpoint(tmp_path / "m.safetensors", MIB, 8, seed=6)
    p.chmod(0o666)  # writable by anyone, but immutable: nobody, root included, can write it until root clears +i
    fd = os.open(p, os.O_RDONLY)
    try:
        flags = inode_flags(fd)
        try:
            fcntl.ioctl(fd, 0x40086602, struct.pack("<q", flags | FS_IMMUTABLE_FL))  # FS_IOC_SETFLAGS (chattr +i)
        except OSError as exc:
            pytest.skip(f"cannot set the immutable flag here: {exc.strerror}")
        try:
            backend = CpuBackend("cpu")
            arena, m = load_in_process(p, backend)
            assert m.arena_kind == "file" and same(m, load_file(str(p)))
            del m
            backend.free(arena)
        finally:
            fcntl.ioctl(fd, 0x40086602, struct.pack("<q", flags))
    finally:
        os.close(fd)


def test_a_tensor_not_aligned_in_its_file_is_copied(tmp_path):
    p = tmp_path / "odd.safetensors"
    expected = misaligned_checkpoint(p)
    backend = CpuBackend("cpu")
    arena, m = load_in_process(p, backend)
    assert m.arena_kind == "memfd" and "not aligned" in arena.fallback and arena.fallback.endswith("which aligns every tensor")
    assert same(m, expected)
    del m
    backend.free(arena)


def test_the_client_refuses_segments_that_do_not_fit(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(256)) * 32)  # 8 KiB
    row = ["w", "U8", [16], 4096, 16]

    def arena(seg: bytes, *sizes: int) -> FileArenaDesc:
        desc = parse_arena({"kind": "file", "nbytes": 8192, "files": list(sizes or [8192]), "segments": seg})
        assert isinstance(desc, FileArenaDesc)
        return desc

    def slabs(size: int = 8192) -> list[torch.Tensor]:
        return map_files(arena(b"", size), [os.open(p, os.O_RDONLY)])

    ok = file_tensor_views(slabs(), arena(SEGMENT.pack(0, 256, 4096, 4096)), [row])
    assert ok["w"].tolist() == list(range(16))  # arena offset 4096 is file offset 256
    for seg in (SEGMENT.pack(1, 0, 4096, 16), SEGMENT.pack(0, 8000, 4096, 400), SEGMENT.pack(0, 0, 4100, 16)):
        with pytest.raises(BadRequest):
            file_tensor_views(slabs(), arena(seg), [row])
    with pytest.raises(BadRequest, match="32 per segment"):
        arena(b"x")
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(BadRequest, match="at least 9000 bytes"):  # past its end a mapping is SIGBUS: refused
        slabs(9000)
    with pytest.raises(BadRequest):
        map_files(arena(b"", 8192, 8192), [os.open(p, os.O_RDONLY)])
    assert len(os.listdir("/proc/self/fd")) == before  # every fd closed, on errors too


# -- against a daemon: files changing under attached engines ----------------------------------


async def test_attach_reads_every_byte_from_the_page_cache(start_daemon, ckpts):
    d = start_daemon(budget="64MiB", models={"a": ckpts["a"], "s": ckpts["sharded"]})
    async with Client(d.socket) as c:
        async with c.attach("a") as m:
            assert m.arena_kind == "file" and same(m, load_file(str(ckpts["a"])))
        async with c.attach("s") as m:
            files = sorted(Path(ckpts["sharded"]).parent.glob("*.safetensors"))
            assert m.arena_kind == "file" and same(m, {k: v for f in files for k, v in load_file(str(f)).items()})
    assert "served from the page cache" in d.log_text()


async def test_a_cold_checkpoint_is_read_into_the_page_cache(start_daemon, tmp_path):
    p = write_checkpoint(tmp_path / "m.safetensors", 16 * MIB, 20, seed=8)
    fd = os.open(p, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    assert page_cache_bytes(p) < MIB
    d = start_daemon(models={"m": p}, extra_daemon={"load_chunk_bytes": MIB})
    async with Client(d.socket) as c, c.attach("m") as m:
        assert m.arena_kind == "file" and m.source == "files"
        assert page_cache_bytes(p) >= p.stat().st_size - 2 * PAGE  # the load made it resident
        assert same(m, snapshot(p))


async def test_a_file_replaced_by_rename_while_attached_keeps_the_old_bytes(start_daemon, tmp_path):
    p = write_checkpoint(tmp_path / "m.safetensors", 2 * MIB, 10, seed=1)
    old = snapshot(p)
    d = start_daemon(models={"m": p})
    async with Client(d.socket) as c:
        async with c.attach("m") as m:
            assert m.arena_kind == "file"
            new = write_checkpoint(tmp_path / "new.safetensors", 2 * MIB, 10, seed=2)
            os.replace(new, p)  # how downloads and `mv` update a checkpoint
            assert same(m, old)  # the daemon holds the old inode: whole, old bytes
            async with c.attach("m") as again:  # attached: still the loaded copy
                assert again.fingerprint == m.fingerprint and same(again, old)
            kept = dict(m)
        assert same(kept, old)  # a mapping outlives its lease (and the old file's name)
        async with c.attach("m") as m:  # nobody attached: the new file is loaded
            assert same(m, snapshot(p)) and not same(m, old)


async def test_a_file_rewritten_in_place_while_attached_is_refused_to_new_attaches(start_daemon, tmp_path):
    p = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(4096), "b": torch.zeros(16)}, str(p))
    p.chmod(0o644)  # readable by every user: served from its page cache
    d = start_daemon(models={"m": p})
    async with Client(d.socket) as c:
        async with c.attach("m") as m:
            assert m.arena_kind == "file"
            save_file({"w": torch.ones(4096), "b": torch.ones(16)}, str(tmp_path / "new.safetensors"))
            p.write_bytes((tmp_path / "new.safetensors").read_bytes())  # as `cp` does: truncate, write, same inode
            # The trusted owner's in-place write reaches the attached engine: the one hazard
            # of page-cache arenas (documented); nobody else may write a file served this way.
            assert bool((m["w"] == 1).all())
            with pytest.raises(CorruptCheckpoint, match="changed in place") as info:
                async with c.attach("m"):
                    pass
            assert info.value.details["reason"] == "changed in place"
            assert (await c.models())[0]["attach_count"] == 1  # the refused attach left no lease
        async with c.attach("m") as m:  # nobody attached: reloaded from what the file now holds
            assert bool((m["w"] == 1).all()) and bool((m["b"] == 1).all())


async def test_a_file_others_may_write_is_copied_and_its_rewrite_changes_nothing(start_daemon, tmp_path):
    p = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(4096)}, str(p))
    p.chmod(0o666)
    d = start_daemon(models={"m": p})
    async with Client(d.socket) as c, c.attach("m") as m:
        assert m.arena_kind == "memfd"
        with open(p, "r+b") as f:  # anyone could: in place, same size
            f.seek(-4 * 4096, os.SEEK_END)
            f.write(torch.ones(4096).numpy().tobytes())
        assert bool((m["w"] == 0).all())  # sealed: the engine keeps the bytes it attached
    assert "writable by its group or others" in d.log_text()


# -- memory ---------------------------------------------------------------------------------


async def test_resident_memory_of_a_model_is_its_size(start_daemon, tmp_path):
    a = write_checkpoint(tmp_path / "a.safetensors", 32 * MIB, 40, seed=4)
    b = write_checkpoint(tmp_path / "b.safetensors", 32 * MIB, 40, seed=5)
    b.chmod(0o664)  # copied into a memfd
    d = start_daemon(budget="128MiB", models={"a": a, "b": b})
    pid = d.proc.pid
    async with Client(d.socket) as c:
        for p in (a, b):
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)  # clean, as a checkpoint is by the time it is served (the kernel drops no dirty page)
            os.close(fd)
            p.read_bytes()  # and in the page cache
        async with c.attach("a") as m, c.attach("b") as n:
            assert (m.arena_kind, n.arena_kind) == ("file", "memfd")
            for t in (*m.values(), *n.values()):
                t.view(-1).view(torch.uint8).max()  # an engine read every byte
            st = (await c.status())["devices"]["cpu"]
            sizes = {x["name"]: x["nbytes"] for x in await c.models()}
            # a: the file's pages, once; no memfd. b: the memfd; its file's pages dropped.
            resident_a = page_cache_bytes(a)
            resident_b = page_cache_bytes(b) + memfd_bytes(pid)
            assert resident_a <= 1.05 * a.stat().st_size and resident_b <= 1.05 * b.stat().st_size, (resident_a, resident_b)
            assert memfd_bytes(pid) >= b.stat().st_size - 2 * PAGE
            assert st["used"] == sizes["a"] + sizes["b"]
            # What is pinned is within what the budget counts for it: whole pages inside
            # the tensor bytes (all of them where mlock is allowed: root here).
            locked = proc_status(pid, "VmLck")
            assert locked <= sizes["a"]
            if os.geteuid() == 0:
                assert locked >= a.stat().st_size - 64 * 1024
        await c.evict("a")
        await c.evict("b")
        for _ in range(100):  # freed in a thread
            if proc_status(pid, "VmLck") == 0 and held(pid, a) == 0 and memfd_bytes(pid) == 0:
                break
            await asyncio.sleep(0.05)
        assert proc_status(pid, "VmLck") == 0 and held(pid, a) == 0 and memfd_bytes(pid) == 0  # evicted: nothing held


async def test_published_weights_get_memory_of_their_own(start_daemon, ckpts):
    d = start_daemon(budget="64MiB", models={"a": ckpts["a"]})
    async with Client(d.socket) as c:
        async with c.attach("a") as m:
            assert m.arena_kind == "file"
            mine = {k: (v.float() * 2).to(torch.bfloat16) for k, v in list(m.items())[:8]}
            await c.publish("a-x2", mine, fingerprint=f"{m.fingerprint}+x2")
        used = (await c.status())["devices"]["cpu"]["used"]
        sizes = {x["name"]: x["nbytes"] for x in await c.models()}
        assert used == sizes["a"] + sizes["a-x2"] and sizes["a-x2"] > 0
        async with c.attach("a-x2") as p:
            assert p.arena_kind == "memfd" and same(p, mine)
        assert memfd_bytes(d.proc.pid) >= sum(t.numel() * t.element_size() for t in mine.values())


# An attacker's view: who else could change or read a file served from
# its page cache. Each refusal falls back to a sealed memfd, and the log says why.

async def test_a_file_someone_holds_open_for_writing_is_copied(start_daemon, tmp_path):
    p = write_checkpoint(tmp_path / "m.safetensors", MIB, 8, seed=4)
    writer = os.open(p, os.O_WRONLY)  # e.g. opened while the file was still 0666, then chmod'ed
    try:
        d = start_daemon(models={"m": p})
        async with Client(d.socket) as c, c.attach("m") as m:
            assert m.arena_kind == "memfd"
        assert f"some process has it open for writing; close it (fuser -v {p} names it)" in d.log_text()
    finally:
        os.close(writer)


async def test_a_file_written_by_save_file_is_served_from_its_page_cache(start_daemon, tmp_path):
    # safetensors' save_file creates files 0600 (save_pretrained writes through it): the
    # operator's files as they are, which were all copied into a memfd before.
    p = tmp_path / "m.safetensors"
    expected = {f"t{i}": torch.randn(1000 + i) for i in range(8)}
    save_file(expected, str(p))
    assert p.stat().st_mode & 0o777 == 0o600
    d = start_daemon(models={"m": p})
    async with Client(d.socket) as c, c.attach("m") as m:
        assert m.arena_kind == "file" and same(m, expected)
        (entry,) = await c.models()
        assert entry["arena"] == "file" and entry["arena_note"] is None


async def test_a_model_written_by_save_pretrained_is_served_from_its_page_cache(start_daemon, tmp_path):
    # What operators' model directories hold: transformers writes through safetensors (0600).
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path / "gpt2")
    files = list((tmp_path / "gpt2").glob("*.safetensors"))
    assert files and all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    d = start_daemon(models={"gpt2": tmp_path / "gpt2"})
    async with Client(d.socket) as c, c.attach("gpt2") as m:
        assert m.arena_kind == "file" and same(m, {k: v for f in files for k, v in load_file(str(f)).items()})


@pytest.mark.parametrize("extra", ["tail", "gap"])
async def test_a_file_not_everyone_may_read_with_bytes_beyond_its_tensors_is_copied(start_daemon, tmp_path, extra):
    # Bytes no tensor covers would reach an engine that could not open the file; a file
    # everyone may read shows them to everyone anyway.
    p = write_checkpoint(tmp_path / "m.safetensors", MIB, 8, seed=5)
    raw = p.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    if extra == "tail":
        raw += b"secret" * 100
    else:  # 4096 bytes between the header and the first tensor
        for v in header.values():
            if isinstance(v, dict) and "data_offsets" in v:
                v["data_offsets"] = [o + 4096 for o in v["data_offsets"]]
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        raw = len(text).to_bytes(8, "little") + text + b"s" * 4096 + raw[8 + n:]
    p.write_bytes(raw)
    p.chmod(0o640)
    d = start_daemon(models={"m": p})
    async with Client(d.socket) as c, c.attach("m") as m:
        assert m.arena_kind == "memfd"
        (entry,) = await c.models()
        assert entry["arena"] == "memfd"
        assert "is not readable by every user and holds 600 byte(s) outside" in entry["arena_note"] if extra == "tail" else \
            "holds 4096 byte(s) outside its header and tensors" in entry["arena_note"]
        assert f"; chmod a+r {p} if every user may read them, else rewrite it without them" in entry["arena_note"]
        assert "\n" not in entry["arena_note"]
    p.chmod(0o644)  # readable by all: nothing more to hide
    d2 = start_daemon(models={"m": p})
    async with Client(d2.socket) as c, c.attach("m") as m:
        assert m.arena_kind == "file"


async def test_files_a_peer_sends_are_copied(start_daemon, tmp_path):
    p = write_checkpoint(tmp_path / "m.safetensors", MIB, 8, seed=6)
    d = start_daemon()
    async with Client(d.socket) as c:
        await c.register("sent", p)  # by open files: the peer chose them
        async with c.attach("sent") as m:
            assert m.arena_kind == "memfd" and same(m, snapshot(p))
    assert "sent by a peer as open files; to have the daemon open them itself, name the model in the config or register it " \
        "with --by-path" in d.log_text()


@pytest.mark.parametrize(("err", "action"), [(errno.EACCES, "give the daemon CAP_LEASE"), (errno.EINVAL, "takes no leases")])
def test_a_lease_that_cannot_be_taken_says_what_to_do(monkeypatch, tmp_path, err, action):
    # Unknown is not safe: copied, and the line says how to make the answer known.
    p = write_checkpoint(tmp_path / "m.safetensors", MIB, 8, seed=7)
    real_fcntl = fcntl.fcntl

    def no_lease(fd, cmd, *args):
        if cmd == fcntl.F_SETLEASE:
            raise OSError(err, os.strerror(err))
        return real_fcntl(fd, cmd, *args)

    monkeypatch.setattr(page_cache.fcntl, "fcntl", no_lease)
    backend = CpuBackend("cpu")
    arena, m = load_in_process(p, backend)
    try:
        assert m.arena_kind == "memfd" and "cannot tell whether some process has it open for writing" in arena.fallback
        assert action in arena.fallback and "\n" not in arena.fallback
    finally:
        del m
        backend.free(arena)


def test_a_file_on_a_network_file_system_says_to_copy_it(monkeypatch, tmp_path):
    from weightcache.loader import sources

    p = write_checkpoint(tmp_path / "m.safetensors", MIB, 8, seed=8)
    monkeypatch.setattr(sources, "file_system", lambda fd: "nfs4")
    with open_source(p) as opened:
        assert sources.why_untrusted(opened) == (f"{p} is on nfs4, where the bytes can change behind the page cache; "
                                               "copy it to a local file system")


def test_a_child_forked_while_an_arena_fills_does_not_block_its_seal(tmp_path):
    """The daemon forks to start its workers (the next fill worker starts as a fill ends).
    A child holds the parent's mappings from fork to exec; had it the arena's writable
    mapping, the seal would fail (F_SEAL_WRITE: EBUSY), as it did in peer fills."""
    import subprocess
    import threading
    import time

    backend = CpuBackend("cpu", page_cache=False)
    arena = backend.allocate(backend.capacity(4 * MIB), "forked")
    view = backend.dma_target(arena)  # the memfd and the daemon's writable mapping, as a peer fill makes them
    assert view is not None
    ctypes.memset(view.regions[0].addr, 7, 4 * MIB)

    def spawn() -> None:  # preexec_fn: the child waits between fork and exec, holding what it inherited
        subprocess.run(["true"], preexec_fn=lambda: time.sleep(1.0), check=True)

    t = threading.Thread(target=spawn)
    t.start()
    time.sleep(0.3)  # the child is in its preexec sleep now (fork is immediate; the sleep is 1 s)
    try:
        backend.seal(arena)
    finally:
        t.join()
    with open(f"/proc/self/fd/{arena.fd}", "rb") as f:
        assert f.read(4) == b"\x07" * 4
    backend.free(arena)
