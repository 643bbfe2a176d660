"""The peer experiment's trace cell (issue 33 item 4): a real trace, scaled to this box, instead of the
prompt x output x rate grid, so pdserve's P/D and vLLM's are compared on real traffic.

With ``--trace PATH`` the experiment runs one cell, ``trace``: the trace's requests as the
trace-routing experiment builds them (``trace_workload.build_workload``: conversations sampled, a
window, lengths and time scaled, equal hash ids -> equal token blocks drawn from the checkpoint's
tokenizer), sent at their scaled arrival times to each system in turn, A B A B over ``--repeats``,
every start fresh (cold caches), after ``--warmup`` random requests of the trace's median prompt
length (random tokens: the warm-up shares no prefix with the trace). Both systems get the very same
requests at the very same offsets.

Options. The grid's options (``GRID_OPTIONS``) and the trace's (``TRACE_DEFAULTS``) exclude each
other: ``resolve`` refuses a line that mixes them, naming the strays, then fills in the defaults of
the workload chosen, also the two that differ by workload (``MODE_DEFAULTS``: the checkpoint and the
file name). The parser leaves every one of them unset (``argparse.SUPPRESS``) so that ``resolve`` can
tell what the line gave.

Why these defaults. The trace-routing experiment's scaling (1% of the hour's conversations, 185
requests with seed 0; lengths x1/8, so a trace block is 64 tokens; prompts cut at 4K, outputs at 32),
on the ``small`` peer checkpoint (the compute of trace-routing's ``small``: hidden 256, 8 layers; the
123M ``peer`` checkpoint needs about 2 s of a core per 1K-token prompt, 15 times more, and would
drown one prefill core in this trace), stretched over 120 s instead of 90 s because here one core
prefills where trace-routing had two: about 45 core-seconds of prefill after prefix hits, so roughly
40% of the prefill core on average, with the trace's bursts above it. A run is about 2.5 min
(pdserve) and 4 min (vLLM, which starts in about 100 s): 2 repeats take about 13 minutes.
The SLO of goodput: TTFT <= 2000 ms (a 4K-token prompt, the longest after the cut, takes about
1.7 s alone on one core with this model, so a lower bound would fail it on any system) and mean
time between tokens <= 100 ms (the InferenceService's default). With ``--model-size peer`` scale
both the load and the SLO up.

``--pdserve-queue-policy qlm`` (or edf) declares the same SLO to pdserve's prefill (``--slo-classes``)
and orders its line by that policy, as an InferenceService whose ``spec.slo`` states it would; the
default, fifo, declares nothing and serves in arrival order, as vLLM does.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from pdserve.bench.loadgen_report import summarize
from pdserve.bench.loadgen_workload import random_requests
from pdserve.slo.policies import POLICIES

from .client import send
from .peer_report import format_goodput, goodput_verdict, run_figures
from .trace_routing import DEFAULT_TRACE
from .trace_workload import TraceWorkload, build_workload

TRACE_CELL = "trace"
GRID_OPTIONS = ("prompt_lens", "output_lens", "rates", "load_fractions", "num_requests")
TRACE_DEFAULTS = {
    "format": "mooncake", "sample": 0.01, "window_start": 0.0, "window": None, "max_requests": None,
    "duration": 120.0, "length_scale": 0.125, "max_prompt_tokens": 4096, "max_output_tokens": 32,
    "slo_ttft_ms": 2000.0, "slo_tbt_ms": 100.0, "pdserve_queue_policy": "fifo",
}
MODE_DEFAULTS = {"model_size": ("peer", "small"), "name": ("peer", "peer-trace")}  # (grid, trace)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TRACE_DEFAULTS
    g = parser.add_argument_group("trace workload (--trace replaces the grid by one cell; see peer_trace.py)")
    g.add_argument("--trace", type=Path, default=None,
                   help=f"replay this trace instead of the grid (e.g. {DEFAULT_TRACE}); the grid's options are "
                        "then an error")
    g.add_argument("--format", choices=["mooncake", "azure"], default=argparse.SUPPRESS,
                   help="the trace's format: mooncake JSONL or azure CSV (default mooncake)")
    g.add_argument("--sample", type=float, default=argparse.SUPPRESS,
                   help=f"fraction of the conversations replayed (default {d['sample']:g})")
    g.add_argument("--window-start", type=float, default=argparse.SUPPRESS,
                   help="trace seconds where the window starts (default 0)")
    g.add_argument("--window", type=float, default=argparse.SUPPRESS,
                   help="trace seconds of the window (default: to the end)")
    g.add_argument("--max-requests", type=int, default=argparse.SUPPRESS,
                   help="at most this many requests of the window (default: all)")
    g.add_argument("--duration", type=float, default=argparse.SUPPRESS,
                   help=f"seconds the replayed arrivals span, which sets the time scale (default {d['duration']:g})")
    g.add_argument("--length-scale", type=float, default=argparse.SUPPRESS,
                   help=f"prompt and output lengths x this (default {d['length_scale']:g})")
    g.add_argument("--max-prompt-tokens", type=int, default=argparse.SUPPRESS,
                   help=f"prompts cut here after scaling (default {d['max_prompt_tokens']})")
    g.add_argument("--max-output-tokens", type=int, default=argparse.SUPPRESS,
                   help=f"outputs cut here after scaling (default {d['max_output_tokens']})")
    g.add_argument("--slo-ttft-ms", type=float, default=argparse.SUPPRESS,
                   help=f"goodput's TTFT bound (default {d['slo_ttft_ms']:g})")
    g.add_argument("--slo-tbt-ms", type=float, default=argparse.SUPPRESS,
                   help=f"goodput's bound on a request's mean time between tokens (default {d['slo_tbt_ms']:g})")
    g.add_argument("--pdserve-queue-policy", choices=list(POLICIES), default=argparse.SUPPRESS,
                   help="pdserve's prefill orders its line by this policy with goodput's bounds declared as its SLO "
                        "class (--queue-policy, --slo-classes), as an InferenceService with spec.slo would; default "
                        f"{d['pdserve_queue_policy']}: no SLO declared, first come first served, as vLLM")


def _flags(names) -> str:
    return ", ".join("--" + n.replace("_", "-") for n in names)


def resolve(args: argparse.Namespace, grid_defaults: dict) -> None:
    """Refuse options of the other workload (ValueError naming them), then fill in the chosen one's defaults."""
    given = vars(args)
    trace = given.get("trace") is not None
    stray = [n for n in (GRID_OPTIONS if trace else TRACE_DEFAULTS) if n in given]
    if stray:
        raise ValueError(f"--trace replaces the grid: drop {_flags(stray)}" if trace
                         else f"{_flags(stray)}: options of --trace (give --trace or drop them)")
    for name, value in (TRACE_DEFAULTS if trace else grid_defaults).items():
        given.setdefault(name, value)
    for name, (grid, with_trace) in MODE_DEFAULTS.items():
        if given.get(name) is None:
            given[name] = with_trace if trace else grid
    if trace:
        if not args.trace.is_file():
            raise ValueError(f"--trace {args.trace}: no such file (give its path; the Mooncake trace is "
                             f"{DEFAULT_TRACE} from the repository root)")
        for name in ("slo_ttft_ms", "slo_tbt_ms"):
            if not given[name] > 0:
                raise ValueError(f"{_flags([name])} must be > 0, got {given[name]}")
            if given["pdserve_queue_policy"] != "fifo" and given[name] != round(given[name]):
                raise ValueError(f"{_flags([name])} must be whole milliseconds with --pdserve-queue-policy "
                                 f"(an SLO class's targets are), got {given[name]}")


