"""pdserve's P/D on the peer experiment's trace under variants of its prefill's flags, A B B A.

    .venv/bin/python bench/tools/peer_trace_arms.py --arm always='' --arm auto='--disaggregation auto' \
        [--queue-policy qlm] [--rounds 2] [--json out.json]

``pdserve bench experiment peer --trace`` compares pdserve with vLLM's P/D; this tool compares pdserve
with itself, so a change to how pdserve serves the trace is judged by runs alternated on the same box
before it is judged against vLLM (whose own goodput moved by 10% over one day here). Each arm is a name
and the flags its prefill gets on top of the experiment's. Every run starts the pair as the experiment
does (``peer_trace_alone.start_system``: the ``small`` checkpoint, fp32, tcp, prefill on CPU 0 and decode on
CPU 1, one thread each, 16,384 tokens of KV), declares goodput's SLO to the prefill under
``--queue-policy`` (as ``--pdserve-queue-policy`` does; ``fifo`` declares nothing), warms up, and replays
the trace at its arrival times (``peer_trace.replay``). The arms run in order, reversed every other
round (A B, B A, ...), each start fresh.

Printed per run: goodput, the share of requests meeting the SLO, TTFT p50 / p99, TPOT p50, failed
requests, where the prompts were computed (the prefill's ``pdserve_disaggregation_decisions_total`` by
decision), the prompt tokens the prefill's engine computed (``pdserve_prompt_tokens_computed_total``) and
the decode's prompt blocks by source (``pdserve_kv_prompt_blocks_total``: reused, moved, computed),
and the requests that missed the SLO (by TTFT, by TBT; the prompt lengths of the late ones). At the end,
per arm the medians and their ratio to the first arm, and each round's ratio. ``--json`` keeps every
request's arrival, prompt length, TTFT and mean TBT.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

from pdserve.bench.experiments import peer_trace
from pdserve.bench.experiments.launcher import LOG_ROOT, Launcher, metric_sum, scrape
from pdserve.bench.experiments.peer_report import run_figures
from pdserve.bench.loadgen_report import summarize
from pdserve.bench.provenance import machine
from pdserve.slo.policies import POLICIES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_trace_alone import start_system  # noqa: E402 - the tools folder is not a package

DECISIONS = "pdserve_disaggregation_decisions_total"
COMPUTED = "pdserve_prompt_tokens_computed_total"  # the prefill's engine, after its prefix hits
PROMPT_BLOCKS = "pdserve_kv_prompt_blocks_total"  # the decode's prompt blocks by source: reused, moved, computed
FIGURES = ("goodput_rps", "slo_attained", "ttft_p50", "ttft_p99", "tpot_p50")


def parse_arm(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--arm {text!r}: give NAME=FLAGS (FLAGS may be empty: NAME=)")
    return name, shlex.split(flags)


def one_run(name: str, flags: list[str], trace: peer_trace.DefaultTrace, slo_flags: list[str]) -> dict:
    with Launcher(LOG_ROOT / f"peer-trace-arm-{name}") as launcher:
        url, urls, _ = start_system(launcher, "pdserve", trace.model, trace.max_len, tuple(slo_flags + flags))
        results, wall = peer_trace.replay(url, trace.work, trace.pool, trace.args)
        prefill, decode = (scrape(u) for u in urls)
    a = trace.args
    cell = run_figures(summarize(results, wall, a.slo_ttft_ms / 1000, a.slo_tbt_ms / 1000), results)
    rows = [{"i": r.index, "at": round(at, 3), "prompt": r.prompt_tokens, "ok": r.ok,
             "ttft_ms": None if r.ttft is None else round(1000 * r.ttft, 1),
             "tbt_ms": round(1000 * r.mean_tbt, 2) if r.ok else None} for r, at in zip(results, trace.work.arrivals)]
    decisions = {}
    for (metric, labels), value in prefill.items():
        if metric == DECISIONS and value:
            where = dict(labels)["decision"]
            decisions[where] = decisions.get(where, 0) + value
    out = {f: cell.get(f) for f in FIGURES}
    out.update(failed=cell["failed"], requests=cell["requests"], decisions=decisions, per_request=rows,
               missed=missed(rows, a.slo_ttft_ms, a.slo_tbt_ms),
               prefill_tokens_computed=metric_sum(prefill, COMPUTED),
               decode_prompt_blocks={src: metric_sum(decode, PROMPT_BLOCKS, source=src)
                                     for src in ("reused", "moved", "computed")})
    return out


def missed(rows: list[dict], ttft_ms: float, tbt_ms: float) -> dict:
    """The requests that missed the SLO: how many by which bound, and their prompt lengths."""
    late = [r for r in rows if r["ok"] and r["ttft_ms"] > ttft_ms]
    slow = [r for r in rows if r["ok"] and r["tbt_ms"] > tbt_ms]
    return {"ttft": len(late), "tbt": len(slow), "failed": sum(not r["ok"] for r in rows),
            "prompts_of_late": sorted(r["prompt"] for r in late)}


def _ms(seconds: float | None, digits: int = 0) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.{digits}f}"


def line(name: str, r: dict) -> str:
    return (f"{name}: goodput {r['goodput_rps']:.3f} req/s, SLO met {100 * r['slo_attained']:.1f}%, "
            f"TTFT p50 / p99 {_ms(r['ttft_p50'])} / {_ms(r['ttft_p99'])} ms, "
            f"TPOT p50 {_ms(r['tpot_p50'], 1)} ms, failed {r['failed']}/{r['requests']}, "
            f"decisions {r['decisions']}, prefill computed {r['prefill_tokens_computed']:.0f} tokens, "
            f"decode's prompt blocks {r['decode_prompt_blocks']}; missed {r['missed']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", type=parse_arm, action="append", required=True,
                   help="NAME=FLAGS for the prefill (at least two; the first is the baseline of the ratios)")
    p.add_argument("--queue-policy", choices=list(POLICIES), default="qlm",
                   help="the prefill's line under goodput's SLO, as the experiment's --pdserve-queue-policy "
                        "(default %(default)s; fifo declares no SLO)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every arm (default %(default)s)")
    p.add_argument("--json", type=Path, help="write every run and the summary here")
    args = p.parse_args()
    names = [n for n, _ in args.arm]
    if len(args.arm) < 2 or len(set(names)) != len(names):
        p.error("give at least two --arm, each with its own name")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    trace = peer_trace.default_trace()
    trace.args.warmup, trace.args.request_timeout = 2, 600.0
    trace.args.pdserve_queue_policy = args.queue_policy
    slo_flags = peer_trace.pdserve_slo_flags(trace.args)
    host = machine()
    print(f"{host['cpu_model']} ({host['cpus']} cores), load {host['load_avg_at_start'][0]:.1f}, "
          f"commit {host['git_commit']}; "
          f"{peer_trace.describe(trace.args, trace.work)}; SLO {peer_trace.slo_text(trace.args)}; "
          f"queue policy {args.queue_policy}", flush=True)
    runs = []
    for rnd in range(args.rounds):
        order = args.arm if rnd % 2 == 0 else args.arm[::-1]
        for name, flags in order:
            t0 = time.time()
            r = one_run(name, flags, trace, slo_flags)
            r.update(arm=name, round=rnd, flags=flags, started=t0)
            runs.append(r)
            print(f"round {rnd + 1} {line(name, r)}", flush=True)
    base = names[0]
    summary = {}
    for name in names:
        mine = [r for r in runs if r["arm"] == name]
        summary[name] = {f: statistics.median(v) if (v := [r[f] for r in mine if r[f] is not None]) else None
                         for f in FIGURES}
        pairs = [r["goodput_rps"] / b["goodput_rps"] for r in mine for b in runs
                 if b["arm"] == base and b["round"] == r["round"] and b["goodput_rps"]]
        summary[name]["goodput_vs_first_per_round"] = pairs
        m, b = summary[name], summary[base]
        ratio = f"{m['goodput_rps'] / b['goodput_rps']:.3f}x" if b["goodput_rps"] else "no ratio: 0 goodput"
        print(f"{name}: median goodput {m['goodput_rps']:.3f} req/s ({ratio} {base}; per round "
              f"{', '.join(f'{x:.3f}' for x in pairs)}), SLO met {100 * m['slo_attained']:.1f}%, "
              f"TTFT p50 {_ms(m['ttft_p50'])} ms, p99 {_ms(m['ttft_p99'])} ms", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": host, "workload": peer_trace.describe(trace.args, trace.work),
                                         "queue_policy": args.queue_policy, "runs": runs, "summary": summary},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
