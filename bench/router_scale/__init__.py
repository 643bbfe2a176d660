"""pdserve bench router-scale: the router and its KV index at 16-64 prefills (issue 50 item 3).

1. **target** (``target.py``): the requests/s of 64 prefills of a sim profile (``h200-llama3-8b``) on the
   conversation trace, from the profile's step model: the rate the router must carry.
2. **index** (``index_ops.py``): ``pdserve.kv_index.PrefixIndex`` alone at ``--index-sizes`` blocks over
   16 and 64 prefills: resident memory, events/s (stored, removed, through protobuf), decisions' lookups/s.
3. **serving** (``serving.py``, ``fleet.py``, ``client.py``): ``pdserve router`` pinned to one CPU
   (``--router-cpus``) before 16 and 64 stand-in prefills (one process, ``--fleet-cpus``: pdserve's own
   KV-event publisher and gRPC servicer, HTTP SSE streams as a prefill writes them, an LRU prefix cache
   whose evictions are events). The conversation trace's prompts (real lengths) are sent open loop at
   ``--rate``, through the router and straight to the stand-ins, A B A B: added TTFT p50/p99, the router's
   CPU seconds per request; a streamed window (``--stream-tokens``) gives the cost per relayed event; a
   window at ``--saturate-rate`` what one core carries.
4. **restart** (``restart.py``): the router killed and restarted under load with the index at
   ``--restart-blocks``: seconds until it listens and until its index is whole; what requests saw.

  pdserve bench router-scale --out docs/bench_raw/DATE-router-scale
  pdserve bench router-scale --prefills 16 --index-sizes 1000000 --skip-restart   # a quick look

Writes ``<out>/router_scale.json`` (provenance: bench/provenance.py) and prints the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from pdserve.bench.experiments.launcher import Launcher

from .client import poisson, trace_bodies
from . import report
from .index_ops import measure
from .provenance_note import load_note
from .restart import restart_under_load
from .serving import Setup, quiet, rss_bytes, window
from .target import describe, prefills_rate

TRACE = Path(__file__).resolve().parents[1] / "traces" / "mooncake_conversation_trace.jsonl.xz"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--profile", default="h200-llama3-8b", help="sim profile of the target's prefills")
    parser.add_argument("--prefills", default="16,64", help="stand-in prefill counts, comma separated")
    parser.add_argument("--index-sizes", default="1000000,10000000", help="index sizes (blocks), comma separated")
    parser.add_argument("--serving-blocks", type=int, default=1_000_000,
                        help="blocks the stand-ins hold in all during the serving windows")
    parser.add_argument("--rate", type=float, default=40.0, help="req/s of the A/B latency windows")
    parser.add_argument("--requests", type=int, default=400, help="requests per A/B window")
    parser.add_argument("--stream-tokens", type=int, default=64, help="tokens of the streamed window's responses")
    parser.add_argument("--saturate-rate", type=float, default=300.0, help="req/s offered to find the ceiling")
    parser.add_argument("--restart-blocks", type=int, default=10_000_000)
    parser.add_argument("--restart-prefills", type=int, default=64)
    parser.add_argument("--restart-rate", type=float, default=10.0, help="req/s sent while the router restarts")
    parser.add_argument("--restart-load-s", type=float, default=60.0, help="seconds of that load (kill at 1/4)")
    parser.add_argument("--baseline-checkout", type=Path, default=None,
                        help="another checkout (with its .venv) whose router runs A B A B against this one's")
    parser.add_argument("--rounds", type=int, default=2, help="A B rounds of the serving windows")
    parser.add_argument("--evictions", default="batched",
                        help="how the stand-ins publish evictions: batched (the engine now), per-block (before), "
                             "or both, comma separated, each on its own fleet")
    parser.add_argument("--skip-index", action="store_true")
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--skip-restart", action="store_true")
    parser.add_argument("--router-cpus", default="0")
    parser.add_argument("--fleet-cpus", default="1")
    parser.add_argument("--client-cpus", default="1")
    parser.add_argument("--nice", type=int, default=0,
                        help="niceness of this process, the fleet and the router (a shared box: -10 keeps them run)")
    parser.add_argument("--out", type=Path, required=True)


def run(args: argparse.Namespace) -> int:
    from pdserve.bench.provenance import write_json

    os.sched_setaffinity(0, {int(c) for c in args.client_cpus.split(",")})
    if args.nice:
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)
    doc: dict = {"command": "pdserve bench router-scale", "args": {k: str(v) for k, v in vars(args).items()}}
    doc["target"] = prefills_rate(args.trace, args.profile)
    print("target:", describe(doc["target"]), flush=True)
    counts = [int(c) for c in args.prefills.split(",")]
    if not args.skip_index:
        doc["index"] = []
        for blocks in (int(b) for b in args.index_sizes.split(",")):
            for servers in counts:
                row = measure("sets", blocks, servers)
                doc["index"].append(row)
                print("index:", json.dumps(row), flush=True)
    logs = args.out / "logs"
    if not args.skip_serving:
        modes = args.evictions.split(",")
        doc["serving"] = [serving(args, n, logs, mode, first=(mode == modes[0])) for n in counts for mode in modes]
    if not args.skip_restart:
        doc["restart"] = restart(args, logs)
    doc["load_note"] = load_note()
    path = write_json(args.out / "router_scale.json", doc)
    print("\n".join(report.lines(doc, doc["target"]["mean_output_tokens"])))
    print(f"wrote {path}")
    return 0


def serving(args: argparse.Namespace, count: int, logs: Path, evictions: str = "batched", first: bool = True) -> dict:
    """A B A B: this checkout's router and (``--baseline-checkout``) another's, each started on the same fleet in
    turn, each window through it paired with one straight to the stand-ins. ``first``: also the streamed and
    saturation windows (once per prefill count)."""
    per = args.serving_blocks // count
    out: dict = {"prefills": count, "blocks": per * count, "evictions": evictions, "windows": []}
    bodies, _ = trace_bodies(args.trace, args.requests, 1)
    arrivals = poisson(len(bodies), args.rate, seed=count)
    routers = [("branch", None)]
    if args.baseline_checkout:
        routers.append(("baseline", str(args.baseline_checkout / ".venv" / "bin" / "pdserve")))
        out["baseline_commit"] = git_commit(args.baseline_checkout)
    with Launcher(logs / f"serving-{count}-{evictions}") as launcher:
        setup = Setup(launcher, count, capacity=per, preload=per, router_cpus=args.router_cpus,
                      fleet_cpus=args.fleet_cpus, nice=args.nice, evictions=evictions)
        setup.start_fleet()
        for rnd in range(args.rounds):
            for name, pdserve in routers:
                start = setup.start_router(name=f"router-{name}-{rnd}", pdserve=pdserve)
                quiet_util = quiet(setup, 3.0)
                for via in ("router", "direct"):
                    w = window(setup, via, bodies, arrivals)
                    w.update(router=name, round=rnd, router_start=start, router_quiet_cpu_util=quiet_util)
                    out["windows"].append(w)
                    print(f"serving {count}:", json.dumps(w), flush=True)
                if rnd == 0 and name == "branch" and first:
                    out["streamed"] = streamed(args, setup, count)
                    out["saturate"] = saturate(args, setup, count)
                setup.stop_router()
    out.update(derive(out))
    return out


def streamed(args: argparse.Namespace, setup: Setup, count: int) -> dict:
    sbodies, _ = trace_bodies(args.trace, args.requests // 2, args.stream_tokens)
    w = window(setup, "router", sbodies, poisson(len(sbodies), args.rate / 2, seed=count + 1))
    w["stream_tokens"] = args.stream_tokens
    print(f"serving {count} streamed:", json.dumps(w), flush=True)
    return w


def saturate(args: argparse.Namespace, setup: Setup, count: int) -> dict:
    n_sat = int(args.saturate_rate * 6)
    satb, _ = trace_bodies(args.trace, n_sat, 1)
    w = window(setup, "router", satb, poisson(n_sat, args.saturate_rate, seed=count + 2))
    print(f"serving {count} saturate:", json.dumps(w), flush=True)
    return w


def git_commit(checkout: Path) -> str:
    import subprocess

    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip()


def derive(out: dict) -> dict:
    """Per router: added TTFT (its window less the direct one beside it), CPU ms per request; per relayed event."""
    wins = out["windows"]
    by: dict[str, dict] = {}
    for r, d in zip(wins[0::2], wins[1::2]):
        b = by.setdefault(r["router"], {"added_ttft": [], "cpu_ms_per_request": []})
        if r["ttft_p50_ms"] is not None and d["ttft_p50_ms"] is not None:
            b["added_ttft"].append({"p50_ms": r["ttft_p50_ms"] - d["ttft_p50_ms"],
                                    "p99_ms": r["ttft_p99_ms"] - d["ttft_p99_ms"]})
        b["cpu_ms_per_request"].append(r["router_cpu_ms_per_request"])
    for b in by.values():
        b["core_capacity_per_s_1_token"] = 1e3 / min(b["cpu_ms_per_request"])
    st = out.get("streamed")
    if st is not None:
        base = min(by["branch"]["cpu_ms_per_request"])
        by["branch"]["cpu_ms_per_event"] = (st["router_cpu_ms_per_request"] - base) / max(1, st["stream_tokens"] - 1)
    if "baseline" in by:
        by["cpu_ratio_baseline_over_branch"] = (min(by["baseline"]["cpu_ms_per_request"])
                                                / min(by["branch"]["cpu_ms_per_request"]))
    return {"by_router": by}


def restart(args: argparse.Namespace, logs: Path) -> dict:
    count = args.restart_prefills
    per = args.restart_blocks // count
    out: dict = {"prefills": count, "blocks": per * count}
    n = int(args.restart_rate * args.restart_load_s)
    bodies, _ = trace_bodies(args.trace, n, 1)
    with Launcher(logs / "restart") as launcher:
        setup = Setup(launcher, count, capacity=per, preload=per, router_cpus=args.router_cpus,
                      fleet_cpus=args.fleet_cpus, nice=args.nice)
        t = time.monotonic()
        setup.start_fleet(timeout=900)
        out["fleet_start_s"] = time.monotonic() - t
        out["first_start"] = setup.start_router()
        out["router_rss_bytes"] = rss_bytes(setup.router.popen.pid)
        print("restart: first start", json.dumps(out), flush=True)
        out["under_load"] = restart_under_load(setup, bodies, poisson(n, args.restart_rate, seed=7),
                                               kill_at_s=args.restart_load_s / 4)
        print("restart:", json.dumps(out["under_load"]), flush=True)
    return out
