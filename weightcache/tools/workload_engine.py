"""One engine of ``weightcache workload``: a separate process that replays its slot's
events of a trace through the public client and checks the bytes of every attach.

    python -m weightcache.tools.workload_engine --trace T --refs R --slot K [--device cuda:0]

It prints ``ready`` once torch is imported (and its CUDA context made), then reads runs
from stdin, one JSON line each: ``{"socket", "results", "t0", "start"}``. ``t0`` is the
workload's start as a ``time.monotonic()`` value (CLOCK_MONOTONIC is one clock for every
process of the host), so a slow start is not counted as lateness. ``start`` is the first
of the slot's events to run: a replacement for a killed engine continues after the
event the killed one was in. The engine prints ``done`` after each run, and EOF ends it.

For each event (workload_trace.py) it waits until the event's time, attaches the model
and compares the attached tensors with the reference sums made from the files
(:func:`model_sums`). Then it holds the lease and detaches. Each step appends one JSON
line to the run's ``results`` file, in one ``write``, so a SIGKILLed engine leaves only
whole lines and its replacement appends to the same file. A wrong byte ends the
process at once with status 3, and the benchmark then fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .workload_trace import Event, read_trace

if TYPE_CHECKING:
    import torch

MISMATCH_EXIT = 3


def tensor_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of the tensor's bytes read as int32 (and the tail as uint8), in int64, on
    the tensor's own device: a few ms per GiB on a GPU, and exact, so the files and an
    attach agree on any device. Not a hash, but random weights of another model, a
    shifted offset or a torn copy all change it."""
    import torch

    u8 = t.detach().reshape(-1).view(torch.uint8)
    if u8.storage_offset() % 4:
        # The int32 words start at the tensor's first byte (as in the files' own tensors);
        # a tensor only dtype-aligned in its arena (a CPU page-cache arena maps the file
        # as it is) cannot be viewed so in place, so it is summed from a copy.
        u8 = u8.clone()
    n4 = u8.numel() // 4 * 4
    s = u8[:n4].view(torch.int32).sum(dtype=torch.int64)
    if n4 < u8.numel():
        s = s + u8[n4:].sum(dtype=torch.int64)
    return s


def _describe(t: torch.Tensor) -> list[Any]:
    return [str(t.dtype).removeprefix("torch."), list(t.shape)]


def model_sums(tensors: Mapping[str, torch.Tensor]) -> dict[str, list[Any]]:
    """name -> [dtype, shape, byte sum] for every tensor; one device sync for all."""
    import torch

    names = sorted(tensors)
    sums = torch.stack([tensor_sum(tensors[n]) for n in names]).tolist() if names else []
    return {n: [*_describe(tensors[n]), s] for n, s in zip(names, sums, strict=True)}


def file_sums(path: str) -> dict[str, list[Any]]:
    """:func:`model_sums` of a checkpoint as the files hold it, one tensor in memory at a time."""
    from safetensors import safe_open

    from ..checkpoint_files import discover_files

    out: dict[str, list[Any]] = {}
    for file in discover_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118  (safe_open is not a dict)
                t = f.get_tensor(key)
                out[key] = [*_describe(t), int(tensor_sum(t))]
    return out


def differences(expected: dict[str, list[Any]], got: dict[str, list[Any]]) -> list[str]:
    """What differs, one string per tensor (missing, extra, dtype/shape, bytes)."""
    bad = [f"{n}: missing" for n in sorted(set(expected) - set(got))]
    bad += [f"{n}: not in the files" for n in sorted(set(got) - set(expected))]
    for n in sorted(set(expected) & set(got)):
        e, g = expected[n], got[n]
        if e[:2] != g[:2]:
            bad.append(f"{n}: {g[0]}{g[1]} attached, {e[0]}{e[1]} in the files")
        elif e[2] != g[2]:
            bad.append(f"{n}: bytes differ (sum {g[2]} attached, {e[2]} in the files)")
    return bad


