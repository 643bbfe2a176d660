"""Experiment 6, autoscaling: `pdserve up --autoscale` against static over- and under-provisioned
clusters, the same load trace for each, one after the other.

The trace (load_trace.py): quiet, a 4x burst held as a plateau, a ramp down, quiet again;
Poisson arrivals from one seed. Every arm is a `pdserve up` with one prefill and small KV
pools (``--num-blocks``: one decode holds a couple of requests), so decode KV is what runs out
on a burst, whatever the CPU: arm ``autoscale`` starts at ``--min-decode`` and may grow to
``--max-decode``; ``over`` runs ``--max-decode`` decodes throughout, ``under`` ``--min-decode``.
Prefills run ``--no-resume``: a stream cut by a scale-down ends in an error instead of being
quietly resumed elsewhere, so it is counted.

Figures per arm (autoscale_figures.py): SLO attainment (TTFT <= --slo-ttft-ms and mean TBT <=
--slo-tbt-ms, per request; over time in --bucket-s buckets by arrival), time from the burst to
the SLO held again, requests failed and those cut mid-stream, process-seconds of prefill +
decode processes, and for ``autoscale`` the scale events, direction changes and the streams the
drained decodes finished. Targets (issue 12): attainment >= 0.95, 0 requests killed, <= 1
direction change per load change, <= 70% of the over-provisioned cluster's process-seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import threading
import time
from pathlib import Path

from pdserve.bench.loadgen_workload import RequestSpec, make_prompt_ids
from pdserve.net import free_ports

from . import autoscale_figures as fig
from . import report
from .client import send
from .launcher import LOG_ROOT, PROMPT_VOCAB, Launcher
from .load_trace import LoadTrace

ARMS = ("autoscale", "over", "under")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma list of: {', '.join(ARMS)}")
    t = parser.add_argument_group("the load trace")
    t.add_argument("--rate", type=float, default=0.25, help="quiet arrival rate, requests/s")
    t.add_argument("--burst", type=float, default=4.0, help="the burst's rate, times --rate")
    t.add_argument("--quiet-s", type=float, default=15.0, help="quiet before the burst")
    t.add_argument("--plateau-s", type=float, default=40.0, help="the burst, held")
    t.add_argument("--ramp-s", type=float, default=15.0, help="linear ramp back to --rate")
    t.add_argument("--tail-s", type=float, default=35.0, help="quiet after the ramp")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    t.add_argument("--output", type=int, default=512, help="output tokens per request")
    c = parser.add_argument_group("the clusters")
    c.add_argument("--num-blocks", type=int, default=18,
                   help="KV blocks per process (64 tokens each; a request takes 9 by default: a decode holds 2)")
    c.add_argument("--min-decode", type=int, default=1, help="decodes of 'under', and the least of 'autoscale'")
    c.add_argument("--max-decode", type=int, default=4, help="decodes of 'over', and the most of 'autoscale'")
    c.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    c.add_argument("--slo-tbt-ms", type=float, default=200.0)
    c.add_argument("--plan-interval", type=float, default=1.0, help="autoscale: seconds between decisions")
    c.add_argument("--plan-window", type=float, default=3.0, help="autoscale: seconds of metrics per decision")
    c.add_argument("--scale-down-window", type=float, default=15.0, help="autoscale: stabilisation before scaling down")
    c.add_argument("--cooldown", type=float, default=5.0, help="autoscale: seconds between a change and a scale-down")
    parser.add_argument("--bucket-s", type=float, default=5.0, help="attainment over time: bucket width (s)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/experiments"), help="output directory")


def arm_flags(arm: str, args: argparse.Namespace) -> list[str]:
    base = ["--model", "tiny", "--prefill", "1", "--num-blocks", str(args.num_blocks), "--threads", "1",
            "--prefill-extra=--no-resume"]
    if arm == "over":
        return base + ["--decode", str(args.max_decode)]
    if arm == "under":
        return base + ["--decode", str(args.min_decode)]
    return base + ["--autoscale", "--decode", str(args.min_decode), "--min-decode", str(args.min_decode),
                   "--max-decode", str(args.max_decode), "--max-prefill", "1", "--slo-ttft-ms", f"{args.slo_ttft_ms:g}",
                   "--slo-tbt-ms", f"{args.slo_tbt_ms:g}", "--plan-interval", f"{args.plan_interval:g}",
                   "--plan-window", f"{args.plan_window:g}", "--scale-down-window", f"{args.scale_down_window:g}",
                   "--cooldown", f"{args.cooldown:g}"]


class Monitor(threading.Thread):
    """Reads ``pdserve up``'s servers.json every ``every`` s: [(t since t0, {role: {state: n}})]."""

    def __init__(self, servers_json: Path, t0: float, every: float = 0.5):
        super().__init__(daemon=True)
        self.path, self.t0, self.every = servers_json, t0, every
        self.samples: list[tuple[float, dict]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                servers = json.loads(self.path.read_text())
            except (OSError, ValueError):
                servers = None
            if servers is not None:
                counts: dict[str, dict[str, int]] = {}
                for s in servers.values():
                    by_state = counts.setdefault(s["role"], {})
                    by_state[s["state"]] = by_state.get(s["state"], 0) + 1
                self.samples.append((time.perf_counter() - self.t0, counts))
            self.done.wait(self.every)


def wait_all_ready(servers_json: Path, proc, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"pdserve up exited with {proc.popen.returncode}; log {proc.log}")
        try:
            if all(s["state"] == "ready" for s in json.loads(servers_json.read_text()).values()):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"pdserve up not ready within {timeout}s; log {proc.log}")


