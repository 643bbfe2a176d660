"""Experiment 9, throughput mode: one process vs 2-stage pipeline (mixed batching) vs TD-Pipe.

One offline set (``--requests`` requests, ShareGPT-like log-normal prompt and output lengths
from ``--seed``, random prompt ids, greedy, ignore EOS: every request generates exactly its
output length) runs three ways on the same cores, one after the other in one command:

  single   LLMEngine, continuous batching, one process with ``--threads`` torch threads
           (``single-1t``: the same with one thread, for a machine where 2 threads lose)
  mixed    PipelineEngine, 2 stage processes (1 torch thread each) + the controller, prefills
           and decodes in the same micro-batches (hybrid batching, the usual PP baseline)
  td-pipe  the same pipeline with TD-Pipe's schedule: prefill and decode phases in time,
           memory-simulated switch to decode, intensity-compared switch back, work stealing

All three get the same KV pool (``--num-blocks`` blocks of every layer), ``--max-num-seqs``
and prefill token budget. Figures: generated tokens/s (and prompt + generated tokens/s) of
each, wall time from the first request to the last token (stage start-up and model load not
counted), CPU seconds used (every process of the configuration: on a machine shared with
other work a configuration with more processes gets a larger share of the cores, so output
tokens per CPU second is reported beside tokens/s), the stages' utilisation (busy seconds / that wall time), preemptions, whether the
greedy tokens match the single process; a timeline PNG of each pipeline's stages.
Targets (issue 15): TD-Pipe >= 1.3x mixed and >= 1.0x single.

The model: ``--model random`` (default) writes a random Llama checkpoint of ``--layers`` /
``--hidden`` (so compute, not Python, dominates a step), or ``tiny`` / a checkpoint directory.
"""  # noqa: E501

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

from pdserve.bench.loadgen_workload import LengthDistribution

from . import report

TARGET_VS_MIXED, TARGET_VS_SINGLE = 1.3, 1.0
KIND_COLORS = {0: ("prefill", "tab:blue"), 1: ("decode", "tab:orange"), 2: ("mixed", "tab:purple")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="random", help="random | tiny | a checkpoint directory")
    parser.add_argument("--layers", type=int, default=8, help="layers of the random model")
    parser.add_argument("--hidden", type=int, default=384, help="hidden size of the random model")
    parser.add_argument("--vocab", type=int, default=2048, help="vocabulary of the random model")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--prompt-median", type=int, default=96)
    parser.add_argument("--prompt-max", type=int, default=768)
    parser.add_argument("--output-median", type=int, default=96)
    parser.add_argument("--output-max", type=int, default=384)
    parser.add_argument("--sigma", type=float, default=0.8, help="spread of log(length), both lengths")
    parser.add_argument("--num-blocks", type=int, default=640, help="KV blocks (of every layer) for each configuration")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-batched-tokens", type=int, default=1024, help="prompt tokens per prefill (micro-)batch")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=0,
                        help="micro-batches in flight for td-pipe (0: --stages); mixed keeps --stages")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the single process (the cores)")
    parser.add_argument("--configs", default="single,mixed,td-pipe",
                        help="which to run, comma separated: single, single-1t (one thread), mixed, td-pipe, "
                             "td-pipe-base (td-pipe without --micro-batches / --min-decode-batch)")
    parser.add_argument("--min-decode-batch", type=int, default=8,
                        help="td-pipe: fewer decode micro-batches rather than ones under this many sequences")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every configuration this many times, alternating (the order rotates each round); "
                             "figures are each configuration's median round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench-results/experiments"), help="output directory")


def workload(args) -> list[tuple[str, list[int], int]]:
    rng = random.Random(args.seed)
    plen = LengthDistribution(args.prompt_median, args.sigma, 4, args.prompt_max)
    olen = LengthDistribution(args.output_median, args.sigma, 4, args.output_max)
    out = []
    for i in range(args.requests):
        p, o = plen.sample(rng), olen.sample(rng)
        out.append((f"r{i}", [rng.randrange(3, min(args.vocab, 250)) for _ in range(p)], o))
    return out


