"""The package's shape: arrows point one way (no import cycle, not even one only for
type checking), and the CLI and the client's control calls do not pay for torch."""

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


# The most lines a module may have (issue 26: every package was split into rooms under
# it). docs/architecture.md states it.
MAX_MODULE_LINES = 500


def test_no_module_is_over_the_bound_the_docs_state():
    over = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"
    docs = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    assert f"No module is over {MAX_MODULE_LINES:,} lines" in docs


def test_entry_names_and_share_keys_are_spelled_in_one_place():
    """A staging entry, a rank's or a replica's name and a share key are spelled by
    cache/names.py alone (issue 26: "#" in name was tested in six places)."""
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


def test_the_cli_does_not_import_torch():
    code = "import sys, weightcache.cli, weightcache.client; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_every_op_has_a_handler():
    from weightcache.server.handlers import HANDLERS

    assert set(HANDLERS) | {"hello"} == OPS


CLIENT_MUST_NOT_IMPORT = ("weightcache.loader", "weightcache.server", "weightcache.cuda_driver", "cuda.bindings")


def test_no_module_of_the_client_imports_the_daemon_nor_its_loader():
    """Every module of weightcache.client, imported in a fresh interpreter, imports the
    protocol and the client only: never weightcache.loader, weightcache.server or
    cuda-bindings (issue 26: publish imported the loader, and so all of it, for one
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
    the server or cuda-bindings (issue 26: register and verify reached the loader for
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
