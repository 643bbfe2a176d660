"""pdserve bench router-scale: the router and its KV index at 16-64 prefills (issue 50 item 3).

1. **target** (``target.py``): the requests/s of 64 prefills of a sim profile (``h200-llama3-8b``) on the
   conversation trace, from the profile's step model: the rate the router must carry.
2. **index** (``index_ops.py``): ``pdserve.kv_index.PrefixIndex`` alone at ``--index-sizes`` blocks over
   16 and 64 prefills: resident memory, events/s (stored, removed, through protobuf), decisions' lookups/s.
3. **serving** (``serving.py``, ``fleet.py``, ``client.py``): ``pdserve router`` pinned to one CPU
   (``--router-cpus``) before 16 and 64 stand-in prefills (one process, ``--fleet-cpus``: pdserve's own
   KV-event publisher and gRPC servicer, HTTP SSE streams as a prefill writes them, an LRU prefix cache
   whose evictions are events). The conversation trace's prompts (real lengths) are sent open loop at
   ``--rate``, each router in turn, A B A B (``--baseline-checkout``): once all through the router (its CPU
   per request and, less its idle share, what one core carries: ``serving.core_capacity``), once every
   other request through the router and the rest straight to the stand-ins (one load: the added TTFT
   p50/p99 of the router's half over the direct half; and, per request, the router's own time on the way to
   the first byte, read from the router: ``residence.py``); once per prefill count the extra hop alone
   (``hop.py``: the same bodies to a server that does nothing); a streamed window (``--stream-tokens``) gives the
   cost per relayed event; a window at ``--saturate-rate`` (0: none) what one core carries when the fleet
   keeps up. ``--rt``: the bench's processes run SCHED_FIFO (a shared box's other work waits).
   ``--profile-router``: then this checkout's router once more under cProfile, its top functions in
   ``profile-N.txt``.
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
from .hop import hop_window
from . import report
from .index_ops import measure
from .provenance_note import load_note
from .restart import restart_under_load
from .serving import Setup, core_capacity, quiet, rss_bytes, window
from .target import describe, prefills_rate

TRACE = Path(__file__).resolve().parents[1] / "traces" / "mooncake_conversation_trace.jsonl.xz"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--profile", default="h200-llama3-8b", help="sim profile of the target's prefills")
    parser.add_argument("--prefills", default="16,64", help="stand-in prefill counts, comma separated")
    parser.add_argument("--index-sizes", default="1000000,10000000", help="index sizes (blocks), comma separated")
    parser.add_argument("--serving-blocks", type=int, default=1_000_000,
                        help="blocks the stand-ins hold in all during the serving windows")
    parser.add_argument("--rate", type=float, default=40.0,
                        help="req/s of the A/B windows (half of them through the router, half direct)")
    parser.add_argument("--requests", type=int, default=400, help="requests per A/B window")
    parser.add_argument("--stream-tokens", type=int, default=64, help="tokens of the streamed window's responses")
    parser.add_argument("--saturate-rate", type=float, default=300.0,
                        help="req/s offered to find the ceiling (0: no saturation window)")
    parser.add_argument("--restart-blocks", type=int, default=10_000_000)
    parser.add_argument("--restart-prefills", type=int, default=64)
    parser.add_argument("--restart-rate", type=float, default=10.0, help="req/s sent while the router restarts")
    parser.add_argument("--restart-load-s", type=float, default=60.0, help="seconds of that load (kill at 1/4)")
    parser.add_argument("--baseline-checkout", type=Path, default=None,
                        help="another checkout (with its .venv) whose router runs A B A B against this one's")
    parser.add_argument("--rounds", type=int, default=2, help="A B rounds of the serving windows")
    parser.add_argument("--asyncio-variant", action="store_true",
                        help="also this checkout's router on the standard library's event loop (--event-loop "
                             "asyncio) in each round: what the event loop gives apart from the rest")
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
    parser.add_argument("--rt", type=int, default=0,
                        help="> 0: the client, the fleet and the routers run SCHED_FIFO at this priority (chrt -f)")
    parser.add_argument("--profile-router", action="store_true",
                        help="after the A/B windows, this checkout's router under cProfile for one more window")
    parser.add_argument("--profile-router-args", default="", help="more arguments of the profiled router")
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
    if args.rt:  # after the index phase: its CPU-bound children would inherit it
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(args.rt))
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
    turn; each gets a window of the load through it (its CPU: the KV events of its own requests only) and one
    that sends every other request through it and the rest straight to the stand-ins (the added latency).
    ``first``: also the streamed and saturation windows and the profile (once per prefill count)."""
    per = args.serving_blocks // count
    out: dict = {"prefills": count, "blocks": per * count, "evictions": evictions, "windows": []}
    bodies, _ = trace_bodies(args.trace, args.requests, 1)
    arrivals = poisson(len(bodies), args.rate, seed=count)
    routers: list[tuple[str, str | None, list[str]]] = [("branch", None, [])]
    if args.asyncio_variant:
        routers.append(("branch-asyncio", None, ["--event-loop", "asyncio"]))
    if args.baseline_checkout:
        routers.append(("baseline", str(args.baseline_checkout / ".venv" / "bin" / "pdserve"), []))
        out["baseline_commit"] = git_commit(args.baseline_checkout)
    with Launcher(logs / f"serving-{count}-{evictions}") as launcher:
        setup = Setup(launcher, count, capacity=per, preload=per, router_cpus=args.router_cpus,
                      fleet_cpus=args.fleet_cpus, nice=args.nice, rt=args.rt, evictions=evictions)
        setup.start_fleet()
        for rnd in range(args.rounds):
            for name, pdserve, extra in routers:
                start = setup.start_router(name=f"router-{name}-{rnd}", pdserve=pdserve, extra=extra)
                quiet_before = quiet(setup, 5.0)
                for via in ("router", "both"):  # the router's CPU of its own requests; then the added latency
                    w = window(setup, via, bodies, arrivals)
                    if via == "router":  # its idle share: looked at after the window (just after its start the
                        quiet_after = quiet(setup, 5.0)  # router still settles: the look before reads high)
                    w.update(router=name, round=rnd, router_start=start, router_quiet_cpu_util_before_after=[
                        quiet_before, quiet_after], router_quiet_cpu_util=quiet_after)
                    w["index_after"] = setup.index_agreement(timeout=10.0)  # no KV event lost in the window
                    out["windows"].append(w)
                    print(f"serving {count}:", json.dumps(w), flush=True)
                if rnd == 0 and name == "branch" and first:
                    out["streamed"] = streamed(args, setup, count)
                    if args.saturate_rate > 0:
                        out["saturate"] = saturate(args, setup, count)
                setup.stop_router()
        if first:  # the extra hop's own cost: the same load to a server that does nothing (hop.py)
            out["hop"] = hop_window(setup, bodies, arrivals)
            print(f"serving {count} hop:", json.dumps(out["hop"]), flush=True)
        if args.profile_router and first:
            out["profile"] = profile(args, setup, count, bodies, arrivals)
    out.update(derive(out))
    return out