def pdserve_slo_flags(args: argparse.Namespace) -> list[str]:
    """The flags that declare goodput's bounds to pdserve's prefill as its SLO class, ordered by
    --pdserve-queue-policy (none for the grid, or for fifo: nothing is declared then)."""
    policy = getattr(args, "pdserve_queue_policy", "fifo")
    if args.trace is None or policy == "fifo":
        return []
    return ["--queue-policy", policy, "--slo-classes",
            json.dumps({"ttftMs": round(args.slo_ttft_ms), "tbtMs": round(args.slo_tbt_ms)})]


def max_len(args: argparse.Namespace) -> int:
    """The checkpoint's and servers' context: the longest prompt and output the cuts allow, and a margin."""
    return args.max_prompt_tokens + args.max_output_tokens + 64


def workload(args: argparse.Namespace, pool: list[int]) -> TraceWorkload:
    """The trace's requests and arrival offsets as the options scale them (ValueError on a bad window)."""
    return build_workload(args.trace, args.format, fraction=args.sample, duration_s=args.duration,
                          length_scale=args.length_scale, pool=pool, start_s=args.window_start,
                          window_s=args.window, max_requests=args.max_requests,
                          max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_output_tokens,
                          seed=args.seed)


def describe(args: argparse.Namespace, work: TraceWorkload) -> str:
    """The line every result names: the trace file, its sampling, window, time and length scaling."""
    return f"{args.trace} ({args.format}): {work.describe()}"


def replay(url: str, work: TraceWorkload, pool: list[int], args: argparse.Namespace) -> tuple[list, float]:
    """Warm up, then replay the trace once: (every request's RequestResult, the replay's wall seconds)."""
    warm = round(statistics.median(s.prompt_tokens for s in work.specs))
    if args.warmup:
        send(url, random_requests(args.warmup, warm, 8, random.Random(-warm), pool), concurrency=1,
             timeout=args.request_timeout)
    return send(url, work.specs, arrivals=work.arrivals, timeout=args.request_timeout)


def run_trace(url: str, work: TraceWorkload, pool: list[int], args: argparse.Namespace, say=print) -> dict:
    """Warm up, then replay the trace once; returns {TRACE_CELL: figures} (with goodput under the SLO)."""
    results, wall = replay(url, work, pool, args)
    summary = summarize(results, wall, args.slo_ttft_ms / 1000, args.slo_tbt_ms / 1000)
    f = run_figures(summary, results)
    say(f"  trace: {f['requests'] - f['failed']}/{f['requests']} ok, goodput {f['goodput_rps']:.2f} req/s, "
        f"TTFT p50 {(f['ttft_p50'] or 0) * 1000:.0f} ms, TPOT p50 {(f['tpot_p50'] or 0) * 1000:.1f} ms")
    return {TRACE_CELL: f}


def slo_text(args: argparse.Namespace) -> str:
    return f"TTFT <= {args.slo_ttft_ms:g} ms, mean TBT <= {args.slo_tbt_ms:g} ms"


def results(args: argparse.Namespace, work: TraceWorkload, runs: list[dict], cells: dict) -> tuple[dict, str]:
    """What the trace cell adds to the report: (JSON fields: workload, SLO, goodput verdict; the text printed,
    whose first two lines, the workload and the goodput, also title the plot)."""
    v = goodput_verdict(runs, cells, TRACE_CELL)
    doc = {"workload": describe(args, work), "slo": slo_text(args), "goodput": v}
    return doc, f"workload: {doc['workload']}\n{format_goodput(v, doc['slo'])}"
