"""The io pool: opening and parsing what peers name or send, in bounded threads apart
from the loads' fills, with a fair share per tenant and a timeout; a parse charged to
its tenants' quotas while it runs (``parse_charged``); and the GIL rules that keep the
event loop responsive while those threads run Python."""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ...cache import CacheCore
from ...config import DaemonConfig
from ...errors import LoadFailed
from ...loader import Checkpoint, OpenedSource, parse_checkpoint
from ...loader.checkpoint import gc_paused, header_lengths, parse_cost

log = logging.getLogger("weightcache.daemon")
T = TypeVar("T")

# Fair shares: the GIL is the daemon's one CPU, shared by the event loop and every
# thread. One tenant's loads of 100k-tensor headers pushed another tenant's attach p99
# from ~6 to 332 ms (python -m benchmarks abuse --only headerbomb): in a thread that parses
# such a header the cyclic collector ran 20 full collections per parse, each holding the
# GIL for up to 250 ms against the loop (the loop's sleep(1 ms) late by 253 ms; 22 ms
# with the collector paused), and msgpack packed the whole table in one C call (62-180
# ms). So the work a big checkpoint makes is done with the collector paused (nothing it
# builds forms a cycle), the table is packed in slices (loader/tensor_table.wire_table),
# each tenant gets a bounded share of the io pool (TENANT_IO_SHARE), and big headers are
# parsed in a worker process (loader/parse_worker.py).
MANY_TENSORS = 4096  # checkpoints with more are filled with the collector paused, and queue for the device's fill
SWITCH_INTERVAL_S = 0.0005
# The most of the io pool's threads one tenant's calls hold at once (IoPool.run): one of
# the default four. Beside two connections of one tenant loading 100k-tensor files, a
# share of half let both parse at once: the daemon's RSS peaked 317 MiB above its start,
# 175 MiB with a quarter, and another tenant's attach p50 went 4.2 -> 3.2 ms
# (benchmarks abuse --only headerbomb; p99 25-34 ms either way, within run-to-run noise).
TENANT_IO_SHARE = 0.25


def collector_paused(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` run with the cyclic collector paused (counted across threads: loader/checkpoint.gc_paused)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> T:
        with gc_paused():
            return fn(*args, **kwargs)

    return run


class IoPool:
    def __init__(self, settings: DaemonConfig) -> None:
        self.settings = settings
        self.pool = ThreadPoolExecutor(settings.io_threads, thread_name_prefix="wc-io")
        self._shares: dict[int, list[Any]] = {}  # tenant uid -> [its semaphore, calls holding or waiting for it]
        # The GIL is handed to a waiting thread after this long (CPython's default: 5 ms).
        # The event loop waits that long for it at each wake-up while a thread runs Python
        # (a parse, a fill of many tensors): another tenant's attach, several wake-ups,
        # had p99 161 ms beside 100k-tensor loads; 56 ms at 0.5 ms (benchmarks abuse --only
        # headerbomb, 2-core VM). Process-wide, set once here where the threads are made.
        sys.setswitchinterval(SWITCH_INTERVAL_S)

    async def run(self, fn: Callable[..., T], *args: Any, cleanup: Callable[[T], object] | None = None,
                  tenant: int | None = None, **kwargs: Any) -> T:
        """Run ``fn`` in the bounded io pool, for at most io_timeout_s: opening and parsing
        what a peer names or sends. A call that overruns is abandoned (a thread cannot be
        killed); ``cleanup`` then releases what it returns when it finally does.

        ``tenant``: the uid the work is for (a peer's model or publish; None for the
        operator's): at most TENANT_IO_SHARE of the pool's threads work for one tenant at
        once, counted until each thread returns (an abandoned call's too), the rest of its
        calls wait their turn here (not counted in io_timeout_s), so another tenant's cold
        load never queues behind one tenant's parses."""
        if tenant is None:
            return await self._run(fn, args, kwargs, cleanup)
        share = self._shares.get(tenant)
        if share is None:
            share = self._shares[tenant] = [asyncio.Semaphore(max(1, int(self.settings.io_threads * TENANT_IO_SHARE))), 0]
        share[1] += 1
        try:
            await share[0].acquire()
        except BaseException:  # cancelled while waiting its turn
            self._leave(tenant, share)
            raise

        def thread_done() -> None:
            # The slot is the thread's, not the caller's: a call abandoned (its caller gone,
            # or past io_timeout_s) keeps its thread busy until it returns, and a register
            # sent and hung up in a loop had its parses run past the tenant's share.
            share[0].release()
            self._leave(tenant, share)

        return await self._run(fn, args, kwargs, cleanup, thread_done)

    def _leave(self, tenant: int, share: list[Any]) -> None:
        share[1] -= 1
        if not share[1]:
            del self._shares[tenant]

    async def _run(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any],
                   cleanup: Callable[[T], object] | None, thread_done: Callable[[], None] | None = None) -> T:
        try:
            fut = asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))
        except BaseException:  # the pool is shut down: no thread took it
            if thread_done is not None:
                thread_done()
            raise
        if thread_done is not None:
            fut.add_done_callback(lambda _f: thread_done())
        timeout = self.settings.io_timeout_s

        def abandoned(f: asyncio.Future[T]) -> None:
            # Nobody awaits it any more: retrieve its error (else asyncio logs "never
            # retrieved"), and release what it opened.
            if f.cancelled() or f.exception() is not None:
                return
            if cleanup is not None:
                cleanup(f.result())

        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.CancelledError:
            fut.add_done_callback(abandoned)  # the caller went (shutdown, a cancelled check)
            raise
        except TimeoutError:
            fut.add_done_callback(abandoned)
            log.error("%s did not finish within io_timeout_s=%gs; abandoned", getattr(fn, "__name__", fn), timeout)
            raise LoadFailed(f"opening or parsing did not finish within {timeout:g}s (io_timeout_s)",
                             reason="io timeout") from None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


async def parse_charged(io: IoPool, core: CacheCore, opened: OpenedSource, *, uid: int | None, tenants: tuple[str, ...],
                        device: str, what: str) -> Checkpoint:
    """parse_checkpoint in the io pool (``uid``'s share of it), its cost charged to
    ``tenants``' quotas on ``device`` while it runs (Note [quotas] in cache/eviction.py),
    counted from the headers' length fields before any header is read; NoSpace naming
    the quota if it does not fit. The operator's models (no tenants) are charged nothing."""
    token = None
    if tenants and device in core.devices:
        lengths = await io.run(header_lengths, opened, tenant=uid)
        token = core.charge_parse(tenants, device, parse_cost(sum(n for _st, n, _head in lengths)), what)
    try:
        return await io.run(collector_paused(parse_checkpoint), opened, tenant=uid)
    finally:
        if token is not None:
            core.release_parse(token)
