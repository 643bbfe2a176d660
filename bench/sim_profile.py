"""``pdserve bench sim-profile``: measure the built-in engine's step time and fit a sim profile
(``engine/sim/profile.py``'s JSON), or make one from the GPU check's figures.

Measured here (``--model tiny|small|medium|DIR``, about a minute for ``small``):

1. the real LLMEngine, its runner's ``forward_sample`` timed on every step with the step's shape
   (``sim.runner.step_shape``: prefill chunks ``(new, cached)``, decode contexts);
2. prompts of ``--prompt-lens`` new tokens after ``--cached-lens`` tokens the prefix cache holds
   (a request of the prefix first), each ``--reps`` times; then decode batches ``--batches`` at
   contexts ``--contexts``, ``--decode-steps`` steps each;
3. ``sim.fit.fit_step_time`` over every timed step; the profile written to ``--out`` with the model's
   shape, where and how it was measured, and the fit's error.

``--from-gpu-check check.json`` (tools/gpu/check.py's output) fits instead the decode cells (CUDA
graphs' step time at batch x context) and prefill cells (N prompts of one length) of its 8B-shaped
model; prefill's per-pair (attention) term comes from its attention A/B (sdpa, per layer, times the
layers), since prompts of one length cannot separate it. Cached-prefix prefill was not measured there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from dataclasses import asdict
from pathlib import Path

from pdserve.bench.provenance import cpu_model


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="the profile JSON to write")
    parser.add_argument("--name", default=None, help="the profile's name (default: the file's stem)")
    parser.add_argument("--model", default="small", help="tiny | small | medium | a checkpoint directory")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: one server per core)")
    parser.add_argument("--prompt-lens", type=_ints, default=[32, 128, 512, 1024, 2048])
    parser.add_argument("--cached-lens", type=_ints, default=[0, 1024])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--batches", type=_ints, default=[1, 4, 16, 32])
    parser.add_argument("--contexts", type=_ints, default=[128, 1024])
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--from-gpu-check", type=Path, default=None, metavar="CHECK_JSON",
                        help="fit the GPU check's decode and prefill cells instead of measuring here")


def run(args) -> int:
    from pdserve.engine.sim.fit import fit_step_time
    from pdserve.engine.sim.profile import SimProfile

    if args.from_gpu_check:
        samples, fixed, model, source = gpu_check_samples(args.from_gpu_check)
    else:
        samples, model, source = measure(args)
        fixed = {}
    step, report = fit_step_time(samples, fixed)
    profile = SimProfile(args.name or args.out.stem, source, model, step, report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(profile.to_json())
    print(f"{args.out}: {report['samples']} steps, rms error {report['rms_relative_error']:.1%}, "
          f"max {report['max_relative_error']:.1%} ({report['worst_sample']})")
    print("step: " + ", ".join(f"{k} {v:.3g}" for k, v in asdict(profile.step).items()))
    return 0


def measure(args):
    """(samples, the model's SimModel, the source line) from timing the real engine here."""
    import torch

    from pdserve.bench.experiments.launcher import MODEL_CACHE, bench_model
    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model
    from pdserve.engine.sim.fit import Sample
    from pdserve.engine.sim.profile import SimModel
    from pdserve.engine.sim.runner import step_shape

    torch.set_num_threads(args.threads)
    checkpoint = args.model if Path(args.model).is_dir() else bench_model(MODEL_CACHE, args.model)
    loaded = load_model(checkpoint)
    cfg = loaded.config
    engine = LLMEngine(loaded, EngineConfig(num_blocks=2048, max_num_seqs=max(args.batches), detokenize=False))
    samples: list = []
    forward = engine.runner.forward_sample

    def timed(batch, on_layer):
        shape = step_shape(batch)
        start = time.perf_counter()
        out = forward(batch, on_layer)
        samples.append(Sample(*shape, time.perf_counter() - start, label=f"prefill {shape[0]} decode {len(shape[1])}"))
        return out

    engine.runner.forward_sample = timed  # type: ignore[method-assign]
    greedy = dict(temperature=0.0, ignore_eos=True)
    n = 0

    def run_one(ids: list[int], max_tokens: int) -> None:
        nonlocal n
        n += 1
        engine.add_request(f"m{n}", ids, SamplingParams(max_tokens=max_tokens, **greedy))
        while engine.has_unfinished():
            engine.step()

    started = time.time()
    for rep in range(args.reps):
        for cached in args.cached_lens:
            for new in args.prompt_lens:
                prefix = [(rep * 7919 + cached * 31 + new + i * 13) % 250 + 1 for i in range(cached)]
                if cached:
                    run_one(prefix, 1)  # its blocks stay in the prefix cache
                run_one(prefix + [(new * 17 + i * 29 + rep) % 250 + 1 for i in range(new)], 1)
    for context in args.contexts:
        for batch in args.batches:
            for b in range(batch):
                n += 1
                ids = [(context + b * 101 + i * 7) % 250 + 1 for i in range(context)]
                engine.add_request(f"m{n}", ids, SamplingParams(max_tokens=args.decode_steps, **greedy))
            while engine.has_unfinished():
                engine.step()
    model = SimModel(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "float32", cfg.vocab_size,
                     cfg.max_position_embeddings, tuple(cfg.eos_token_ids))
    source = (f"pdserve bench sim-profile --model {args.model} --threads {args.threads}: the built-in engine's "
              f"forward timed on {platform.processor() or platform.machine()} ({cpu_model() or 'unknown CPU'}), "
              f"{datetime.date.today()}, {len(samples)} steps in {time.time() - started:.0f} s")
    return samples, model, source


def gpu_check_samples(path: Path):
    """(samples, fixed terms, SimModel, source) from tools/gpu/check.py's JSON (decode and prefill sections)."""
    from pdserve.engine.sim.fit import Sample
    from pdserve.engine.sim.profile import SimModel

    doc = json.loads(path.read_text())
    meta, sections = doc["meta"], doc["sections"]
    shape = meta["plan"]["model_shape"]
    layers = shape["num_layers"]
    samples = []
    for cell in sections["decode"]["results"].get("cells", []):
        if cell.get("graphs"):
            samples.append(Sample([], [cell["context"]] * cell["batch"], cell["graphs"]["ms"] / 1000,
                                  label=f"decode batch {cell['batch']} context {cell['context']}"))
    prefill = sections["prefill"]["results"]
    if not prefill.get("cells"):
        raise SystemExit(f"{path}: its prefill section has no cells (status {sections['prefill'].get('status')}): "
                         "use a run that measured prefill")
    for cell in prefill["cells"]:
        samples.append(Sample([(cell["length"], 0)] * cell["prompts"], [], cell["s"],
                              label=f"prefill {cell['prompts']} x {cell['length']}"))
    ab = prefill["attention_ab"]
    sdpa = ab["variants"]["sdpa"]
    pairs = ab["prompts"] * ab["length"] * (ab["length"] + 1) / 2  # causal (query, key) pairs, one layer
    fixed = {"prefill_pair_s": sdpa["ms"] / 1000 / pairs * layers}
    model = SimModel(layers, shape["num_kv_heads"], shape["head_dim"], meta["dtype"], shape["vocab_size"],
                     shape["max_position_embeddings"], tuple(shape["eos_token_ids"]))
    source = (f"tools/gpu/check.py on {meta['gpu_name']} ({meta['date']}, commit {meta['commit'][:10]}): decode "
              f"cells (CUDA graphs) and prefill cells of the {layers}-layer Llama-3-8B shape, {meta['dtype']}; "
              f"prefill_pair_s from its sdpa attention A/B x {layers} layers; cached-prefix prefill not measured")
    return samples, fixed, model, source
