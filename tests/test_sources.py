"""Opening a checkpoint once and only reading it through those fds (sources.py), and the
strict header parser: each test is one way a tenant could cross into another's data."""

import json
import os
import pickle
import socket
import struct
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weightcache.backends.cpu import CpuBackend
from weightcache.checkpoint_files import discover_files
from weightcache.errors import BadRequest, CorruptCheckpoint, LoadFailed, PermissionDenied
from weightcache.loader import OpenedSource, adopt_fds, open_checkpoint, open_source, parse_checkpoint, read_checkpoint
from weightcache.loader.checkpoint import MAX_HEADER_BYTES
from weightcache.loader.sources import _under

ROOT = Path(__file__).resolve().parent.parent


def tensors(seed: int = 0, n: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(64 + i, generator=g) for i in range(n)}


def st_file(path: Path, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors(seed), str(path))
    return path


def raw_header(path: Path, header: bytes, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def run_isolated(code: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a child with a timeout: a test that hangs fails instead of hanging."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, check=False)


def load_bytes(path_or_opened) -> bytes:
    """Parse and read a checkpoint into a CPU arena; the arena's bytes."""
    opened = path_or_opened if isinstance(path_or_opened, OpenedSource) else open_source(path_or_opened)
    with opened:
        ckpt = parse_checkpoint(opened)
        backend = CpuBackend("cpu")
        arena = backend.allocate(ckpt.arena_bytes, "t")
        try:
            read_checkpoint(ckpt, opened, backend.writer(arena, 4096), threads=2, chunk=4096)
            backend.seal(arena)
            return os.pread(arena.fd, ckpt.arena_bytes, 0)
        finally:
            backend.free(arena)


# -- special files ----------------------------------------------------------------------------


def test_a_fifo_as_the_checkpoint_is_refused_at_once(tmp_path):
    fifo = tmp_path / "m.safetensors"
    os.mkfifo(fifo)
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "dir" / "a.safetensors")
    # In a child with a timeout: before the fix, opening the FIFO blocked the thread forever.
    r = run_isolated(f"""
        from weightcache.errors import LoadFailed
        from weightcache.loader import open_source
        for p in [{str(fifo)!r}, {str(tmp_path / "dir")!r}]:
            try:
                open_source(p)
            except LoadFailed as exc:
                print(exc.details["reason"], "|", exc.message)
    """)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("not a regular file | ") and "FIFO" in line for line in lines), lines


def test_the_open_flags_never_block_on_a_fifo(tmp_path):
    """The stat before the open keeps FIFOs out; if a FIFO is swapped in between, the open
    itself must still return (O_NONBLOCK) so that fstat can refuse it."""
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    r = run_isolated(f"""
        import os, stat
        from weightcache.loader.sources import _OPEN_FLAGS
        fd = os.open({str(fifo)!r}, _OPEN_FLAGS)
        print(stat.S_ISFIFO(os.fstat(fd).st_mode))
    """, timeout=20)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr


def test_directories_and_devices_are_not_checkpoint_files(tmp_path):
    (tmp_path / "d.safetensors").mkdir()  # a directory that globs like a shard
    st_file(tmp_path / "a.safetensors")
    with pytest.raises(LoadFailed) as info:
        open_source(tmp_path)
    assert info.value.details["reason"] == "not a regular file" and "directory" in info.value.message
    with pytest.raises(LoadFailed, match="character device"):
        open_source("/dev/null")


def test_a_failed_open_closes_everything_it_opened(tmp_path):
    for i in range(3):
        st_file(tmp_path / f"m{i}.safetensors", seed=i)
    os.mkfifo(tmp_path / "m9.safetensors")  # sorts last: three files are open when it is refused
    before = open_fds()
    with pytest.raises(LoadFailed):
        open_source(tmp_path)
    assert open_fds() == before


def test_opened_source_closes_its_fds_once(tmp_path):
    opened = open_source(st_file(tmp_path / "a.safetensors"))
    fd = opened.files[0].fd
    os.fstat(fd)
    with opened:
        pass
    with pytest.raises(OSError):
        os.fstat(fd)
    opened.close()  # idempotent
    assert opened.closed


# -- symlinks and roots ---------------------------------------------------------------------------


