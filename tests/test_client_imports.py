"""The client imports torch only when it handles weights.

``weightcache health`` (Kubernetes probes), the CLI and engines that only ask for status
must not pay for torch (~1.5 s, ~300 MB). Each check runs in a fresh interpreter: this
one imported torch long ago.
"""

import subprocess
import sys
import textwrap

import pytest

import weightcache.client


def run_python(code: str, *args: str) -> str:
    """Run ``code`` in a fresh interpreter; return its stdout, failing with its stderr."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def test_control_calls_do_not_import_torch(start_daemon, ckpts):
    d = start_daemon(models={"tiny": ckpts["tiny"]})
    out = run_python("""
        import asyncio, sys
        import weightcache, weightcache.client
        from weightcache import Client, SyncClient

        def no_torch(when):
            assert "torch" not in sys.modules, f"torch imported {when}"

        no_torch("by the imports")
        Client(sys.argv[1])
        no_torch("by constructing a Client")

        async def control():
            async with Client(sys.argv[1]) as c:
                st, health, models = await c.status(), await c.health(), await c.models()
                await c.load("tiny")
            return st, health, models

        st, health, models = asyncio.run(control())
        assert "cpu" in st["devices"] and health["serving"] and [m["name"] for m in models] == ["tiny"]
        no_torch("by async control calls")
        with SyncClient(sys.argv[1]) as c:
            assert c.status()["devices"]["cpu"]["used"] > 0 and c.health()["serving"]
        no_torch("by a SyncClient")
        # The attach half's pure part (the reply's reading, the arena records) comes with
        # the first attach, not with every control client (client/core.py says why).
        assert "weightcache.protocol.arena" not in sys.modules
        print("OK")
    """, d.socket)
    assert out.strip() == "OK"


def test_attach_imports_torch_when_first_used_and_the_tensors_work(start_daemon, ckpts):
    d = start_daemon(models={"tiny": ckpts["tiny"]})
    out = run_python("""
        import asyncio, sys
        import weightcache
        from weightcache import Client, SyncClient

        async def attach():
            async with Client(sys.argv[1]) as c:
                assert "torch" not in sys.modules
                async with c.attach("tiny") as w:
                    assert "torch" in sys.modules  # imported by the attach
                    assert isinstance(w, weightcache.AttachedModel)
                    from safetensors.torch import load_file
                    import torch

                    ref = load_file(sys.argv[2])
                    assert set(w) == set(ref) and all(torch.equal(w[k], v) for k, v in ref.items())
                    doubled = {k: v * 2 for k, v in w.items() if v.is_floating_point()}
                    # The other half of the torch path: publish, then attach what was published.
                    await c.publish("tiny-x2", doubled, fingerprint=w.fingerprint + "+x2")
                async with c.attach("tiny-x2") as p:
                    assert set(p) == set(doubled) and all(torch.equal(p[k], v) for k, v in doubled.items())
            return len(ref)

        n = asyncio.run(attach())
        assert "msgpack" in sys.modules  # imported by publish, which packs its table with it
        print("OK", n)
    """, d.socket, str(ckpts["tiny"]))
    assert out.split() == ["OK", "5"]


def test_an_engine_that_attaches_never_imports_msgpack(start_daemon, ckpts):
    # The client's frames go through its own codec (protocol/pymsgpack.py): msgpack's
    # import was 1.3-1.8 ms of a fresh engine's span on the 2-core VM. Nor
    # does a SyncClient engine import the asyncio client (client/aio.py).
    d = start_daemon(models={"tiny": ckpts["tiny"]})
    out = run_python("""
        import sys
        import torch
        from safetensors.torch import load_file
        from weightcache import SyncClient

        with SyncClient(sys.argv[1]) as c, c.attach("tiny") as w:
            ref = load_file(sys.argv[2])
            assert set(w) == set(ref) and all(torch.equal(w[k], v) for k, v in ref.items())
            assert c.status()["leases"] == 1
        assert "msgpack" not in sys.modules, "the engine imported msgpack"
        assert "weightcache.client.aio" not in sys.modules, "a SyncClient engine imported the asyncio client"
        print("OK", len(ref))
    """, d.socket, str(ckpts["tiny"]))
    assert out.split() == ["OK", "5"]


def test_the_torch_names_are_lazy_attributes():
    assert {"AttachedModel", "load_into_module", "empty_parameters"} <= set(dir(weightcache.client))
    from weightcache.client.mapping import AttachedModel
    from weightcache.client.torch_utils import load_into_module

    assert weightcache.client.AttachedModel is AttachedModel
    assert weightcache.load_into_module is load_into_module
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        weightcache.client.nope  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        weightcache.nope  # noqa: B018


def test_the_client_and_its_gpu_half_import_nothing_heavy():
    # An engine pays for every import on its restart path: importing cuda-bindings for
    # the driver calls cost 15.5-16 ms on the H200; the ctypes binding
    # (client/libcuda.py) costs nothing that torch has not imported already.
    out = run_python("""
        import sys
        import torch
        before = set(sys.modules)
        from weightcache import Client, SyncClient
        from weightcache.client import cuda_mapping, libcuda, mapping
        print(" ".join(sorted({m.split(".")[0] for m in set(sys.modules) - before})))
    """)
    extra = {m for m in out.split() if m not in sys.stdlib_module_names and m != "weightcache"
             and not m.startswith(("_cython", "cython_runtime"))}
    assert not extra, f"the client imported {sorted(extra)}"


def test_an_engine_with_torch_imports_the_attach_half_while_it_connects(start_daemon, ckpts):
    # connection.py's import_attach_half: the first attach's imports fill the wait for the
    # hello reply instead of adding to the attach, in the connecting thread (no thread of
    # its own: none is left running); the attach still works.
    d = start_daemon(models={"tiny": ckpts["tiny"]})
    out = run_python("""
        import sys, threading
        import torch
        from weightcache import SyncClient

        assert "weightcache.client.mapping" not in sys.modules
        threads = threading.active_count()
        with SyncClient(sys.argv[1]) as c:
            assert "weightcache.client.mapping" in sys.modules, "connecting did not import the attach half"
            assert threading.active_count() == threads, "connecting started a thread"
            with c.attach("tiny") as w:
                assert len(w) > 0
        print("OK")
    """, d.socket)
    assert out.strip() == "OK"



def test_a_sync_engine_without_torch_imports_no_asyncio(start_daemon, ckpts):
    # asyncio's import was ~20-29 ms of a fresh process on the 2-core VM, and a blocking
    # engine never runs a loop; torch imports asyncio itself, so only an engine without
    # torch (a numpy one, a tool that checks a model) saw the cost, but it saw all of it.
    d = start_daemon(models={"tiny": ckpts["tiny"]})
    out = run_python("""
        import sys
        from weightcache import SyncClient

        with SyncClient(sys.argv[1]) as c:
            names = [m["name"] for m in c.models()]
        leaked = sorted(m for m in sys.modules if m == "asyncio" or m.startswith("asyncio."))
        print("OK", "tiny" in names, " ".join(leaked) or "-")
    """, d.socket)
    assert out.split() == ["OK", "True", "-"], out
