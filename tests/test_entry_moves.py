"""An entry's states move only through the table ``MOVES`` (cache/eviction.py): each legal
move applies, every other (state, event) pair raises IllegalMove and changes nothing, and
the core, driven through its public methods, makes every move the table lists."""

import pytest

from weightcache.cache import CacheCore, State
from weightcache.cache.eviction import MOVES, Entry, EntryEvent, IllegalMove
from weightcache.errors import InternalError

LEGAL = [(state, event, new) for state, moves in MOVES.items() for event, new in moves.items()]
ILLEGAL = [(state, event) for state in State for event in EntryEvent if event not in MOVES[state]]


@pytest.mark.parametrize(("state", "event", "new"), LEGAL, ids=[f"{s}-{e}" for s, e, _ in LEGAL])
def test_each_legal_move_applies(state, event, new):
    e = Entry(name="m", device="cpu", state=state)
    assert e.move(event) is new and e.state is new


@pytest.mark.parametrize(("state", "event"), ILLEGAL, ids=[f"{s}-{e}" for s, e in ILLEGAL])
def test_an_illegal_move_raises_and_changes_nothing(state, event):
    e = Entry(name="m", device="cpu", state=state)
    with pytest.raises(IllegalMove) as err:
        e.move(event)
    assert isinstance(err.value, InternalError) and err.value.code == "INTERNAL"
    assert err.value.details == {"model": "m", "state": str(state), "event": str(event)}
    assert str(state) in err.value.message and str(event) in err.value.message
    assert e.state is state


def test_every_state_has_a_row_and_every_event_a_use():
    assert set(MOVES) == set(State)
    assert {event for moves in MOVES.values() for event in moves} == set(EntryEvent)


def test_the_core_makes_every_move_of_the_table(monkeypatch):
    """A scenario through CacheCore's public methods; each move it makes is recorded, and
    together they are the whole table (no row is dead, none is missing)."""
    made: list[tuple[State, EntryEvent, State]] = []
    move = Entry.move

    def recording(self: Entry, event: EntryEvent) -> State:
        before = self.state
        new = move(self, event)
        made.append((before, event, new))
        return new

    monkeypatch.setattr(Entry, "move", recording)
    t = iter(range(1, 1000))
    core = CacheCore({"cuda:0": 200}, clock=lambda: float(next(t)), host_budget=100)
    for n in "abc":
        core.register(n, "cuda:0")
    core.register("s1", "cuda:0", share="k")
    core.register("s2", "cuda:0", share="k")

    def load(name: str, nbytes: int = 100) -> None:
        core.begin_load(name, nbytes)
        core.finish_load(name)

    core.begin_load("a", 100)
    core.abort_load("a")  # LOADING -first_load_failed-> REGISTERED
    load("a")  # REGISTERED -load-> LOADING -loaded-> RESIDENT
    core.evict("a", demote=False)  # RESIDENT -evict-> EVICTED
    core.begin_load("a", 100)
    core.abort_load("a")  # EVICTED -load-> LOADING -reload_failed-> EVICTED
    load("a")
    core.evict("a")  # RESIDENT -demote-> HOST
    assert core.entry("a").state is State.HOST
    core.begin_load("a", 100)
    core.abort_load("a")  # HOST -load-> LOADING -promotion_failed-> HOST
    assert core.entry("a").state is State.HOST
    core.drop_host("a")  # HOST -drop_copy-> EVICTED
    load("s1", 50)
    core.join("s2")  # REGISTERED -join-> RESIDENT
    core.evict("s2", demote=False)  # s1 keeps the arena
    core.join("s2")  # EVICTED -join-> RESIDENT
    core.check_invariants()
    assert set(made) == set(LEGAL)