def test_symlinks_are_refused_when_not_followed(tmp_path):
    real = st_file(tmp_path / "real.safetensors")
    link = tmp_path / "link.safetensors"
    link.symlink_to(real)
    assert len(open_checkpoint(link).tensors) == 3  # followed by default
    with pytest.raises(PermissionDenied, match="symbolic link") as info:
        open_source(link, follow_symlinks=False)
    assert info.value.details["reason"] == "symlink"
    d = tmp_path / "dir"
    d.mkdir()
    (d / "a.safetensors").symlink_to(real)  # a symlink among a directory's files
    with pytest.raises(PermissionDenied, match="symbolic link"):
        open_source(d, follow_symlinks=False)
    open_source(real, follow_symlinks=False).close()


def test_roots_compare_path_components():
    assert _under("/models/a", "/models") and _under("/models", "/models") and _under("/x/y", "/")
    assert not _under("/models2/a", "/models") and not _under("/model", "/models")


def test_a_symlink_out_of_the_roots_is_refused_and_one_inside_accepted(tmp_path):
    models, outside = tmp_path / "models", tmp_path / "secret"
    inside = st_file(models / "real.safetensors")
    secret = st_file(outside / "secret.safetensors", seed=1)
    (models / "in.safetensors").symlink_to(inside)
    (models / "out.safetensors").symlink_to(secret)
    roots = [models]
    with open_source(models / "in.safetensors", roots=roots) as opened:
        assert parse_checkpoint(opened).layout
    with pytest.raises(PermissionDenied) as info:
        open_source(models / "out.safetensors", roots=roots)
    assert str(models / "out.safetensors") in info.value.message and str(models) in info.value.message
    assert info.value.details["roots"] == [str(models)]
    # a directory that is a symlink to outside the roots, and a root given through a symlink
    (models / "sub").symlink_to(outside, target_is_directory=True)
    with pytest.raises(PermissionDenied):
        open_source(models / "sub", roots=roots)
    (tmp_path / "alias").symlink_to(models, target_is_directory=True)
    open_source(models / "real.safetensors", roots=[tmp_path / "alias"]).close()


def test_a_sibling_directory_with_a_longer_name_is_not_under_the_root(tmp_path):
    st_file(tmp_path / "models2" / "m.safetensors")
    with pytest.raises(PermissionDenied):
        open_source(tmp_path / "models2" / "m.safetensors", roots=[tmp_path / "models"])
    with pytest.raises(PermissionDenied):
        open_source(tmp_path / "models2", roots=[tmp_path / "models"])


def test_a_root_refusal_says_nothing_about_what_lies_outside(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    for p in [tmp_path / "elsewhere" / "missing.safetensors", st_file(tmp_path / "elsewhere" / "there.safetensors")]:
        with pytest.raises(PermissionDenied):
            open_source(p, roots=[models])
    # links among a directory's files: to nothing, to a device, to a FIFO outside
    os.mkfifo(tmp_path / "fifo")
    for target in [tmp_path / "nothing", Path("/dev/null"), tmp_path / "fifo"]:
        d = models / target.name
        d.mkdir()
        st_file(d / "a.safetensors")
        (d / "b.safetensors").symlink_to(target)
        with pytest.raises(PermissionDenied):
            open_source(d, roots=[models])
        with pytest.raises(LoadFailed):  # without roots, the specific reason
            open_source(d)


def test_the_files_are_those_discover_files_names(ckpts, tmp_path):
    st_file(tmp_path / "d" / "b.safetensors")
    st_file(tmp_path / "d" / ".a.safetensors")
    for source in [ckpts["sharded"], ckpts["sharded"].parent, ckpts["a"], tmp_path / "d", f"{tmp_path}/./d/"]:
        with open_source(source) as opened:
            assert [f.path for f in opened.files] == discover_files(source)
            assert opened.source == str(source)


def test_an_index_naming_a_file_outside_is_refused(tmp_path):
    models = tmp_path / "models"
    st_file(models / "a.safetensors")
    secret = st_file(tmp_path / "secret.safetensors", seed=1)
    index = models / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w0": "../secret.safetensors"}}))
    with pytest.raises(CorruptCheckpoint, match="outside its directory"):
        open_source(index)
    (models / "b.safetensors").symlink_to(secret)
    index.write_text(json.dumps({"weight_map": {"w0": "a.safetensors", "x": "b.safetensors"}}))
    with pytest.raises(PermissionDenied, match=r"b\.safetensors"):
        open_source(index, roots=[models])
    with pytest.raises(PermissionDenied):
        open_source(models, roots=[models])  # the same index found through the directory
    # the index json itself outside the roots
    outside_index = tmp_path / "o.safetensors.index.json"
    outside_index.write_text(json.dumps({"weight_map": {"w0": "models/a.safetensors"}}))
    with pytest.raises(PermissionDenied):
        open_source(outside_index, roots=[models])


def test_index_is_read_through_its_fd_with_a_size_cap(tmp_path):
    st_file(tmp_path / "a.safetensors")
    index = tmp_path / "m.safetensors.index.json"
    with open(index, "wb") as f:
        f.truncate(64 * 2**20 + 1)  # sparse: costs no disk
    with pytest.raises(CorruptCheckpoint, match="larger than 16 MiB"):
        open_source(index)
    index.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CorruptCheckpoint, match="invalid index"):
        open_source(index)
    index.write_text(json.dumps({"weight_map": {"w0": "a.safetensors", "w1": "a.safetensors"}}))
    with open_source(index) as opened:
        assert [f.path for f in opened.files] == [str(tmp_path / "a.safetensors")]


