"""server/registry.py's placement (entries_for) and the peer-copy choice of server/residency/flight.py over several fake GPUs,
without a daemon: the registry, core and loads rooms are real, the backends stand-ins
that only name their device, report free memory and say whom they can copy from."""

import pytest

from weightcache.cache import CacheCore
from weightcache.config import ModelConfig, Settings
from weightcache.errors import BadRequest
from weightcache.server import registry
from weightcache.server.registry import Registry
from weightcache.server.residency import Residency

GPUS = [f"cuda:{i}" for i in range(3)]


class FakeGpu:
    """What placing and the peer-copy choice ask of a backend."""

    def __init__(self, device, free=1 << 40, peers=True):
        self.device, self.uuid, self.free, self.peers = device, None, free, peers
        self.asked = 0  # free_memory calls: driver calls on the daemon's loop

    def names(self, device):
        return device == self.device

    def free_memory(self):
        self.asked += 1
        return self.free

    def can_copy_from(self, other):
        return self.peers and other is not self


def setup(**free):
    core = CacheCore(dict.fromkeys(GPUS, 100))
    backends = {d: FakeGpu(d, free.get(d.replace(":", ""), 1 << 40)) for d in GPUS}
    return core, Registry(core, backends, access=None), backends


def loaded(core, entry, nbytes):
    core.begin_load(entry, nbytes)
    core.finish_load(entry)


def test_an_auto_model_has_a_replica_per_gpu_and_is_placed_then_kept():
    core, reg, backends = setup()
    reg.register(ModelConfig(name="m", path="/m", device="auto"))
    assert reg.groups["m"] == ["m@cuda:0", "m@cuda:1", "m@cuda:2"]
    assert registry.entries_for(core, reg, backends, "m", None, None) == ["m@cuda:0"]  # all empty: device order
    loaded(core, "m@cuda:2", 10)
    asked = sum(b.asked for b in backends.values())
    assert registry.entries_for(core, reg, backends, "m", None, None) == ["m@cuda:2"]
    assert reg.placed["m"]["reason"] == "resident"
    assert sum(b.asked for b in backends.values()) == asked  # a hit asks no GPU for its free memory
    assert registry.entries_for(core, reg, backends, "m", None, "cuda:1") == ["m@cuda:1"]
    assert reg.placed["m"]["reason"] == "named"
    with pytest.raises(BadRequest, match="no budget"):
        registry.entries_for(core, reg, backends, "m", None, "cuda:7")


def test_real_free_memory_steers_the_placement():
    core, reg, backends = setup(cuda0=5, cuda1=5)  # other processes hold GPUs 0 and 1
    reg.register(ModelConfig(name="m", path="/m", device="auto"))
    loaded(core, "m@cuda:0", 50)  # known size now: 50 bytes
    core.evict("m@cuda:0")
    assert registry.entries_for(core, reg, backends, "m", None, None) == ["m@cuda:2"]


def test_tp_ranks_are_placed_together_on_distinct_gpus():
    core, reg, backends = setup()
    reg.register(ModelConfig(name="tp", device="auto", shards=[{"path": "/r0"}, {"path": "/r1"}]))
    loaded(core, "tp@1@cuda:0", 10)  # rank 1 already lives on GPU 0
    both = registry.entries_for(core, reg, backends, "tp", None, None)
    assert both[1] == "tp@1@cuda:0" and both[0].startswith("tp@0@") and not both[0].endswith("cuda:0")
    assert registry.entries_for(core, reg, backends, "tp", 0, None) == [both[0]]  # one rank alone: the same answer
    with pytest.raises(BadRequest, match="name a rank= with device="):
        registry.entries_for(core, reg, backends, "tp", None, "cuda:1")


def test_a_fixed_model_only_confirms_its_device():
    core, reg, backends = setup()
    reg.register(ModelConfig(name="f", path="/f", device="cuda:1"))
    assert registry.entries_for(core, reg, backends, "f", None, "cuda:1") == ["f"]
    with pytest.raises(BadRequest, match="lives on cuda:1, not cuda:0"):
        registry.entries_for(core, reg, backends, "f", None, "cuda:0")


