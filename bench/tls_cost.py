"""What mutual TLS costs on the tcp KV path (issue 49 item 6): off against on, in one run, arms
interleaved A B A B, each figure with its ratio on/off.

1. **KV transfer**: a CacheStore receiver and sender on loopback, in this process, with the ``small``
   bench model's KV geometry; one request of ``--kv-tokens`` tokens (every layer) sent ``--kv-reps``
   times per arm; the median seconds from ``bind`` to ``wait_sent``.
2. **P/D at half load**: one prefill and one decode of the ``small`` bench model on loopback (fresh
   processes per arm, ``--tls-cert/--tls-key/--tls-ca`` for "on"); first a closed loop at
   ``--saturate`` concurrent requests measures what the off cluster completes per second; then each
   arm gets Poisson arrivals at half that rate; TTFT and TPOT medians (and p90 TTFT) per arm.

    python -m pdserve.bench.tls_cost [--quick] [--out results.json]

The CPU (``lscpu``) and the load are in the record; nothing is judged here: the target (within 5% of
off) is read off the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pdserve import tls, tls_certs
from pdserve.bench import provenance
from pdserve.bench.experiments.client import send
from pdserve.bench.experiments.cluster import start_pd
from pdserve.bench.experiments.launcher import BENCH_MODELS, Launcher, bench_model
from pdserve.bench.loadgen_workload import RequestSpec
from pdserve.cachestore import CacheStoreReceiver, CacheStoreSender, CompatInfo, KVLayout, MemoryRegion

ARMS = ("off", "on", "off", "on")  # interleaved: drift on a shared machine hits both arms alike
BLOCK = 16


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))] if xs else float("nan")


# ----- 1. KV transfer ---------------------------------------------------------------------------
async def _kv_arm(files: tls.TlsFiles | None, tokens: int, reps: int) -> list[float]:
    _, _, layers, _, kv_heads, head_dim = BENCH_MODELS["small"]
    compat = CompatInfo("float32", layers, kv_heads, head_dim, BLOCK)
    nblocks = -(-tokens // BLOCK)
    layout = KVLayout(layers, nblocks, compat.block_nbytes)
    shape = (layers, nblocks, 2, BLOCK, kv_heads, head_dim)
    src, dst = torch.randn(shape), torch.zeros(shape)
    rx = CacheStoreReceiver(MemoryRegion.from_tensor(dst), layout, compat, tls=files)
    tx = CacheStoreSender(MemoryRegion.from_tensor(src), layout, compat, tls=files)
    await rx.start(), await tx.start()
    blocks = list(range(nblocks))
    times = []
    try:
        for i in range(reps + 1):  # the first opens the link (and its TLS session): not counted
            rid = f"r{i}"
            t0 = time.perf_counter()
            tx.bind(rid, rx.endpoint, rx.expect(rid, blocks, 60))
            for layer in range(layers):
                tx.store(rid, layer, blocks)
            await tx.wait_sent(rid, 60)
            await rx.wait_all(rid, 60)
            if i:
                times.append(time.perf_counter() - t0)
            rx.delete(rid), tx.delete(rid)
        if not torch.equal(src, dst):
            raise RuntimeError("the KV that arrived differs from the KV sent")
    finally:
        await tx.stop()
        await rx.stop()
    return times


def kv_transfer(files: tls.TlsFiles, tokens: int, reps: int) -> dict:
    by_arm: dict[str, list[float]] = {"off": [], "on": []}
    for arm in ARMS:
        by_arm[arm] += asyncio.run(_kv_arm(files if arm == "on" else None, tokens, reps))
    off, on = _median(by_arm["off"]), _median(by_arm["on"])
    mib = BENCH_MODELS["small"][2] * -(-tokens // BLOCK) * 2 * BLOCK * BENCH_MODELS["small"][4] \
        * BENCH_MODELS["small"][5] * 4 / 2**20
    return {"tokens": tokens, "mib": round(mib, 2), "reps_per_arm": len(by_arm["off"]),
            "median_s": {"off": off, "on": on}, "ratio_on_off": on / off}


# ----- 2. P/D TTFT / TPOT at half load ----------------------------------------------------------
def _specs(n: int, prompt: int, output: int, seed: int) -> list[RequestSpec]:
    rng = random.Random(seed)
    return [RequestSpec(prompt, output, prompt_ids=tuple(rng.randrange(1, 256) for _ in range(prompt)))
            for _ in range(n)]


def _cluster(launcher: Launcher, model: str, files: tls.TlsFiles | None):
    flags = tls.flags(files)
    return start_pd(launcher, model, 1, prefill_threads=1, decode_threads=1, num_blocks=512,
                    prefill_extra=flags, decode_extra=flags)


def pd_half_load(files: tls.TlsFiles, work: Path, n: int, prompt: int, output: int, saturate: int) -> dict:
    model = bench_model(work, "small")
    with Launcher(work / "logs-saturate") as launcher:
        cluster = _cluster(launcher, model, None)
        send(cluster.url, _specs(4, prompt, output, 99), concurrency=4)  # warm-up
        results, wall = send(cluster.url, _specs(n, prompt, output, 1), concurrency=saturate)
        capacity = sum(r.ok for r in results) / wall
    rate = capacity / 2
    rng = random.Random(7)
    arrivals, t = [], 0.0
    for _ in range(n):
        arrivals.append(t)
        t += rng.expovariate(rate)
    arms: dict[str, dict[str, list[float]]] = {a: {"ttft": [], "tpot": []} for a in ("off", "on")}
    failed, runs = 0, []
    for i, arm in enumerate(ARMS):
        with Launcher(work / f"logs-{i}-{arm}") as launcher:
            cluster = _cluster(launcher, model, files if arm == "on" else None)
            send(cluster.url, _specs(4, prompt, output, 99), concurrency=4)  # warm-up
            results, _ = send(cluster.url, _specs(n, prompt, output, 2 + i // 2), arrivals=arrivals)
        failed += sum(not r.ok for r in results)
        ttft = [r.ttft for r in results if r.ok and r.ttft is not None]
        tpot = [r.tpot for r in results if r.ok and r.tpot is not None]
        arms[arm]["ttft"] += ttft
        arms[arm]["tpot"] += tpot
        runs.append({"arm": arm, "median_ttft_s": _median(ttft), "median_tpot_s": _median(tpot)})
    out: dict = {"requests_per_arm_run": n, "prompt_tokens": prompt, "output_tokens": output,
                 "capacity_rps": capacity, "rate_rps": rate, "failed": failed, "runs": runs}
    for what in ("ttft", "tpot"):
        off, on = _median(arms["off"][what]), _median(arms["on"][what])
        out[f"median_{what}_s"] = {"off": off, "on": on}
        out[f"ratio_{what}_on_off"] = on / off
    out["p90_ttft_s"] = {a: _p90(arms[a]["ttft"]) for a in ("off", "on")}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.tls_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions and requests (a smoke run)")
    p.add_argument("--kv-tokens", type=int, default=4096)
    p.add_argument("--kv-reps", type=int, default=20)
    p.add_argument("--requests", type=int, default=40, help="requests per P/D arm run")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--saturate", type=int, default=8, help="concurrency of the capacity measurement")
    p.add_argument("--skip-pd", action="store_true", help="only the KV transfer figures")
    p.add_argument("--out", default=None, help="also write the record here (JSON)")
    a = p.parse_args(argv)
    if a.quick:
        a.kv_reps, a.requests = 5, 12
    record = {"machine": provenance.run_start(), "arms": list(ARMS)}
    with tempfile.TemporaryDirectory(prefix="pdserve-tls-cost-") as tmp:
        work = Path(tmp)
        ca = tls_certs.make_ca()
        files = tls_certs.write(str(work / "tls"), "node", tls_certs.issue(ca, "node"), ca)
        record["kv_transfer"] = kv_transfer(files, a.kv_tokens, a.kv_reps)
        print(json.dumps(record["kv_transfer"], indent=1), flush=True)
        if not a.skip_pd:
            record["pd_half_load"] = pd_half_load(files, work, a.requests, a.prompt, a.output, a.saturate)
            print(json.dumps(record["pd_half_load"], indent=1), flush=True)
    print(f"CPU: {record['machine']['cpu_model']} ({record['machine']['cpus']} CPUs), load average at start "
          f"{record['machine']['load_avg']}")
    if a.out:
        provenance.write_json(a.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
