"""The router's KV index alone: memory and operations/s at a given size (one process per size).

A cluster of ``servers`` prefills holds ``blocks`` blocks in all (random 64-bit hashes, the engine's
``block_hash`` values are uniform), built the way a router builds it: one snapshot per prefill.
Then, timed (best of ``repeats``):

- ``stored``: BLOCK_STORED events of ``stored_size`` hashes (a prefill's chunk of new blocks), and the
  longest single event (``worst_event_ms``: a growing set is rehashed whole inside one event);
- ``removed``: BLOCK_REMOVED events of one hash each (how the engine published evictions before an
  allocation's evictions went out in one event: the worst case);
- ``wire``: the same stored/removed mix through the router's real receiving path: a serialized
  ``KvEventBatch`` parsed and applied by ``pdserve.kv_follow``'s ``_apply`` (protobuf decode included);
- ``match``: one request's decision lookups: the prompt's ``prompt_blocks`` hashes against every prefill
  (``overlap`` per prefill, as ``Router.decide`` asks), one prefill holding half the prompt;
- ``snapshot``: rebuilding one prefill's view from its snapshot (what a router restart costs per prefill).

Memory is the process's resident set after the build less before it (``/proc/self/statm``), so it counts
the index's Python objects, not a model of them. ``run_size`` runs in a child process
(``python -m pdserve.bench.router_scale.index_ops``) so each size starts from a clean heap.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from pdserve.kv_follow import _apply
from pdserve.kv_index import REMOVED, STORED, PrefixIndex
from pdserve.protos import kv_events_pb2 as kpb

IMPLEMENTATIONS = {"sets": PrefixIndex}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _hashes(rng, n: int) -> list[int]:
    return rng.integers(-(2**63), 2**63 - 1, size=n, dtype="int64").tolist()


def _best(fn, ops: int, repeats: int) -> float:
    """Operations per second of ``fn()`` (which does ``ops`` operations), best of ``repeats``."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return ops / best


def run_size(impl: str, blocks: int, servers: int, stored_size: int = 16, prompt_blocks: int = 188,
             repeats: int = 3, seed: int = 0) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed)
    per = blocks // servers
    names = [f"10.0.{i // 250}.{i % 250}:50051" for i in range(servers)]
    # numpy arrays until applied: the index gets fresh Python ints, as it does from a parsed snapshot
    snapshots = [rng.integers(-(2**63), 2**63 - 1, size=per, dtype="int64") for _ in range(servers)]
    before = rss_bytes()
    index = IMPLEMENTATIONS[impl]()
    t = time.perf_counter()
    for name, hs in zip(names, snapshots):
        index.apply_snapshot(name, "e", 0, hs.tolist(), 64)
    build_s = time.perf_counter() - t
    held_bytes = rss_bytes() - before
    seq = {name: 0 for name in names}

    def events(kind, size, n):
        batch = []
        for i in range(n):
            name = names[i % servers]
            seq[name] += 1
            batch.append((name, seq[name], kind, _hashes(rng, size)))
        return batch

    n_ev = 20_000
    stored = events(STORED, stored_size, n_ev)
    # remove what was just stored, one hash per event, so the size stays put
    removed = []
    for name, _, _, hs in stored:
        for h in hs[: max(0, n_ev - len(removed))]:
            seq[name] += 1
            removed.append((name, seq[name], REMOVED, [h]))

    worst = [0.0]

    def apply(batch):
        clock = time.perf_counter
        for name, s, kind, hs in batch:
            t = clock()
            index.apply_event(name, "e", s, kind, hs)
            worst[0] = max(worst[0], clock() - t)

    out = {"impl": impl, "blocks": blocks, "servers": servers, "index_bytes": held_bytes,
           "bytes_per_block": held_bytes / blocks, "build_s": build_s}
    out["stored_events_per_s"] = _best(lambda: apply(stored), n_ev, 1)
    out["stored_blocks_per_s"] = out["stored_events_per_s"] * stored_size
    out["removed_events_per_s"] = _best(lambda: apply(removed), n_ev, 1)
    out["worst_event_ms"] = worst[0] * 1e3  # the longest single event of both (a set's resize lands on one)
    out["wire_events_per_s"] = _wire(index, names, seq, rng, stored_size, repeats)
    out["match_requests_per_s"] = _match(index, names, snapshots, prompt_blocks, repeats, rng)
    name0, snap0 = names[0], snapshots[0].tolist()
    out["snapshot_s_per_prefill"] = 1 / _best(lambda: index.apply_snapshot(name0, "e", seq[name0], snap0, 64),
                                              1, repeats)
    out["blocks_after"] = blocks
    return out


