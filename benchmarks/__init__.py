"""The benchmark and stress tools beside ``weightcache bench``, one entry point:
``python -m benchmarks NAME [ARGS]`` (``python -m benchmarks`` lists them). Each writes its
JSON under results/ unless ``--out`` says otherwise; docs/benchmarks.md gives the command
behind every figure."""

from __future__ import annotations

# name on the command line -> (module in this package, what it measures)
TOOLS: dict[str, tuple[str, str]] = {
    "abuse": ("abuse", "tenants abusing the daemon beside a well-behaved client and another tenant (make stress)"),
    "bare-engine": ("bare_engine", "the smallest fresh engine against a fresh load_file, alternating"),
    "churn": ("churn", "200 wire-protocol clients attaching at random, some SIGKILLed (make stress)"),
    "daemon-rss": ("daemon_rss", "the daemon's RSS as a GPU budget's first loads make their staging"),
    "dead-lenders": ("dead_lenders", "what a borrowing daemon keeps (fds, UCX's CLOSED sockets) of lenders killed mid-transfer"),
    "derived-cost": ("derived_cost", "a conversion that builds tensors: in each engine, or once and attached by the rest"),
    "fresh-attach": ("fresh_attach", "a fresh engine process: import the client, connect, first attach, usable tensors"),
    "hash-contention": ("hash_contention", "what the GPU content hash takes from an engine's kernels"),
    "loader-paths": ("loader_paths", "a CUDA load from a warm page cache: staging, registered pages, InstantTensor, the daemon"),
    "multi-gpu": ("multi_gpu", "placement and a replica filled three ways on a second GPU"),
    "peer-flood": ("peer_flood", "a victim tenant's attach p99 beside each flood of the peer port, and the daemon's RSS after"),
    "peer-fill": ("peer_fill", "a miss filled from a neighbour daemon over NIXL, against files and raw NIXL"),
    "profile-loads": ("profile_loads", "each miss's phases under churn on one GPU"),
    "published-store-cost": ("published_store_cost", "what the published store costs a publish and the first attach after a restart"),
    "register-same-file": ("register_same_file", "one register of many fds of one file with a huge header: time to refuse, RSS kept"),
    "routes": ("routes", "the package files each route runs code in (attach, load, eviction)"),
    "small-tensors": ("small_tensors", "a file of 100k one-byte tensors, batched and one task a tensor"),
    "supervised-restart": ("supervised_restart", "restart to first logits: fresh, supervised, recorded modules"),
    "vllm-start": ("bench_vllm", "vLLM engine start to first token: auto, the plugin's copy, processed weights (run with the vLLM venv)"),
    "vllm-official": ("vllm_official", "processed weights, official vllm wheel on the CPU: equal to a normal load, no load or processing again"),
    "waiter-herd": ("waiter_herd", "what requests waiting for room cost a detach and others' status"),
}