def test_peer_copy_source_is_a_resident_current_replica_on_a_gpu_it_can_read():
    core, reg, backends = setup()
    reg.register(ModelConfig(name="m", path="/m", device="auto"))
    residency = Residency(Settings().daemon, core, reg, backends, lambda: False)
    flights = residency.flights
    try:
        assert flights._peer_source("m@cuda:1") is None  # nowhere resident
        loaded(core, "m@cuda:0", 10)
        reg.models["m@cuda:0"].resident.checkpoint = object()  # loaded: a checkpoint is known
        core.attach("m@cuda:0", conn=7)  # attached: served as is, whatever the files say
        assert flights._peer_source("m@cuda:1") == "m@cuda:0"
        flights.no_peer_copy.add(("cuda:1", "cuda:0"))  # a copy between these two failed once
        assert flights._peer_source("m@cuda:1") is None
        flights.no_peer_copy.clear()
        backends["cuda:1"].peers = False  # no peer access: the host tier or the files instead
        assert flights._peer_source("m@cuda:1") is None
    finally:
        residency.io.close()


def test_a_tenants_auto_model_counts_its_open_files_once():
    """Every replica of a rank reads the same open files (a peer's register with fds):
    max_files_per_uid counts them once, not once per GPU."""
    _core, reg, _ = setup()

    class Opened:
        files = [object(), object()]

    reg.register(ModelConfig(name="t", path="/t", device="auto"), origin="register", owner=1000, sources=[Opened()])
    assert len(reg.groups["t"]) == len(GPUS) and reg.files_held_by(1000) == 2


async def test_a_model_never_loaded_is_placed_by_its_files_size(tmp_path):
    """Before the first load the arena's size is unknown; its files' size stands in, so a
    device is chosen by what making room for that many bytes evicts, not by free budget alone."""
    core, reg, backends = setup()
    f = tmp_path / "m.safetensors"
    f.write_bytes(b"\0" * 50)
    reg.register(ModelConfig(name="m", path=f, device="auto"))
    for name, device, nbytes, pin in [("big", "cuda:0", 90, False), ("small", "cuda:1", 45, False),
                                      ("held", "cuda:1", 50, True), ("full", "cuda:2", 100, True)]:
        core.register(name, device, pinned=pin)
        loaded(core, name, nbytes)
    assert registry.entries_for(core, reg, backends, "m", None, None) == ["m@cuda:0"]  # size unknown: the most free
    residency = Residency(Settings().daemon, core, reg, backends, lambda: False)
    try:
        await registry.learn_sizes(core, reg, residency.io.run, "m")
    finally:
        residency.io.close()
    assert reg.size_hint["m"] == 50
    assert registry.entries_for(core, reg, backends, "m", None, None) == ["m@cuda:1"]  # evicts 45 B, not 90
    assert reg.placed["m"]["reason"] == "evicts" and reg.placed["m"]["evicts"] == ["small"]


def test_checkpoint_bytes_of_a_file_a_directory_an_index_and_fds(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "b.safetensors").write_bytes(b"x" * 20)
    (tmp_path / "index.json").write_text('{"weight_map": {"t1": "a.safetensors", "t2": "b.safetensors", "t3": "a.safetensors"}}')
    assert registry.checkpoint_bytes(tmp_path / "a.safetensors") == 10
    assert registry.checkpoint_bytes(tmp_path) == 30
    assert registry.checkpoint_bytes(tmp_path / "index.json") == 30
    assert registry.checkpoint_bytes(tmp_path / "missing") == 0  # unknown: placed as of unknown size
    import os

    fd = os.open(tmp_path / "b.safetensors", os.O_RDONLY)
    try:
        assert registry.checkpoint_bytes(tmp_path / "ignored", [fd]) == 20
    finally:
        os.close(fd)
