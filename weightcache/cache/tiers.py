"""The host tier, and the step down: where a model that leaves its device goes.

Eviction moves a GPU model one tier down (Note [invariants] 4, core.py): to the host tier
if that is enabled and the model fits, dropping host copies to make room, else out.

Note [kept host copies]
-----------------------
A promotion keeps the model's host copy: the weights are read-only (engines map them
read-only, nothing writes an arena once sealed), so the copy stays equal to the device's
bytes for as long as the model is resident. Evicting it later is then a free of its device
arena (``StepDown.release``) instead of a device-to-host copy: under churn on the H200 a
promotion that needed a victim's room waited ~20 ms for the victim's first 1 GiB chunk to
be copied out (issue 12). The kept copy costs host-tier room only while nothing else
needs it: making room in the host tier drops kept copies before any HOST model's (a kept
copy's bytes are still on the device; a HOST model's are nowhere else but its files).
Stale files drop both copies (``evict(demote=False)``). A shared arena keeps none (it is
never demoted): ``finish_load``, ``join`` and the step down drop a copy whose model's
files have a second name. Room is never made by dropping copies that together would not
make it (the victim then leaves outright).
"""

from __future__ import annotations

from .entries import DeviceAccount, Entry, State, StepDown
from .policy import Candidate, Source
from .shares import Shares


class HostTier:
    def __init__(self, budget: int, devices: dict[str, DeviceAccount], entries: dict[str, Entry], shares: Shares) -> None:
        self.account = DeviceAccount(budget=budget)  # the pinned host tier (0: disabled)
        self._devices = devices  # the core's accounts, which a step down takes bytes off
        self._entries = entries
        self.shares = shares

    def drop_copy(self, e: Entry) -> None:
        """Forget ``e``'s host copy: a HOST model is then EVICTED; a RESIDENT one that kept
        its copy stays resident."""
        self.account.used -= e.nbytes
        e.host_copy = False
        if e.state is State.HOST:
            e.state = State.EVICTED

    def demotable(self, e: Candidate) -> bool:
        """Whether evicting ``e`` now would move it to the host tier (the step down's rule).
        A shared arena is not demoted: its names would have to come back together."""
        shared = isinstance(e, Entry) and self.shares.shared(e)
        return e.device != "cpu" and 0 < e.nbytes <= self.account.budget and not shared

    def comes_back_from(self, e: Candidate) -> Source:
        """Where ``e`` would be brought back from, were it evicted now (the policy prices that)."""
        return "host" if self.demotable(e) else "files"

    def step_down(self, victims: list[Entry], keep: Entry | None = None) -> StepDown:
        """Move RESIDENT victims off their device: to the host tier where it is enabled and
        they fit (dropping its LRU copies, never ``keep``'s), else out."""
        demote: list[str] = []
        evict: list[str] = []
        drop_host: list[str] = []
        release: list[str] = []
        leaving = {id(v) for v in victims}  # a victim's kept copy is its way out: never dropped for another
        for v in victims:
            v.evictions += 1
            if v.host_copy and not self.demotable(v):  # never kept where it could not step down to
                self.drop_copy(v)
                drop_host.append(v.name)
            if self.shares.sibling_in(v, State.RESIDENT) is not None:  # a name still on the arena keeps its bytes
                v.state = State.EVICTED
                evict.append(v.name)
                continue
            self._devices[v.device].used -= v.nbytes
            if v.host_copy:  # kept from its promotion: the host tier has its bytes already
                v.state = State.HOST
                v.demotions += 1
                release.append(v.name)
                continue
            if self.demotable(v):
                # Kept copies of resident models first (their bytes are still on a device),
                # then HOST models' copies, each least recently used first; none at all if
                # dropping every one would not make room (they would go for nothing).
                droppable = sorted((x for x in self._entries.values()
                                    if x.host_copy and x is not keep and (x.state is State.HOST
                                                                          or (x.state is State.RESIDENT and id(x) not in leaving))),
                                   key=lambda x: (x.state is State.HOST, x.last_used))
                if self.account.free + sum(x.nbytes for x in droppable) < v.nbytes:
                    droppable = []
                while self.account.free < v.nbytes and droppable:
                    old = droppable.pop(0)
                    self.drop_copy(old)
                    drop_host.append(old.name)
                    if old.name in demote:  # demoted earlier in this very step: never copy it at all
                        demote.remove(old.name)
                        drop_host.remove(old.name)
                        evict.append(old.name)
                        old.demotions -= 1
                    elif old.name in release:  # moved to HOST by this very step: its arena just goes
                        release.remove(old.name)
                        evict.append(old.name)
                        old.demotions -= 1
                if self.account.free >= v.nbytes:
                    v.state, v.host_copy = State.HOST, True
                    v.demotions += 1
                    self.account.used += v.nbytes
                    demote.append(v.name)
                    continue
            v.state = State.EVICTED
            evict.append(v.name)
        return StepDown(demote=tuple(demote), evict=tuple(evict), drop_host=tuple(drop_host), release=tuple(release))

    def check_invariants(self) -> None:
        """Note [invariants] 4: the host tier's bytes are its copies', within its budget."""
        assert self.account.used == sum(e.nbytes for e in self._entries.values() if e.host_copy)
        assert self.account.used <= self.account.budget
        for e in self._entries.values():
            assert e.host_copy or e.state is not State.HOST, e.name
            assert not e.host_copy or e.state in (State.HOST, State.LOADING, State.RESIDENT), e.name
