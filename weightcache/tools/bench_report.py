"""How ``weightcache bench`` shows its results: a table on the console, and a PNG chart
drawn from the JSON object (so that ``weightcache bench --chart FILE.json`` can draw an
earlier run's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .bench_measure import INSTANTTENSOR_BACKENDS
from .bench_result import BenchResult, PeerLoaderFigures, Spread

GIB = 2**30


def write_chart(r: dict[str, Any], png: Path) -> bool:
    """A bar chart of GB/s per way of getting the weights onto the device, from the JSON
    object (:meth:`BenchResult.as_dict`). False when matplotlib is missing (it is
    optional: the numbers are in the JSON either way)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    n = r["checkpoint_bytes"]
    timed = [("load_file warm", r.get("load_file_warm_s")), ("load_file cold", r.get("load_file_cold_s")),
            ("fastsafetensors warm", r.get("fastsafetensors_warm_s")), ("fastsafetensors cold", r.get("fastsafetensors_cold_s")),
            ("runai-model-streamer warm", r.get("runai_streamer_warm_s")), ("runai-model-streamer cold", r.get("runai_streamer_cold_s")),
            *((f"InstantTensor {b} {w}", r.get(f"instanttensor_{b}_{w}_s")) for b in INSTANTTENSOR_BACKENDS
              for w in ("warm", "cold")),
            ("weightcache loader warm", r.get("loader_warm_s")), ("weightcache loader cold", r.get("loader_cold_s")),
            ("host-tier promotion", r.get("host_promote_s"))]
    rows: list[tuple[str, float]] = [(label, n / s / 1e9) for label, s in timed if s]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    ax.barh([x[0] for x in rows][::-1], [x[1] for x in rows][::-1],
            color=["#4c72b0" if "weightcache" in x[0] or "host" in x[0] else "#999999" for x in rows][::-1])
    for i, (_, v) in enumerate(rows[::-1]):
        ax.text(v, i, f" {v:.1f}", va="center")
    ax.set_xlabel("GB/s into device memory (higher is better)")
    ax.set_title(f"{r.get('gpu', 'CPU')}: {n / GIB:.1f} GiB, {r['tensors']} tensors; attach p50 {r['attach_p50_ms']:.2f} ms")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