def profile(args: argparse.Namespace, setup: Setup, count: int, bodies: list[bytes], arrivals: list[float]) -> dict:
    """This checkout's router under cProfile for one window (the A/B windows' load, all of it through the
    router) and one streamed window; its functions by own time and by cumulative time."""
    import io
    import pstats

    path = args.out / f"profile-{count}.prof"
    setup.start_router(name=f"router-profile-{count}", profile=path, extra=args.profile_router_args.split())
    w = window(setup, "router", bodies, arrivals)
    st = streamed(args, setup, count)
    setup.stop_router()
    text = io.StringIO()
    stats = pstats.Stats(str(path), stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(45)
    (args.out / f"profile-{count}.txt").write_text(text.getvalue())
    print(f"serving {count} profiled: {w['ok']} + {st['ok']} requests, profile in {path}", flush=True)
    return {"window": w, "streamed": st, "stats": str(path)}


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
    """Per router, per window: the added TTFT (its side of the window less the direct side), its CPU ms per
    request, and what one core carries (``core_capacity``); per relayed event (the streamed window)."""
    by: dict[str, dict] = {}
    for w in out["windows"]:
        b = by.setdefault(w["router"], {"added_ttft": [], "cpu_ms_per_request": [], "capacity": [],
                                        "residence": []})
        if w.get("residence"):
            b["residence"].append({"via": w["via"], **w["residence"]})
        d = w.get("direct")
        if w["via"] == "both" and d and w["ttft_p50_ms"] is not None and d["ttft_p50_ms"] is not None:
            b["added_ttft"].append({"p50_ms": w["ttft_p50_ms"] - d["ttft_p50_ms"],
                                    "p99_ms": w["ttft_p99_ms"] - d["ttft_p99_ms"],
                                    "router_p50_ms": w["ttft_p50_ms"], "router_p99_ms": w["ttft_p99_ms"],
                                    "direct_p50_ms": d["ttft_p50_ms"], "direct_p99_ms": d["ttft_p99_ms"]})
        if w["via"] == "router":
            b["cpu_ms_per_request"].append(w["router_cpu_ms_per_request"])
            b["capacity"].append(core_capacity(w["router_cpu_s"], w["wall_s"], w.get("router_quiet_cpu_util", 0.0),
                                               w["ok"]))
    for b in by.values():
        b["core_capacity_per_s_1_token"] = 1e3 / min(b["cpu_ms_per_request"])
        caps = [c["per_s"] for c in b["capacity"] if c["per_s"] is not None]
        b["core_capacity_per_s"] = max(caps) if caps else None
        b["marginal_ms_per_request"] = min(c["marginal_ms_per_request"] for c in b["capacity"])
    st = out.get("streamed")
    if st is not None and "branch" in by:
        base = by["branch"]["marginal_ms_per_request"]
        quiet_util = out["windows"][0].get("router_quiet_cpu_util", 0.0)
        per_req = core_capacity(st["router_cpu_s"], st["wall_s"], quiet_util, st["ok"])["marginal_ms_per_request"]
        by["branch"]["cpu_ms_per_event"] = (per_req - base) / max(1, st["stream_tokens"] - 1)
    if "baseline" in by:
        by["cpu_ratio_baseline_over_branch"] = (min(by["baseline"]["cpu_ms_per_request"])
                                                / min(by["branch"]["cpu_ms_per_request"]))
        by["marginal_ratio_baseline_over_branch"] = (by["baseline"]["marginal_ms_per_request"]
                                                     / by["branch"]["marginal_ms_per_request"])
        by["marginal_ratios_per_round"] = [a["marginal_ms_per_request"] / b["marginal_ms_per_request"]
                                           for a, b in zip(by["baseline"]["capacity"], by["branch"]["capacity"])]
    return {"by_router": by}


def restart(args: argparse.Namespace, logs: Path) -> dict:
    count = args.restart_prefills
    per = args.restart_blocks // count
    out: dict = {"prefills": count, "blocks": per * count}
    n = int(args.restart_rate * args.restart_load_s)
    bodies, _ = trace_bodies(args.trace, n, 1)
    with Launcher(logs / "restart") as launcher:
        setup = Setup(launcher, count, capacity=per, preload=per, router_cpus=args.router_cpus,
                      fleet_cpus=args.fleet_cpus, nice=args.nice, rt=args.rt)
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