class Results:
    """Append-only JSON lines, one ``write`` per line (whole lines survive a SIGKILL)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def put(self, **rec: Any) -> None:
        os.write(self.fd, (json.dumps(rec) + "\n").encode())


def _attach_once(client: Any, model: str, device: str | None, wait_s: float, ref: dict[str, list[Any]],
                 hold: float) -> dict[str, Any]:
    """Attach, check, hold, detach. The tensors die with this frame: on CUDA their mapping
    is unmapped when the last view goes, and that must not land in the next attach's time."""
    t = time.perf_counter()
    with client.attach(model, device=device, wait_s=wait_s) as m:
        attach_s = time.perf_counter() - t
        tv = time.perf_counter()
        bad = differences(ref, model_sums(m))
        if device is not None:
            import torch  # imported by main() already: a dict lookup

            # The check's scratch stays in torch's cache otherwise: GiBs across 8 engines
            # by the first policy's end, read as daemon memory not given back.
            torch.cuda.empty_cache()
        verify_s = time.perf_counter() - tv
        rec = {"source": m.source, "attach_s": attach_s, "waited_s": m.waited_s, "verify_s": verify_s, "nbytes": m.nbytes,
               "fingerprint": m.fingerprint}
        if bad:
            return {**rec, "mismatch": bad[:10], "n_bad": len(bad)}
        time.sleep(hold)
    return rec


def _replay(args: argparse.Namespace, run: dict[str, Any], events: list[Event], refs: dict[str, Any], device: str | None) -> int:
    """One run: this slot's events from ``run["start"]`` against ``run["socket"]``'s daemon."""
    from ..client import SyncClient
    from ..errors import WeightcacheError

    t0 = float(run["t0"])
    out = Results(run["results"])
    out.put(proc=os.getpid(), start=run["start"])
    with SyncClient(run["socket"], name=f"workload-engine-{args.slot}") as client:
        for i in range(int(run["start"]), len(events)):
            ev = events[i]
            due = t0 + ev.t
            if (wait := due - time.monotonic()) > 0:
                time.sleep(wait)
            now = time.monotonic()
            if now - t0 > args.deadline_s:
                out.put(ev=i, skipped=len(events) - i)
                break
            out.put(ev=i, begin=now - t0)
            base = {"ev": i, "model": ev.model, "t": now - t0, "late_s": now - due}
            try:
                rec = _attach_once(client, ev.model, device, args.wait_s, refs[ev.model], ev.hold)
            except WeightcacheError as exc:
                out.put(**base, error=exc.code, message=str(exc)[:300], attach_s=time.monotonic() - now)
                continue
            out.put(**base, **rec)
            if "mismatch" in rec:
                print(f"WORKLOAD MISMATCH: engine {args.slot} attached {ev.model!r} (source {rec['source']}, "
                      f"fingerprint {rec['fingerprint'][:16]}) and {rec['n_bad']} tensor(s) differ from the files: "
                      f"{rec['mismatch'][:3]}", file=sys.stderr, flush=True)
                return MISMATCH_EXIT
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--refs", required=True, help="JSON: model -> {tensors: name -> [dtype, shape, sum]}")
    ap.add_argument("--slot", type=int, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--wait-s", type=float, default=30.0, help="how long an attach may wait for room (detaches)")
    ap.add_argument("--deadline-s", type=float, default=float("inf"), help="start no event later than this after t0")
    args = ap.parse_args(argv)

    events = read_trace(args.trace).for_engine(args.slot)
    with open(args.refs) as f:
        refs = {name: r["tensors"] for name, r in json.load(f).items()}
    import torch

    from ..client import mapping as _mapping  # noqa: F401  (imported now, not inside the first attach's time)

    device = None if args.device == "cpu" else args.device
    if device is None:
        # Several engines share the host's cores with the daemon's loaders: one thread each
        # for the byte check keeps them from oversubscribing the CPU.
        torch.set_num_threads(1)
    else:
        from .. import cuda_driver
        from ..client import cuda_mapping as _cuda_mapping  # noqa: F401  (as mapping, above)

        index = torch.device(device).index or 0
        torch.cuda.set_device(index)
        # The CUDA context, and the byte check's kernels (loaded lazily, into device
        # memory), before any run's clock starts and before its free-memory readings.
        model_sums({"warm-up": torch.arange(1 << 20, dtype=torch.int32, device=device)})
        torch.cuda.synchronize()
        # The wire names GPUs by UUID; resolved once here rather than in every attach's time.
        device = f"cuda:{cuda_driver.device_uuid(index)}"
    print("ready", flush=True)
    while line := sys.stdin.readline():
        if rc := _replay(args, json.loads(line), events, refs, device):
            return rc
        print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