def print_table(console: Console, r: BenchResult) -> None:
    nbytes = r.env.checkpoint_bytes

    def gbps(s: float | None) -> str:
        return "-" if not s else f"{nbytes / s / 1e9:.2f}"

    def ms(s: float) -> str:
        return f"{s * 1e3:.1f} ms"

    ckpt = f", {r.env.checkpoint} ({r.env.files} file{'s' if r.env.files != 1 else ''})" if r.env.checkpoint else ""
    t = Table(title=f"weightcache bench on {r.env.device} ({r.env.gpu or 'CPU'}), {nbytes / GIB:.2f} GiB, {r.env.tensors} tensors{ckpt}")
    t.add_column("what")
    t.add_column("time", justify="right")
    t.add_column("GB/s", justify="right")
    t.add_column("vs load_file (same run)", justify="right")
    lw, lc = r.load_file.warm_s, r.load_file.cold_s
    t.add_row("safetensors load_file, page cache warm", ms(lw), gbps(lw), "1x")
    if lc:
        t.add_row("safetensors load_file, cold", ms(lc), gbps(lc), "1x")
    loader = r.loader
    t.add_row("weightcache loader, warm", ms(loader.warm_s), gbps(loader.warm_s), f"{lw / loader.warm_s:.2f}x")
    if loader.cold_s:
        t.add_row("weightcache loader, cold", ms(loader.cold_s), gbps(loader.cold_s), f"{lc / loader.cold_s:.2f}x" if lc else "-")
    if ceiling := r.disk_ceiling.gbps:
        share = f", loader cold = {nbytes / loader.cold_s / 1e9 / ceiling:.0%} of it" if loader.cold_s else ""
        t.add_row("disk ceiling: parallel O_DIRECT reads alone", "", f"{ceiling:.2f}", share.lstrip(", "))
    if ch := r.content_hash:  # the loader in the bench's process, hash off then on, side by side
        for key, sp in ch.runs.items():
            off = ch.runs.get(f"{key.split(',')[0]}, off")
            rel = f"{sp.p50 / off.p50:.2f}x of hash off" if off is not None and sp is not off else ""
            t.add_row(f"loader in process, {ch.kinds.get(key, key.split(',')[0])} arena, content hash {key.split(', ', 1)[1]} "
                      f"(p50 of {len(sp.runs)}, range)", _range(sp, 1e3, "ms"), gbps(sp.p50), rel)
        t.add_row(f"  xxh3-128 one thread; a Python loop's pace while a thread hashes (GIL released: ~1; "
                  f"while one copies with bytes(): {ch.gil_pace_copy:.2f})", f"{ch.gil_pace:.2f}", f"{ch.xxh3_GBps:.1f}", "")
    for label, peer in _peers(r):
        _peer_rows(t, label, peer, lw, lc, ms, gbps)
    if (host := r.host_tier) and host.promote_s:
        t.add_row("host tier: demote (device -> pinned host)", ms(host.demote_s), gbps(host.demote_s), "")
        t.add_row("host tier: promote (pinned host -> device)", ms(host.promote_s), gbps(host.promote_s), f"{lw / host.promote_s:.2f}x")
    a = r.attach
    faster = lw * 1e3 / a.p50_ms  # below 1 only for a checkpoint of a few KiB (--checkpoint)
    t.add_row(f"attach p50 (n={a.n})", f"{a.p50_ms:.2f} ms", "", f"{faster:.0f}x faster than warm" if faster >= 2 else f"{faster:.2f}x")
    t.add_row("attach p99", f"{a.p99_ms:.2f} ms", "", "")
    if rd := r.ready:
        n = len(rd.attach_s.runs)
        t.add_row(f"ready to compute: load_file + read every byte, warm (p50 of {n}, range)", _range(rd.load_file_s, 1e3, "ms"), "", "1x")
        t.add_row(f"ready to compute: attach + read every byte (p50 of {n}, range)", _range(rd.attach_s, 1e3, "ms"), "",
                  f"{rd.ratio:.2f}x")
        if rd.resident_ratio is not None:
            t.add_row(f"host memory holding the served model ({rd.arena} arena), over the file's size", f"{rd.resident_ratio:.3f}x", "", "")
    else:  # a run from before the ready-to-compute row
        lt = r.load_file.touch_warm_s
        t.add_row("load_file + read every byte once, warm", ms(lt), "", "1x")
        t.add_row("attach + read every byte once", ms(a.touch_s), "", f"{lt / a.touch_s:.2f}x")
    if f := r.fresh_attach:
        n = len(f.connect_ms.runs)
        base = f.load_file_ms.p50 if f.load_file_ms else None
        t.add_row(f"fresh process: import the client -> first usable tensors (p50 of {n}, range)", _range(f.import_to_tensors_ms, 1, "ms"),
                  "", _vs_load_file(f.import_to_tensors_ms.p50 / base) if base else "")
        if f.load_file_ms:
            t.add_row("  fresh process: import safetensors + load_file -> usable tensors", _range(f.load_file_ms, 1, "ms"), "", "1x")
        if f.cuda_ipc_ms:
            t.add_row("  fresh process: torch CUDA IPC handles -> usable tensors", _range(f.cuda_ipc_ms, 1, "ms"), "",
                      f"attach {f.import_to_tensors_ms.p50 / f.cuda_ipc_ms.p50:.2f}x of it")
        t.add_row(f"  fresh process: connect -> first usable tensors (p50 of {n}, range)", _range(f.connect_to_tensors_ms, 1, "ms"), "", "")
        for label, sp in (("import the client on top of torch", f.import_client_ms), ("connect", f.connect_ms),
                          ("first attach", f.first_attach_ms), ("second attach, same process", f.second_attach_ms)):
            t.add_row(f"  fresh process: {label}", _range(sp, 1, "ms"), "", "")
    rs = r.restart
    t.add_row("engine restart: floor (spawn+import torch)", f"{rs.floor.ready_s:.3f} s", "", "")
    t.add_row("engine restart: with load_file", f"{rs.disk.ready_s:.3f} s", "", "")
    t.add_row("engine restart: with attach", f"{rs.cache.ready_s:.3f} s", "", f"floor {rs.cache_minus_floor_ms:+.0f} ms")
    s = r.control_plane.status_during_load
    t.add_row(f"status during a {r.control_plane.big_bytes / GIB:.1f} GiB cold load (n={s.n})",
              f"p50 {s.p50_ms:.2f} / p99 {s.p99_ms:.2f} / max {s.max_ms:.2f} ms", "", "")
    console.print(t)
    for note in r.notes:
        console.print(note)
    if r.ready and r.ready.arena_note:
        console.print(f"the daemon copied the model into a {r.ready.arena} arena, not its files' page cache: {r.ready.arena_note}")
    for label, peer in _peers(r):
        if peer is not None and peer.error:
            console.print(f"{label}: {'failed' if peer.warm_s else 'skipped'}: {peer.error}")
    if r.fresh_attach and r.fresh_attach.lazy_imports:
        console.print(f"fresh process: packages first imported by connect or the first attach: {', '.join(r.fresh_attach.lazy_imports)}")
    console.print(f"disk and cache restarts saw identical weights: {rs.checksums_equal}; "
                  f"extra device memory of an attached client: {rs.attached_client_extra_device_bytes}")


def _peers(r: BenchResult) -> list[tuple[str, PeerLoaderFigures | None]]:
    """The other loaders' figures, with the label each row shows."""
    return [("fastsafetensors", r.fastsafetensors), ("runai-model-streamer", r.runai_streamer),
            *((f"InstantTensor {p.name.split('_', 1)[1]}", p) for p in r.instanttensor)]


def _vs_load_file(ratio: float) -> str:
    """A time over load_file's: as a ratio near it, as "N x faster" far below it (0.00x
    said nothing of a GPU's 8 ms against 2.4 s)."""
    return f"{1 / ratio:.0f}x faster than load_file" if ratio < 0.1 else f"{ratio:.2f}x load_file"


def _range(sp: Spread, scale: float, unit: str) -> str:
    """The figures (times ``scale``) as "p50 (min-max) unit"."""
    digits = 2 if sp.p50 * scale < 10 else 1
    return f"{sp.p50 * scale:.{digits}f} ({min(sp.runs) * scale:.{digits}f}-{max(sp.runs) * scale:.{digits}f}) {unit}"


def _peer_rows(t: Table, label: str, peer: PeerLoaderFigures | None, lw: float, lc: float | None, ms: Any, gbps: Any) -> None:
    if peer is None or not peer.warm_s:
        if peer is not None:
            t.add_row(f"{label}: skipped", "", "", "(reason below)")
        return
    name = f"{label} {peer.version}" if peer.version else label
    t.add_row(f"{name}, warm", ms(peer.warm_s), gbps(peer.warm_s), f"{lw / peer.warm_s:.2f}x")
    if peer.cold_s:
        t.add_row(f"{name}, cold", ms(peer.cold_s), gbps(peer.cold_s), f"{lc / peer.cold_s:.2f}x" if lc else "-")