# -- the fd is the file -------------------------------------------------------------------------


def test_data_comes_from_the_parsed_fd_even_after_the_path_is_swapped(tmp_path):
    p = st_file(tmp_path / "m.safetensors", seed=0)
    original = load_bytes(p)
    st_file(tmp_path / "evil.safetensors", seed=1)  # same names and shapes, other values
    assert load_bytes(tmp_path / "evil.safetensors") != original
    opened = open_source(p)
    os.replace(tmp_path / "evil.safetensors", p)  # swapped after the open, before parse and read
    with opened:
        ckpt = parse_checkpoint(opened)
        assert ckpt.matches(opened) and not ckpt.unchanged_on_disk()
        assert load_bytes(opened) == original


def test_unchanged_on_disk_notices_a_rename_replace_with_the_same_size_and_mtime(tmp_path):
    p = st_file(tmp_path / "m.safetensors", seed=0)
    ckpt = open_checkpoint(p)
    assert ckpt.unchanged_on_disk()
    q = st_file(tmp_path / "q.safetensors", seed=1)
    st = p.stat()
    assert q.stat().st_size == st.st_size
    os.utime(q, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(q, p)
    assert p.stat().st_size == st.st_size and p.stat().st_mtime_ns == st.st_mtime_ns
    assert not ckpt.unchanged_on_disk()


def test_matches_checks_the_open_files(tmp_path):
    p = st_file(tmp_path / "m.safetensors")
    with open_source(p) as opened:
        ckpt = parse_checkpoint(opened)
        assert ckpt.matches(opened)
        os.utime(p, ns=(0, 0))
        assert not ckpt.matches(opened)
        with open_source(p) as again:
            assert not ckpt.matches(again)  # mtime differs from the parse
    assert not ckpt.matches(opened)  # closed fds never match


# -- adopted fds --------------------------------------------------------------------------------------


def test_adopted_fds_parse_like_the_files(tmp_path, ckpts):
    with open_source(ckpts["sharded"]) as by_path:
        names = [Path(f.path).name for f in by_path.files]
        fds = [os.open(f.path, os.O_RDONLY) for f in by_path.files]
        expected = parse_checkpoint(by_path)
        want = load_bytes(open_source(ckpts["sharded"]))
    with adopt_fds("fds:sharded", names, fds) as adopted:
        assert adopted.source == "fds:sharded"
        ckpt = parse_checkpoint(adopted)
        assert ckpt.layout == expected.layout and ckpt.matches(adopted)
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    fds = [os.open(f.path, os.O_RDWR) for f in expected.files]
    assert load_bytes(adopt_fds("fds:x", names, fds)) == want


def _bad_fds(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    ok = st_file(tmp_path / "ok.safetensors")
    s1, s2 = socket.socketpair()
    s2.close()
    r, w = os.pipe()
    os.close(w)
    return {
        "FIFO": os.open(fifo, os.O_RDONLY | os.O_NONBLOCK),
        "pipe": r,
        "directory": os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY),
        "O_WRONLY": os.open(ok, os.O_WRONLY),
        "socket": s1.detach(),
        "O_PATH": os.open(ok, os.O_PATH),
    }


@pytest.mark.parametrize(("kind", "reason"), [("FIFO", "FIFO"), ("pipe", "FIFO"), ("directory", "directory"),
                                              ("O_WRONLY", "not opened for reading"), ("socket", "socket"), ("O_PATH", "O_PATH")])
def test_adopt_fds_refuses_what_is_not_a_readable_file_and_closes_all(tmp_path, kind, reason):
    bad = _bad_fds(tmp_path)
    for k, fd in bad.items():
        if k != kind:
            os.close(fd)
    good = os.open(st_file(tmp_path / "good.safetensors"), os.O_RDONLY)
    with pytest.raises(BadRequest) as info:
        adopt_fds("fds:m", ["good.safetensors", f"{kind}.safetensors"], [good, bad[kind]])
    assert reason in info.value.message and f"{kind}.safetensors" in info.value.message
    for fd in (good, bad[kind]):  # both were the daemon's to close, and are closed
        with pytest.raises(OSError):
            os.fstat(fd)


def test_adopt_fds_refuses_mismatched_and_repeated_fds(tmp_path):
    p = st_file(tmp_path / "a.safetensors")
    fd = os.open(p, os.O_RDONLY)
    with pytest.raises(BadRequest, match="1 fds for 2 file names"):
        adopt_fds("fds:m", ["a", "b"], [fd])
    with pytest.raises(OSError):
        os.fstat(fd)
    fd = os.open(p, os.O_RDONLY)
    with pytest.raises(BadRequest, match="same fd"):
        adopt_fds("fds:m", ["a", "b"], [fd, fd])
    with pytest.raises(OSError):
        os.fstat(fd)


# -- the header parser ------------------------------------------------------------------------------


def corrupt(path: Path) -> CorruptCheckpoint:
    with pytest.raises(CorruptCheckpoint) as info:
        open_checkpoint(path)
    assert info.value.details["file"] == str(path)
    return info.value


def test_duplicate_keys_are_refused_at_any_level(tmp_path):
    e = '{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
    p = raw_header(tmp_path / "d.safetensors", f'{{"x":{e},"x":{e}}}'.encode(), b"\0" * 4)
    assert "tensor 'x' appears twice in the header" in corrupt(p).message
    p = raw_header(tmp_path / "d.safetensors", b'{"x":{"dtype":"F64","dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4)
    assert "'dtype' appears twice" in corrupt(p).message
    p = raw_header(tmp_path / "d.safetensors", b'{"__metadata__":{"a":"1","a":"2"}}')
    assert "'a' appears twice" in corrupt(p).message


def test_huge_integers_are_refused(tmp_path):
    p = raw_header(tmp_path / "i.safetensors", b'{"x":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,4]}}')
    assert "more than 19 digits" in corrupt(p).message
    p = raw_header(tmp_path / "i.safetensors", b'{"x":{"dtype":"U8","shape":[-' + b"1" * 20 + b'],"data_offsets":[0,4]}}')
    assert "more than 19 digits" in corrupt(p).message


@pytest.mark.parametrize(("shape", "offsets", "dtype", "reason"), [
    ([2**64], [0, 4], "U8", "more than 19 digits"),
    ([2**62 + 1], [0, 4], "U8", "at most 2**62"),
    ([2**31, 2**31, 2], [0, 4], "U8", "more than 2**62 bytes"),
    ([2**61], [0, 2**61], "F32", "more than 2**62 bytes"),
    ([1], [2**62 + 1, 2**62 + 2], "U8", "data_offsets must be two integers"),
    ([1], [0, True], "U8", "data_offsets must be two integers"),
    ([True], [0, 1], "U8", "shape must be"),
    ([4], [0, 4], ["U8"], "unsupported dtype ['U8']"),
    ([4], [0, 4], {"a": 1}, "unsupported dtype"),
])
def test_dimensions_offsets_and_dtypes_are_bounded(tmp_path, shape, offsets, dtype, reason):
    header = {"x": {"dtype": dtype, "shape": shape, "data_offsets": offsets}}
    p = raw_header(tmp_path / "b.safetensors", json.dumps(header).encode(), b"\0" * 8)
    assert reason in corrupt(p).message


def test_floats_nan_and_long_names_are_refused(tmp_path):
    for text, reason in [(b'{"x":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}', "floating-point"),
                         (b'{"x":{"dtype":"F32","shape":[1e2],"data_offsets":[0,4]}}', "floating-point"),
                         (b'{"x":{"dtype":"F32","shape":[NaN],"data_offsets":[0,4]}}', "NaN"),
                         (b'{"x":{"dtype":"F32","shape":[-Infinity],"data_offsets":[0,4]}}', "NaN or Infinity"),
                         (b'{"' + b"n" * 1025 + b'":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', "longer than 1024")]:
        p = raw_header(tmp_path / "f.safetensors", text, b"\0" * 4)
        assert reason in corrupt(p).message


def test_deep_nesting_is_refused(tmp_path):
    p = raw_header(tmp_path / "n.safetensors", b'{"x":' + b"[" * 200_000 + b"]" * 200_000 + b"}")
    assert corrupt(p).details["reason"] == "header is nested too deeply"


def test_headers_above_the_cap_are_refused_without_being_read(tmp_path):
    p = tmp_path / "big.safetensors"
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b'{"')
        f.truncate(8 + MAX_HEADER_BYTES + 1)
    assert "header exceeds the 16 MiB limit" in corrupt(p).message
    raw_header(p, b'{"x":' + b" " * (MAX_HEADER_BYTES - 10) + b"1}")  # exactly at the cap: parsed (and refused for content)
    assert "entry must have" in corrupt(p).message


def assert_no_oracle(exc: CorruptCheckpoint, first8: bytes) -> None:
    """The message names the format but neither the header length read from the first 8
    bytes (in any base) nor the bytes themselves."""
    (n,) = struct.unpack("<Q", first8)
    for leak in (str(n), hex(n), f"{n:x}", first8.hex(), repr(first8)[2:-1]):
        assert leak not in exc.details["reason"], leak


def test_a_pytorch_zip_checkpoint_is_named_as_such(tmp_path):
    p = tmp_path / "pytorch_model.bin"
    torch.save(tensors(), p)
    assert zipfile.is_zipfile(p)
    exc = corrupt(p)
    assert "not a safetensors file (it looks like a PyTorch zip checkpoint" in exc.message
    assert "safetensors.torch.save_file" in exc.message
    assert_no_oracle(exc, p.read_bytes()[:8])


def test_a_pickle_checkpoint_is_named_as_such(tmp_path):
    p = tmp_path / "legacy.pt"
    torch.save(tensors(), p, _use_new_zipfile_serialization=False)
    exc = corrupt(p)
    assert "not a safetensors file (it looks like a Python pickle" in exc.message
    assert_no_oracle(exc, p.read_bytes()[:8])
    p.write_bytes(pickle.dumps({"w": list(range(100))}, protocol=5))
    assert "Python pickle" in corrupt(p).message


def test_other_files_are_not_safetensors_and_leak_no_bytes(tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\0" * 100)
    assert "GGUF" in corrupt(p).message
    for content in [b"root:x:0:0:root:/root:/bin/bash\n" * 4, b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!",
                    b"\x05\x00\x00\x00\x00\x00\x00\x00[1,2]"]:
        p.write_bytes(content)
        exc = corrupt(p)
        assert "not a safetensors file" in exc.message
        assert_no_oracle(exc, content[:8])
        assert "root" not in exc.message.replace(str(tmp_path), "") and "json" not in exc.message


def test_a_real_header_that_starts_like_a_pickle_still_loads(tmp_path):
    """Sniffing comes after the JSON check: a header of 640 bytes has the length bytes
    80 02, a pickle's first two bytes."""
    for pad in range(0, 600):
        header = {"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, "__metadata__": {"p": "x" * pad}}
        text = json.dumps(header).encode()
        if len(text) == 640:
            break
    p = raw_header(tmp_path / "m.safetensors", text, b"\1\2\3\4")
    assert p.read_bytes()[:2] == b"\x80\x02"
    assert load_bytes(p)[:4] == b"\1\2\3\4"


def test_a_close_during_reads_waits_for_them(tmp_path):
    """A register whose client went, or an io timeout, closes an OpenedSource while its
    parse may still be reading the fds in a thread: closing them then would hand their
    numbers to the next file opened (or sent by a peer), and the parse would read on in
    that file. The fds close when the last reader is done."""
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(16)}, str(path))
    opened = open_source(path)
    fd = opened.files[0].fd
    with opened.reading():
        opened.close()
        assert opened.closed  # for its users it is closed at once
        os.fstat(fd)  # but the reader's fd is still this file's
        with pytest.raises(ValueError, match="closed"), opened.reading():
            pass  # no new reader once closed
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by the last reader
    opened.close()  # idempotent
