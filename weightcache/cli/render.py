"""What the CLI prints: JSON for scripts, and for people tables (rich) and lines in one
size convention (binary units, format_size) and one way of writing durations.

rich is imported when a table is printed, not with this module: `weightcache health`,
which probes run often, prints no table and must stay light.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..units import format_size


def finite(obj: Any) -> Any:
    """``obj`` with every NaN and infinity as None: json.dumps writes them as NaN and
    Infinity, which strict JSON parsers (jq, JSON.parse, Go) refuse."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def print_json(obj: Any) -> None:
    if isinstance(obj, dict):  # a reply's protocol fields are not the command's result
        obj = {k: v for k, v in obj.items() if k not in ("id", "ok")}
    print(json.dumps(finite(obj), indent=2, default=str, allow_nan=False))


def size(n: int | None) -> str:
    return "-" if n is None else format_size(n)


def _or_dash(v: Any) -> str:
    """A figure the daemon shows administrators only (None for anyone else)."""
    return "-" if v is None else str(v)


def duration(s: float | None) -> str:
    """``42s``, ``5m 03s``, ``2h 04m``, ``3d 02h``: seconds as people read them."""
    if s is None:
        return "-"
    n = round(s)
    for unit, unit_s, sub, sub_s in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if n >= unit_s:
            return f"{n // unit_s}{unit} {(n % unit_s) // sub_s:02d}{sub}"
    return f"{n}s"


def show(*renderables: Any) -> None:
    """Print rich renderables (tables) to stdout, never cut. On a terminal rich fits a
    table to its width, folding long cells (columns use overflow="fold"). Piped or
    redirected, rich would assume 80 columns and cut cells to "small-fp…": a script or
    a log wants whole names, so each table gets the width it needs."""
    from rich.console import Console

    console = Console()
    for r in renderables:
        if not console.is_terminal and not isinstance(r, str):
            width = Console(width=1 << 16).measure(r).maximum
            Console(width=max(width, 1)).print(r)
        else:
            console.print(r, highlight=False)


def table(*columns: str, right: tuple[str, ...] = ()) -> Any:
    from rich.table import Table

    t = Table()
    for col in columns:
        t.add_column(col, justify="right" if col in right else "left", overflow="fold")
    return t


def show_status(st: dict[str, Any]) -> None:
    """`weightcache status`: the devices' budgets, what loads, the tenants' use, and
    warnings about other daemons and memory an earlier daemon's engines still map."""
    t = table("device", "backend", "budget", "used", "reserved", "free", "content hash",
              right=("budget", "used", "reserved", "free"))
    for dev, d in st["devices"].items():
        t.add_row(dev, d["backend"], size(d["budget"]), size(d["used"]), size(d["reserved"]), size(d["free"]),
                  d.get("content_hash", ""))
    lines: list[Any] = [f"weightcache {st['version']} (pid {st['pid']}, up {duration(st['uptime_s'])}) on {st['socket']}", t,
                        f"connections: {_or_dash(st['connections'])}  leases: {_or_dash(st['leases'])}  "
                        f"resident: {len(st.get('resident', []))} (weightcache ps)"]
    for name, p in st["loading"].items():
        lines.append(f"loading {name}: {size(p['bytes_done'])} / {size(p['bytes_total'])} at {size(p['bytes_per_s'])}/s")
    if st.get("tenants"):
        lines.append(tenants_table(st["tenants"]))
    if (store := st.get("published")) is not None:  # administrators only (server/store.py)
        lines.append(f"published store {store['dir']}: {store['models']} model(s), {size(store['used'])} of "
                     f"{size(store['budget'])}")
    loop = st.get("loop")  # administrators only (server/loop_watch.py)
    if loop and loop["stalls"]:
        last = loop["recent"][0]
        where = last["loop"][-1] if last["loop"] else "not sampled"
        lines.append(f"event loop: {loop['stalls']} stall(s) >= {loop['stall_ms']:.0f} ms since start, longest "
                     f"{loop['longest_ms']:.0f} ms; the last {last['ms']:.0f} ms, {duration(last['ago_s'])} ago, at {where} "
                     "(--json has the stacks)")
        if (spent := loop["spent"])["window_ms"]:  # where the loop thread's time went in them (schedstat)
            lines.append(f"  in those stalls the loop's thread was on a CPU {spent['on_cpu_ms']:.0f} ms, runnable without a "
                         f"CPU {spent['runnable_ms']:.0f} ms, blocked {spent['blocked_ms']:.0f} ms (GIL or a blocking call)")
    show(*lines)
    for o in st.get("other_daemons", []):
        print(f"warning: another weightcache daemon runs on this host (pid {o['pid']}): each takes its own budget of the "
              "same memory; run one per host")
    for m in st.get("outlived", []):  # whole lines (rich would fold them at 80 columns when piped)
        print(f"warning: pid {m['pid']} ({m['comm']}, uid {m['uid']}) still maps {size(m['nbytes'])} of an earlier "
              f"daemon's memory ({', '.join(m['models'])}): no lease here, outside every budget until it exits")