def run_arm(arm: str, args: argparse.Namespace, specs: list[RequestSpec], arrivals: list[float]) -> dict:
    log_dir = LOG_ROOT / f"autoscale-{arm}"
    up_dir = log_dir / "up"
    port, grpc_port = free_ports(2)
    url = f"http://127.0.0.1:{port}"
    with Launcher(log_dir) as launcher:
        proc = launcher.start(f"up-{arm}", ["up", *arm_flags(arm, args), "--port", str(port), "--grpc-port",
                                            str(grpc_port), "--log-dir", str(up_dir)])
        launcher.wait_ready(proc, url + "/ready", timeout=300)
        wait_all_ready(up_dir / "servers.json", proc)
        send(url, specs[:2], concurrency=1, model="tiny")  # warm-up, not measured
        (up_dir / "autoscale.jsonl").unlink(missing_ok=True)  # decisions of the measured run only
        t0, wall0 = time.perf_counter(), time.time()
        monitor = Monitor(up_dir / "servers.json", t0)
        monitor.start()
        results, wall = send(url, specs, arrivals=arrivals, timeout=300, model="tiny")
        monitor.done.set()
        monitor.join(5)
        drained = [int(n) for f in sorted(up_dir.glob("decode-*.log"))
                   for n in re.findall(r"SIGTERM: draining (\d+) session", f.read_text(errors="replace"))]
        events = []
        if (up_dir / "autoscale.jsonl").exists():
            for line in (up_dir / "autoscale.jsonl").read_text().splitlines():
                d = json.loads(line)
                if d["desired"] != d["current"]:
                    events.append({"t": round(d["time"] - wall0, 2), "pool": d["pool"], "from": d["current"],
                                   "to": d["desired"], "reason": d["reason"]})
    return {"arm": arm, "flags": arm_flags(arm, args), "wall_s": wall,
            "results": [compact(r.to_json()) for r in results],
            "servers": monitor.samples, "scale_events": events, "sessions_finished_by_drained_decodes": drained,
            "logs": str(up_dir)}


def compact(r: dict) -> dict:
    """One request's result without its per-token gaps (their mean and max are what the figures use)."""
    gaps = r.pop("gaps", None) or []
    r["error"] = (r.get("error") or "")[:300]
    return {**r, "mean_tbt": sum(gaps) / len(gaps) if gaps else 0.0, "max_tbt": max(gaps, default=0.0)}


def workload(args: argparse.Namespace, trace: LoadTrace) -> tuple[list[RequestSpec], list[float]]:
    arrivals = trace.arrivals(args.seed)
    rng = random.Random(args.seed)
    specs = [RequestSpec(args.prompt, args.output, prompt_ids=make_prompt_ids(args.prompt, rng, PROMPT_VOCAB))
             for _ in arrivals]
    return specs, arrivals


def run(args: argparse.Namespace) -> int:
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise SystemExit(f"pdserve bench experiment autoscale: --arms takes {', '.join(ARMS)}; got {args.arms!r}")
    if not 1 <= args.min_decode <= args.max_decode:
        raise SystemExit("pdserve bench experiment autoscale: need 1 <= --min-decode <= --max-decode")
    try:
        trace = LoadTrace(args.rate, args.burst, args.quiet_s, args.plateau_s, args.ramp_s, args.tail_s)
    except ValueError as exc:
        raise SystemExit(f"pdserve bench experiment autoscale: {exc}") from None
    specs, arrivals = workload(args, trace)
    print(f"trace: {len(arrivals)} requests over {trace.duration_s:g}s ({args.rate:g} req/s quiet, "
          f"{args.rate * args.burst:g} at the burst); arms: {', '.join(arms)}")
    runs = {}
    for arm in arms:
        print(f"arm {arm}: {' '.join(arm_flags(arm, args))}", flush=True)
        runs[arm] = run_arm(arm, args, specs, arrivals)
    slo = (args.slo_ttft_ms / 1000, args.slo_tbt_ms / 1000)
    figures = {arm: fig.arm_figures(r, trace, slo, args.bucket_s) for arm, r in runs.items()}
    verdict = fig.targets(figures, trace)
    out = Path(args.out)
    png = fig.plot(runs, figures, trace, out / "autoscale.png")
    params = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    path = report.save(out, "autoscale",
                       {"params": params, "trace": {"phases": trace.phases(), "requests": len(arrivals)},
                                          "figures": figures, "targets": verdict, "plot": str(png), "runs": runs})
    for arm, f in figures.items():
        print(fig.describe(arm, f))
    for line in verdict["lines"]:
        print(line)
    print(f"wrote {path} and {png}")
    return 0
