"""A stand-in engine process for the integration tests.

usage: attach_child.py SOCKET MODEL PATH verify  -> attaches, compares with load_file, prints OK
       attach_child.py SOCKET MODEL PATH write   -> as verify, then writes through the mapping
       attach_child.py SOCKET MODEL PATH hold    -> attaches, prints ATTACHED, sleeps until killed
"""

import sys
import time

import torch
from safetensors.torch import load_file

from weightcache import SyncClient
from weightcache.loader.checkpoint import discover_files

sock, model, path, mode = sys.argv[1:5]
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