def _wire(index, names, seq, rng, stored_size: int, repeats: int) -> float:
    """Events/s through protobuf + kv_follow._apply: batches of 64 events (a 1:4 mix of stored:removed)."""
    wires = []
    for b in range(200):
        name = names[b % len(names)]
        evs = []
        for i in range(64):
            seq[name] += 1
            if i % 5 == 0:
                hs = _hashes(rng, stored_size)
                kind = kpb.KvEvent.BLOCK_STORED
            else:
                hs = _hashes(rng, 1)
                kind = kpb.KvEvent.BLOCK_REMOVED
            evs.append(kpb.KvEvent(epoch="e" * 32, seq=seq[name], kind=kind, block_hashes=hs))
        wires.append((name, kpb.KvEventBatch(events=evs).SerializeToString()))
    note = lambda reason: None  # noqa: E731
    # the epochs on the wire are 32 characters (uuid4 hex): the index must hold the same to apply them
    for name in names:
        view = index.view(name)
        view.epoch = "e" * 32

    def go():
        for name, data in wires:
            for ev in kpb.KvEventBatch.FromString(data).events:
                _apply(ev, name, index, note)

    rate = _best(go, 200 * 64, 1)
    for name in names:
        index.view(name).epoch = "e"
    del repeats
    return rate


def _match(index, names, snapshots, prompt_blocks: int, repeats: int, rng) -> float:
    """Requests/s of the decision's lookups: overlap(prefill, prompt) for every prefill."""
    prompts = []
    for i in range(500):
        held = snapshots[i % len(names)]
        start = int(rng.integers(0, max(1, len(held) - prompt_blocks)))
        half = prompt_blocks // 2
        prompts.append(held[start:start + half].tolist() + _hashes(rng, prompt_blocks - half))

    def go():
        for p in prompts:
            for name in names:
                index.overlap(name, p)

    return _best(go, len(prompts), repeats)


def measure(impl: str, blocks: int, servers: int, **kw) -> dict:
    """``run_size`` in a fresh child process (a clean heap for the memory figure)."""
    args = json.dumps({"impl": impl, "blocks": blocks, "servers": servers, **kw})
    done = subprocess.run([sys.executable, "-m", "pdserve.bench.router_scale.index_ops", args],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"index measurement {impl} {blocks}x{servers} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(run_size(**json.loads(sys.argv[1]))))


def eviction_cost(blocks_per_request: int = 118, requests: int = 300, rounds: int = 4, seed: int = 0) -> dict:
    """Router CPU for one request's evictions through protobuf + ``kv_follow._apply``: ``blocks_per_request``
    BLOCK_REMOVED events of one hash (per-block) against one event of them all (batched), A B per round."""
    import numpy as np

    rng = np.random.default_rng(seed)
    index = PrefixIndex()
    name = "10.0.0.1:50051"
    note = lambda reason: None  # noqa: E731
    out: dict = {"blocks_per_request": blocks_per_request, "per_block_ms": [], "batched_ms": []}
    seq = 0
    for _ in range(rounds):
        for mode in ("per_block", "batched"):
            hs = rng.integers(-(2**63), 2**63 - 1, size=blocks_per_request * requests, dtype="int64").tolist()
            index.apply_snapshot(name, "e" * 32, seq, hs, 64)
            wires = []
            for r in range(requests):
                part = hs[r * blocks_per_request:(r + 1) * blocks_per_request]
                groups = [[h] for h in part] if mode == "per_block" else [part]
                evs = []
                for g in groups:
                    seq += 1
                    evs.append(kpb.KvEvent(epoch="e" * 32, seq=seq, kind=kpb.KvEvent.BLOCK_REMOVED, block_hashes=g))
                wires.append(kpb.KvEventBatch(events=evs).SerializeToString())
            t = time.process_time()
            for data in wires:
                for ev in kpb.KvEventBatch.FromString(data).events:
                    _apply(ev, name, index, note)
            out[f"{mode}_ms"].append((time.process_time() - t) / requests * 1e3)
    out["ratio"] = min(out["per_block_ms"]) / min(out["batched_ms"])
    return out
