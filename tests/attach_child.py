"""A stand-in engine process for the integration tests.

usage: attach_child.py SOCKET MODEL PATH verify  -> attaches, compares with load_file, prints OK
       attach_child.py SOCKET MODEL PATH write   -> as verify, then writes through the mapping
       attach_child.py SOCKET MODEL PATH hold    -> attaches, prints ATTACHED, sleeps until killed
       attach_child.py SOCKET MODEL PATH leave   -> attaches, prints ATTACHED, exits inside the
                                                    attach block without closing anything
"""

import sys
import time

import torch
from safetensors.torch import load_file

from weightcache import SyncClient
from weightcache.checkpoint_files import discover_files

sock, model, path, mode = sys.argv[1:5]
if mode == "leave":  # an engine whose main() returns or calls sys.exit() while serving
    client = SyncClient(sock, name="child-leave")
    block = client.attach(model)
    weights = block.__enter__()
    next(iter(weights.values())).float().sum().item()  # use the weights (a kernel, on a GPU)
    print("ATTACHED", weights.lease, flush=True)
    sys.exit(0)
with SyncClient(sock, name=f"child-{mode}") as c, c.attach(model) as m:
    if mode == "hold":
        print("ATTACHED", m.lease, flush=True)
        time.sleep(3600)
    ref = {}
    for f in discover_files(path):
        ref.update(load_file(f))
    assert set(ref) == set(m), (sorted(ref)[:3], sorted(m)[:3])
    for k, v in ref.items():
        assert m[k].dtype == v.dtype and m[k].shape == v.shape, k
        assert torch.equal(m[k].cpu().view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)), k
    if mode == "write":  # write through the read-only mapping: must fail here, not in the daemon
        next(iter(m.values())).fill_(0)  # a kernel write
        torch.cuda.synchronize()
    print("OK", len(m), m.fingerprint, flush=True)
