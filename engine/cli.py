"""Run the colocated engine on a prompt and stream the completion to stdout.

Examples:
  pdserve generate "Once upon a time"
  pdserve generate --chat "What is prefill/decode disaggregation?" --max-tokens 64
  pdserve generate --model /models/Qwen2-0.5B --temperature 0.7 --seed 1 "Hello"

The default model is the built-in one (random weights, byte-level tokenizer): its text is
gibberish, but it runs offline with no download.
"""

from __future__ import annotations

import argparse
import sys
import time

from .defaults import BLOCK_SIZE, BUILTIN_MODEL, KV_CACHE_DTYPE_HELP, KV_CACHE_DTYPES, QUANTIZATION_HELP, QUANTIZATIONS

DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text (or the user message with --chat)")
    parser.add_argument("--model", default=BUILTIN_MODEL,
                        help=f"built-in name or Hugging Face directory (default: {BUILTIN_MODEL})")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt as a user message with the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1 (default: cpu)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="weights and KV cache dtype (default: float32)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None, help=QUANTIZATION_HELP)
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_CACHE_DTYPE_HELP)
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                        help=f"KV block size in tokens (default: {BLOCK_SIZE})")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice; with --tensor-parallel-size, each rank's)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="split the model over N ranks, one process each (engine/tp/; default: 1)")


def run(args: argparse.Namespace) -> int:
    import torch

    from . import EngineConfig, LLMEngine, SamplingParams, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        sampling = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
        loaded = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device,
                            quantization=args.quantization, tensor_parallel_size=args.tensor_parallel_size)
        tok = loaded.tokenizer
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        ids = tok.encode(text, add_special_tokens=not (args.chat and tok.bos_token))
        engine = LLMEngine(loaded, EngineConfig(block_size=args.block_size, max_num_seqs=1,
                                                kv_cache_dtype=args.kv_cache_dtype,
                                                tensor_parallel_size=args.tensor_parallel_size))
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    n, reason = 0, None
    try:
        engine.add_request("cli", ids, sampling)
        while engine.has_unfinished():
            for out in engine.step():
                n += len(out.new_token_ids)
                sys.stdout.write(out.text)
                sys.stdout.flush()
                reason = out.finish_reason
    except (ValueError, RuntimeError) as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.close()  # (the other tensor-parallel ranks stop)
    elapsed = time.perf_counter() - start
    print(f"\n[{n} tokens in {elapsed:.2f}s, {n / max(elapsed, 1e-9):.1f} tok/s, finish: {reason}]", file=sys.stderr)
    return 0
