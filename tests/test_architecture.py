"""The package's shape: arrows point one way (no import cycle between modules, not even one
only for type checking, nor between subpackages; nothing below the daemon imports it), and
the CLI and the client's control calls do not pay for torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import weightcache
from weightcache.protocol import OPS

PACKAGE = Path(weightcache.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every weightcache module ``path`` imports, at any level, TYPE_CHECKING blocks and
    function bodies included."""
    mod = _module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("weightcache")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            if base.startswith("weightcache"):
                out.add(base)
                out |= {f"{base}.{a.name}" for a in node.names}
    return out


def test_entry_names_and_share_keys_are_spelled_in_one_place():
    """A staging entry, a rank's or a replica's name and a share key are spelled by
    cache/names.py alone ("#" in name was tested in six places)."""
    for path in PACKAGE.rglob("*.py"):
        if path.parts[-2:] in (("cache", "names.py"),) or path.parts[-2] not in ("server", "cache", "residency"):
            continue
        text = path.read_text()
        for spelling in ('"#" in ', 'partition("#")', '"\\0rank', '}@{', '"\\0" + '):
            assert spelling not in text, f"{path.relative_to(PACKAGE)} spells {spelling!r} itself: use cache/names.py"


def test_no_import_cycles():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}
    # A package imports its own modules to re-export them: that is not an arrow back.
    graph = {m: {i for i in deps if not (modules[m].name == "__init__.py" and i.startswith(m + "."))}
             for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(n):], n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def _subpackage(module: str) -> str:
    """The package's room a module belongs to: its subpackage, or a top-level module itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "weightcache"


def _subpackage_arrows() -> dict[tuple[str, str], set[str]]:
    """(importer's room, imported room) -> the importing modules, between different rooms."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    arrows: dict[tuple[str, str], set[str]] = {}
    for m, p in modules.items():
        for i in _imports(p):
            target = i if i in modules else i.rpartition(".")[0]
            if target in modules and _subpackage(target) != _subpackage(m):
                arrows.setdefault((_subpackage(m), _subpackage(target)), set()).add(m)
    return arrows


# The rooms below the daemon: none may import it. The daemon builds them and calls down.
BELOW_THE_SERVER = ("backends", "cache", "client", "loader", "peers", "protocol", "config", "units", "errors",
                    "checkpoint_files", "cuda_driver")
# Arrows known to run back up, each with why it is tolerated for now. A known arrow that is
# gone is fine; a new one fails.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def test_no_arrow_runs_back_up_to_the_server():
    arrows = _subpackage_arrows()
    upward = {(a, b): sorted(ms) for (a, b), ms in arrows.items() if b == "server" and a in BELOW_THE_SERVER}
    new = {k: v for k, v in upward.items() if k not in KNOWN_UPWARD}
    assert not new, f"modules below the server import it (the daemon calls down, never the other way): {new}"


def test_no_import_cycle_between_subpackages():
    """Rooms, not only modules, point one way: the graph of subpackages has no cycle once
    the known upward arrows are taken out."""
    graph: dict[str, set[str]] = {}
    for a, b in _subpackage_arrows():
        if (a, b) not in KNOWN_UPWARD:
            graph.setdefault(a, set()).add(b)
    state: dict[str, int] = {}

    def visit(room: str, path: list[str]) -> None:
        state[room] = 1
        for nxt in sorted(graph.get(room, ())):
            if state.get(nxt) == 1:
                raise AssertionError("cycle between subpackages: " + " -> ".join([*path[path.index(nxt):], nxt]))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[room] = 2

    for room in sorted(graph):
        if room not in state:
            visit(room, [room])


def test_the_route_tracer_counts_returns_to_rooms_left():
    """benchmarks/routes.py's count: a call that lands in a file the thread had called into
    before, coming from another file."""
    sys.path.insert(0, str(PACKAGE.parent))
    try:
        from benchmarks.routes import eviction_decision, returns
    finally:
        sys.path.remove(str(PACKAGE.parent))
    assert returns(["a", "b", "a"]) == 1
    assert returns(["a", "a", "b"]) == 0
    assert returns(["loads", "core", "policy", "core", "policy"]) == 2
    route = eviction_decision()["daemon"]
    assert route["files"] == len(route["list"]) > 0 and all(f.startswith("cache/") for f in route["list"]), route


def test_the_cli_does_not_import_torch():
    code = "import sys, weightcache.cli, weightcache.client; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_every_op_has_a_handler():
    from weightcache.server.connections import HANDLERS

    assert set(HANDLERS) | {"hello"} == OPS


CLIENT_MUST_NOT_IMPORT = ("weightcache.loader", "weightcache.server", "weightcache.cuda_driver", "cuda.bindings")


def test_no_module_of_the_client_imports_the_daemon_nor_its_loader():
    """Every module of weightcache.client, imported in a fresh interpreter, imports the
    protocol and the client only: never weightcache.loader, weightcache.server or
    cuda-bindings (publish imported the loader, and so all of it, for one
    constant; the client's modules are what engines and the CLI pay for)."""
    code = ("import pkgutil, sys, weightcache.client\n"
            "for m in pkgutil.iter_modules(weightcache.client.__path__):\n"
            "    __import__(f'weightcache.client.{m.name}')\n"
            f"print(sorted(m for m in sys.modules if m.startswith({CLIENT_MUST_NOT_IMPORT!r})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_no_client_module_reaches_the_loader_even_at_call_time():
    """No import anywhere in a client module, function bodies included, of the loader,
    the server or cuda-bindings (register and verify reached the loader for
    checkpoint discovery, now in the leaf weightcache/checkpoint_files.py)."""
    for path in sorted((PACKAGE / "client").glob("*.py")):
        reached = {m for m in _imports(path) if m.startswith(CLIENT_MUST_NOT_IMPORT)}
        assert not reached, f"{_module_name(path)} imports {sorted(reached)}"


def test_register_and_verify_import_nothing_of_the_daemon_when_called(tmp_path):
    """What the static check above cannot see (an import by a module the client imports):
    opening a checkpoint's files for register and comparing an attached model with them,
    run in a fresh interpreter, leave no module of the loader, the server or
    cuda-bindings in sys.modules."""
    import torch
    from safetensors.torch import save_file

    (tmp_path / "ck").mkdir()
    save_file({"w": torch.arange(6, dtype=torch.float32)}, str(tmp_path / "ck" / "a.safetensors"))
    save_file({"b": torch.ones(2, dtype=torch.bfloat16)}, str(tmp_path / "ck" / "b.safetensors"))
    code = ("import os, sys, torch\n"
            "from weightcache.client.files import open_checkpoint_files\n"
            "from weightcache.client.verify import verify_against_files\n"
            f"names, fds = open_checkpoint_files([{str(tmp_path / 'ck')!r}])\n"
            "assert len(names[0]) == 2 == len(fds), names\n"
            "[os.close(fd) for fd in fds]\n"
            "weights = {'w': torch.arange(6, dtype=torch.float32), 'b': torch.ones(2, dtype=torch.bfloat16)}\n"
            f"assert verify_against_files(weights, {str(tmp_path / 'ck')!r}) == []\n"
            f"assert verify_against_files({{**weights, 'w': torch.zeros(6)}}, {str(tmp_path / 'ck')!r}) == ['w: bytes differ']\n"
            f"print(sorted(m for m in sys.modules if m.startswith({CLIENT_MUST_NOT_IMPORT!r})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_the_arena_layout_is_defined_in_protocol_only():
    """The wire's arena layout (the file arena's segment, the alignment, the memfd seals)
    lives in protocol/arena.py; the daemon and the client import it (it was written twice)."""
    for path in PACKAGE.rglob("*.py"):
        if path.parts[-2:] == ("protocol", "arena.py"):
            continue
        text = path.read_text()
        for definition in ('struct.Struct("<4Q")', "ARENA_ALIGN = ", "MEMFD_SEALS = ", "SEGMENT = "):
            assert definition not in text, f"{path.relative_to(PACKAGE)} defines {definition.strip(' =')} again"