def _random_model(args, directory: str) -> str:
    from pdserve.engine.checkpoint import random_hf_weights, save_hf_checkpoint
    from pdserve.engine.config import ModelConfig

    heads = max(1, args.hidden // 64)
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
                      num_layers=args.layers, num_heads=heads, num_kv_heads=max(1, heads // 2),
                      max_position_embeddings=4096, architecture="LlamaForCausalLM")
    save_hf_checkpoint(random_hf_weights(cfg, seed=args.seed, std=0.05), cfg, directory)
    return directory


def run_single(model: str, reqs, args, threads: int) -> dict:
    import torch

    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model

    torch.set_num_threads(threads)
    eng = LLMEngine(load_model(model), EngineConfig(num_blocks=args.num_blocks, block_size=args.block_size,
                                                    max_num_seqs=args.max_num_seqs, enable_prefix_cache=False,
                                                    max_num_batched_tokens=args.max_batched_tokens, detokenize=False))
    for rid, ids, n in reqs:
        eng.add_request(rid, ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    load0, t0, c0 = os.getloadavg()[0], time.perf_counter(), time.process_time()
    while eng.has_unfinished():
        for o in eng.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "preemptions": eng.num_preemptions,
            "utilisation": [1.0], "load_avg": [load0, os.getloadavg()[0]]}


def run_pipeline(model: str, reqs, args, name: str) -> dict:
    """``name``: mixed, td-pipe, or td-pipe-base (TD-Pipe as before --micro-batches and
    --min-decode-batch: num_stages decode micro-batches whatever their size)."""
    from pdserve.engine import SamplingParams
    from pdserve.batch.pipeline.engine import PipelineConfig, PipelineEngine

    schedule, tuned = ("mixed", False) if name == "mixed" else ("td-pipe", name == "td-pipe")
    cfg = PipelineConfig(num_stages=args.stages, schedule=schedule, num_blocks=args.num_blocks,
                         block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_batched_tokens, threads_per_stage=1, detokenize=False,
                         micro_batches=args.micro_batches if tuned else 0,
                         min_decode_batch=args.min_decode_batch if tuned else 1)
    with PipelineEngine(model, cfg) as eng:
        for rid, ids, n in reqs:
            eng.add_request(rid, ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        load0, t0, c0 = os.getloadavg()[0], time.perf_counter(), time.process_time()
        out = eng.run()
        t1, c1 = time.perf_counter(), time.process_time()
    wall = t1 - t0
    cpu = (c1 - c0) + sum(eng.stage_cpu_s)  # the controller's and every stage's
    traces = [[(s - t0, e - t0, kind) for s, e, _, kind in tr] for tr in eng.stage_traces]
    util = [sum(e - s for s, e, _ in tr) / wall for tr in traces]
    phases = [(t - t0, p) for t, p in getattr(eng.schedule, "phases", [])]
    decode_sizes = [n for _, _, kind, n, _ in eng.batches if kind != 0]
    rtt = sorted(r - s for s, r, kind, _, _ in eng.batches if kind != 0)
    compute = sorted(sum(t) for _, _, kind, _, t in eng.batches if kind != 0)
    return {"wall_s": wall, "cpu_s": cpu, "tokens": {k: v.new_token_ids for k, v in out.items()},
            "preemptions": eng.num_preemptions,
            "utilisation": util, "traces": traces, "phases": phases, "micro_batches": len(eng.batches),
            "mean_decode_batch": sum(decode_sizes) / max(len(decode_sizes), 1),
            "phase_switches": max(len(phases) - 1, 0),
            # a decode micro-batch's round trip (controller -> stages -> controller) and its stages' compute, medians
            "decode_rtt_ms": 1e3 * rtt[len(rtt) // 2] if rtt else None,
            "decode_compute_ms": 1e3 * compute[len(compute) // 2] if compute else None,
            "load_avg": [load0, os.getloadavg()[0]]}


def run(args: argparse.Namespace) -> int:
    reqs = workload(args)
    n_prompt = sum(len(ids) for _, ids, _ in reqs)
    n_out = sum(n for _, _, n in reqs)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(configs) - {"single", "single-1t", "mixed", "td-pipe", "td-pipe-base"}
    if unknown:
        raise SystemExit(f"unknown configuration(s) {sorted(unknown)}: use single, single-1t, "
                         f"mixed, td-pipe, td-pipe-base")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        model = _random_model(args, tmp) if args.model == "random" else args.model
        for rnd in range(args.rounds):
            order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]  # alternate who runs first
            for name in order:
                print(f"throughput: round {rnd + 1}/{args.rounds}: running {name} ({args.requests} requests, "
                      f"{n_prompt} prompt + {n_out} output tokens)", flush=True)
                if name.startswith("single"):
                    r = run_single(model, reqs, args, 1 if name == "single-1t" else args.threads)
                else:
                    r = run_pipeline(model, reqs, args, name)
                got = sum(len(v) for v in r["tokens"].values())
                if got != n_out:
                    raise RuntimeError(f"{name}: generated {got} tokens, expected {n_out} (ignore_eos)")
                r["output_tok_s"] = n_out / r["wall_s"]
                r["total_tok_s"] = (n_prompt + n_out) / r["wall_s"]
                r["output_tok_per_cpu_s"] = n_out / r["cpu_s"]
                runs[name].append(r)
                print(f"throughput: {name}: {r['wall_s']:.1f} s, {r['output_tok_s']:.0f} output tok/s", flush=True)
    results = {name: sorted(rs, key=lambda r: r["output_tok_s"])[len(rs) // 2] for name, rs in runs.items()}
    ref = (results.get("single") or results.get("single-1t") or {}).get("tokens")
    rows = []
    for name, r in results.items():
        same = None if ref is None else sum(r["tokens"][k] == ref[k] for k in ref) / len(ref)
        rows.append(dict(config=name, wall_s=r["wall_s"], output_tok_s=r["output_tok_s"], total_tok_s=r["total_tok_s"],
                         cpu_s=r["cpu_s"], output_tok_per_cpu_s=r["output_tok_per_cpu_s"],
                         utilisation=r["utilisation"], preemptions=r["preemptions"], same_tokens=same,
                         micro_batches=r.get("micro_batches"), mean_decode_batch=r.get("mean_decode_batch"),
                         phase_switches=r.get("phase_switches"), load_avg=r["load_avg"],
                         decode_rtt_ms=r.get("decode_rtt_ms"), decode_compute_ms=r.get("decode_compute_ms"),
                         rounds_output_tok_s=[x["output_tok_s"] for x in runs[name]],
                         rounds_cpu_s=[x["cpu_s"] for x in runs[name]]))
    tp = {r["config"]: r["output_tok_s"] for r in rows}
    vs_mixed = report.ratio(tp.get("td-pipe"), tp.get("mixed"))
    vs_single = report.ratio(tp.get("td-pipe"), tp.get("single", tp.get("single-1t")))
    single_name = "single" if "single" in tp else "single-1t"
    _print(rows, vs_mixed, vs_single, args, n_prompt, n_out, single_name)
    png = args.out / "throughput.png"
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, png)
    paired = {f"td-pipe/{b}": [report.ratio(t["output_tok_s"], o["output_tok_s"])
                               for t, o in zip(runs["td-pipe"], runs[b])]
              for b in ("mixed", single_name, "td-pipe-base") if "td-pipe" in runs and b in runs}
    for label, values in paired.items():
        print(f"per round {label}: " + ", ".join(f"{v:.2f}x" for v in values))
    doc = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "prompt_tokens": n_prompt, "output_tokens": n_out, "rows": rows,
           "td_pipe_vs_mixed": vs_mixed, "td_pipe_vs_single": vs_single, "per_round_ratios": paired,
           "targets": {"vs_mixed": TARGET_VS_MIXED, "vs_single": TARGET_VS_SINGLE},
           "timelines": {k: {"traces": v.get("traces"), "phases": v.get("phases")} for k, v in results.items()}}
    path = report.save(args.out, "throughput", doc)
    print(f"wrote {path} and {png}")
    return 0


def _print(rows, vs_mixed, vs_single, args, n_prompt, n_out, single_name) -> None:
    print(f"\npdserve bench experiment throughput: {args.requests} requests ({n_prompt} prompt "
          f"+ {n_out} output tokens), model {args.model} ({args.layers} layers, hidden {args.hidden}), "
          f"{args.num_blocks} KV blocks of {args.block_size}; single process {args.threads} threads, pipeline "
          f"{args.stages} stages x 1 thread")
    print("| config | wall s | output tok/s | total tok/s | CPU s | output tok per CPU s | stage utilisation | "
          "preemptions | micro-batches (mean seqs per decode one) | phase switches | same tokens as single | "
          "load avg start-end | decode micro-batch round trip / stage compute, median ms | "
          "output tok/s of each round |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        util = " / ".join(f"{u:.0%}" for u in r["utilisation"])
        same = "-" if r["same_tokens"] is None else f"{r['same_tokens']:.0%}"
        load = f"{r['load_avg'][0]:.1f}-{r['load_avg'][1]:.1f}"
        mbs = "-" if r["micro_batches"] is None else f"{r['micro_batches']} ({r['mean_decode_batch']:.1f})"
        print(f"| {r['config']} | {r['wall_s']:.1f} | {r['output_tok_s']:.0f} | {r['total_tok_s']:.0f} | "
              f"{r['cpu_s']:.1f} | {r['output_tok_per_cpu_s']:.0f} | {util} | "
              f"{r['preemptions']} | {mbs} | {r['phase_switches'] if r['phase_switches'] is not None else '-'} | "
              f"{same} | {load} | {_rtt(r)} | {' / '.join(f'{x:.0f}' for x in r['rounds_output_tok_s'])} |")
    for label, value, target in (("TD-Pipe / mixed PP", vs_mixed, TARGET_VS_MIXED),
                                 (f"TD-Pipe / one process ({single_name})", vs_single, TARGET_VS_SINGLE)):
        if value is not None:
            print(f"target {label} >= {target:.1f}x: {value:.2f}x {'MET' if value >= target else 'NOT MET'}")


def _rtt(row: dict) -> str:
    if row.get("decode_rtt_ms") is None:
        return "-"
    return f"{row['decode_rtt_ms']:.1f} / {row['decode_compute_ms']:.1f}"


def plot(results: dict, path: Path) -> Path:
    plt = report.pyplot()
    pipes = [(k, v) for k, v in results.items() if v.get("traces")]
    fig, axes = plt.subplots(max(len(pipes), 1), 1, figsize=(12, 2.2 + 1.6 * max(len(pipes), 1)), squeeze=False)
    for ax, (name, r) in zip(axes[:, 0], pipes):
        for stage, tr in enumerate(r["traces"]):
            for kind, (label, color) in KIND_COLORS.items():
                bars = [(s, e - s) for s, e, k in tr if k == kind]
                if bars:
                    ax.broken_barh(bars, (stage - 0.4, 0.8), color=color, label=label if stage == 0 else None)
        for t, phase in r.get("phases") or []:
            ax.axvline(t, color="grey", lw=0.5, ls=":")
        util = ", ".join(f"stage {i}: {u:.0%}" for i, u in enumerate(r["utilisation"]))
        ax.set_title(f"{name}: {r['output_tok_s']:.0f} output tok/s, busy {util}")
        ax.set_yticks(range(len(r["traces"])))
        ax.set_yticklabels([f"stage {i}" for i in range(len(r["traces"]))])
        ax.set_xlim(0, r["wall_s"])
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since the first request")
    return report.save_figure(fig, path)