def tenants_table(tenants: dict[str, Any]) -> Any:
    """Per tenant and device: what its models hold, of what quota; and its pins."""
    t = table("tenant", "device", "used", "quota", "pins", right=("used", "quota", "pins"))
    for name, u in tenants.items():
        pins = f"{u['pins']}" + (f" / {u['pins_quota']}" if u["pins_quota"] is not None else "")
        rows = [(dev, d) for dev, d in u["devices"].items() if d["used"] or d["quota"] is not None]
        for i, (dev, d) in enumerate(rows or [("-", {"used": 0, "quota": None})]):
            t.add_row(name if i == 0 else "", dev, size(d["used"]), "-" if d["quota"] is None else size(d["quota"]),
                      pins if i == 0 else "")
    return t


def show_models(models: list[dict[str, Any]]) -> None:
    """`weightcache models`: every registered model, with why the last load failed."""
    t = table("name", "state", "device", "size", "attached", "pinned", "source", "arena", "loads", "evictions", "last error",
              right=("size", "attached", "loads", "evictions"))
    for m in models:
        # A bad path or format is found at start and at reload, before any load: say so here,
        # not only in --json (the daemon shows the reason to owners and admins only).
        err = m.get("last_error") or {}
        placed = m.get("placement") or {}
        # device = "auto": which replica the last placement chose, and why (--json has the detail)
        device = (f"{m['device']} (auto: {placed['reason']})" if placed.get("device") == m["device"]
                  else f"{m['device']} (auto)" if m.get("replica_of") else m["device"])
        t.add_row(m["name"], m["state"], device, size(m["nbytes"] or None), str(m["attach_count"]),
                  "yes" if m["pinned"] else "", source(m), arena(m), str(m["loads"]), str(m["evictions"]),
                  f"{err.get('code', '')}: {err.get('message', '')}" if err else "")
    show(t)


def source(m: dict[str, Any]) -> str:
    """Where a model comes from: the config, a register, or a publish (kept on disk or not)."""
    origin = {"config": "config", "register": "registered", "publish": "published"}.get(m.get("origin", ""), "-")
    return f"{origin}, on disk" if m.get("on_disk") else origin


def arena(m: dict[str, Any]) -> str:
    """Where the resident copy lives, and why not in the faster arena where it was refused
    (a CPU model copied into a memfd rather than served from its files' page cache)."""
    kind = m.get("arena") or "-"
    return f"{kind}: {m['arena_note']}" if m.get("arena_note") else kind


def until(m: dict[str, Any]) -> str:
    """When keep_alive will evict a model, as `weightcache ps` shows it."""
    if m["pinned"]:
        return "never (pinned)"
    if m["state"] != "resident":
        return "-"
    if m["keep_alive"] is None:
        return "when room is needed"
    if m["attach_count"]:
        return f"{duration(m['keep_alive'])} after the last detach"
    return f"in {duration(m['expires_in_s'])}" if m.get("expires_in_s") is not None else "-"


def times(count: int) -> str:
    return f" x{count}" if count > 1 else ""


def lease_lines(m: dict[str, Any]) -> str:
    # A row per holding connection; its count of leases from daemons that send one.
    lines = [f"pid {h['pid']} {h['client']} (uid {h['uid']}){times(h.get('count', 1))}, {duration(h['since_s'])}"
             for h in m["leases"]]
    hidden = m["attach_count"] - sum(h.get("count", 1) for h in m["leases"])
    if hidden > 0:  # the daemon shows other users' holders to admins only
        lines.append(f"{hidden} of other users")
    return "\n".join(lines) or "-"


def owner(m: dict[str, Any]) -> str:
    """Whose model it is: the operator's config, or the uid that registered or published it."""
    return "config" if m.get("owner") is None else f"uid {m['owner']}"


def show_ps(resident: list[dict[str, Any]]) -> None:
    """`weightcache ps`: what holds memory now, who holds it, and until when."""
    if not resident:
        print("no model is resident")
        return
    t = table("name", "owner", "state", "device", "size", "arena", "leases (pid, client, uid, held for)", "idle", "until",
              right=("size", "idle"))
    for m in resident:
        t.add_row(m["name"], owner(m), m["state"], m["device"], size(m["nbytes"]), arena(m), lease_lines(m),
                  "-" if m["attach_count"] else duration(m["idle_s"]), until(m))
    show(t)


def show_reload(report: dict[str, Any]) -> None:
    """`weightcache reload`: what changed, what was evicted, and what did not take effect."""
    done = [f"{what}: {', '.join(report[what])}" for what in ("added", "removed", "changed", "updated", "displaced")
            if report.get(what)]
    done += [f"budgets.{b['device']}: {size(b['budget'])} (was {size(b['previous'])})" for b in report.get("budgets", [])]
    done += [f"max_loaded_models.{m['device']}: {count(m['limit'])} (was {count(m['previous'])})"
             for m in report.get("max_loaded_models", [])]
    if report.get("quotas") is not None:
        done.append(f"quotas: {', '.join(report['quotas']) or 'none'}")
    print("reloaded: " + ("; ".join(done) if done else "no changes"))
    for e in report.get("evicted", []):
        print(f"evicted: {e['name']} ({size(e['nbytes'])}{', to the host tier' if e['to'] == 'host' else ''}): {e['reason']}")
    for line in report.get("pending", []):
        print(f"pending: {line}")
    for line in report.get("failed", []):
        print(f"failed: {line}")


def count(n: int | None) -> str:
    return "no limit" if n is None else str(n)
