"""Run an offline batch file for throughput (OpenAI batch JSONL in, OpenAI batch output JSONL out).

Examples:
  pdserve batch requests.jsonl --output results.jsonl                      # 2 stages, TD-Pipe
  pdserve batch requests.jsonl --output r.jsonl --pipeline-stages 2 --schedule mixed
  pdserve batch requests.jsonl --output r.jsonl --pipeline-stages 1        # one process

Each input line is an OpenAI batch request::

  {"custom_id": "q1", "method": "POST", "url": "/v1/completions",
   "body": {"prompt": "Hello", "max_tokens": 64, "temperature": 0}}

(``/v1/chat/completions`` with ``messages`` too). Body fields used: prompt or messages,
max_tokens (default 16), temperature (default 1), top_p, top_k, seed, stop, ignore_eos.
Every line gets one output line, in input order: ``{"id", "custom_id", "response":
{"status_code": 200, "body": <completion>}, "error": null}``, or for a bad line ``"response":
null, "error": {"code": "invalid_request", "message": ...}``; a bad line never stops the job.

With ``--pipeline-stages N`` (N >= 2) the model's layers are split over N stage processes
(one torch thread each by default); ``--schedule td-pipe`` separates prefill and decode
phases in time (see ``pdserve.batch.pipeline.schedules``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from pdserve.engine.defaults import BLOCK_SIZE, BUILTIN_MODEL
from .config import SCHEDULES

URLS = ("/v1/completions", "/v1/chat/completions")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="OpenAI batch input file (JSONL)")
    parser.add_argument("--output", required=True, help="where to write the results (JSONL)")
    add_engine_arguments(parser)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and pipeline flags (also ``pdserve batch-server``'s)."""
    parser.add_argument("--model", default=BUILTIN_MODEL,
                        help=f"built-in name or Hugging Face directory (default: {BUILTIN_MODEL})")
    parser.add_argument("--pipeline-stages", type=int, default=2,
                        help="stage processes (1 = the one-process engine; default 2)")
    parser.add_argument("--schedule", choices=SCHEDULES, default="td-pipe", help="pipeline schedule (default: td-pipe)")
    parser.add_argument("--num-blocks", type=int, default=1024, help="KV blocks of every layer (default: 1024)")
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                        help=f"tokens per KV block (default: {BLOCK_SIZE})")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="requests decoding at once (default: 256)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N",
                        help="tokens per (micro-)batch, prompt spans and decode rows: a longer prompt is computed in "
                             "chunks (default: 2048)")
    parser.add_argument("--long-prefill-threshold", type=int, default=0, metavar="N",
                        help="the most tokens of one prompt per (micro-)batch while a shorter one waits, so that it "
                             "passes (0: the whole --max-num-batched-tokens; default 0)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per stage or of the one process (default: 1)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (stages then use NCCL; stage s on cuda:s)")
    parser.add_argument("--micro-batches", type=int, default=0, help="micro-batches in flight (0: the stages)")
    parser.add_argument("--min-decode-batch", type=int, default=1,
                        help="td-pipe: fewer decode micro-batches rather than ones under this "
                             "many sequences (default 1)")


def parse_line(line: str, lineno: int, tokenizer, model_name: str):
    """(custom_id, url, prompt ids, SamplingParams) of one input line; ValueError naming the problem."""
    try:
        req = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"line {lineno}: not valid JSON: {e}") from None
    if not isinstance(req, dict):
        raise ValueError(f"line {lineno}: expected a JSON object")
    custom_id, url, body = req.get("custom_id"), req.get("url"), req.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError(f"line {lineno}: custom_id must be a non-empty string")
    if url not in URLS:
        raise ValueError(f"line {lineno}: url must be one of {', '.join(URLS)}, got {url!r}")
    if not isinstance(body, dict):
        raise ValueError(f"line {lineno}: body must be an object")
    ids, sampling = parse_body(url, body, tokenizer, f"line {lineno}: ")
    return custom_id, url, ids, sampling


def parse_body(url: str, body: dict, tokenizer, where: str = "") -> tuple[list[int], object]:
    """(prompt ids, SamplingParams) of one request body of ``url``; ValueError naming the problem
    (prefixed with ``where``)."""
    from pdserve.engine.sampling import SamplingParams

    if url == "/v1/completions":
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where}body.prompt must be a non-empty string")
        ids = tokenizer.encode(prompt)
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"{where}body.messages must be a non-empty list of objects")
        text = tokenizer.apply_chat_template(messages)
        ids = tokenizer.encode(text, add_special_tokens=not getattr(tokenizer, "bos_token", None))
    keys = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")
    kwargs = {k: body[k] for k in keys if body.get(k) is not None}
    kwargs.setdefault("max_tokens", 16)
    try:
        sampling = SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}{e}") from None
    return ids, sampling


def response_body(url: str, rid: str, model: str, text: str, reason: str, n_prompt: int, n_out: int) -> dict:
    usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
    if url == "/v1/completions":
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        return {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": [choice], "usage": usage}
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage}


def _add_all(eng, requests: list) -> dict:
    """Add every request; the ones the engine refuses (too long, ...) -> {request id: message}."""
    refused = {}
    for rid, ids, sp in requests:
        try:
            eng.add_request(rid, ids, sp)
        except (ValueError, RuntimeError) as e:
            refused[rid] = str(e)
    return refused


def run_requests(engine_kind: str, args, requests: list) -> tuple[dict, dict]:
    """Run ``[(request_id, ids, sampling)]`` to the end on the chosen engine:
    ({id: RequestOutput}, {id: why the engine refused it})."""
    import torch

    if engine_kind == "pipeline":
        from .config import PipelineConfig
        from .engine import PipelineEngine

        cfg = PipelineConfig(num_stages=args.pipeline_stages, schedule=args.schedule, num_blocks=args.num_blocks,
                             block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             long_prefill_threshold=args.long_prefill_threshold,
                             threads_per_stage=args.threads, device=args.device, dtype=args.dtype,
                             micro_batches=args.micro_batches, min_decode_batch=args.min_decode_batch)
        with PipelineEngine(args.model, cfg) as eng:
            refused = _add_all(eng, requests)
            return eng.run(), refused
    from pdserve.engine import EngineConfig, LLMEngine, load_model

    torch.set_num_threads(args.threads)
    eng = LLMEngine(load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device),
                    EngineConfig(num_blocks=args.num_blocks, block_size=args.block_size,
                                 max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                 long_prefill_threshold=args.long_prefill_threshold))
    refused = _add_all(eng, requests)
    out: dict = {}
    while eng.has_unfinished():
        for o in eng.step():
            acc = out.setdefault(o.request_id, o)
            if acc is not o:
                acc.new_token_ids = acc.new_token_ids + o.new_token_ids
                acc.text += o.text
                acc.finished, acc.finish_reason = o.finished, o.finish_reason
    return out, refused


def run(args: argparse.Namespace) -> int:
    from .meta import load_meta

    if args.pipeline_stages < 1:
        print(f"error: --pipeline-stages must be >= 1, got {args.pipeline_stages}", file=sys.stderr)
        return 2
    try:
        meta = load_meta(args.model)
        with open(args.input, encoding="utf-8") as f:
            lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parsed, errors = [], {}
    for n, line in lines:
        try:
            parsed.append((n, *parse_line(line, n, meta.tokenizer, args.model)))
        except ValueError as e:
            errors[n] = str(e)
    requests = [(f"line{n}", ids, sp) for n, _, _, ids, sp in parsed]
    start = time.perf_counter()
    outputs, refused = (run_requests("pipeline" if args.pipeline_stages >= 2 else "single", args, requests)
                        if requests else ({}, {}))
    errors.update({int(rid[4:]): msg for rid, msg in refused.items()})
    elapsed = time.perf_counter() - start
    by_line = {n: (cid, url, ids) for n, cid, url, ids, _ in parsed}
    n_tokens = 0
    with open(args.output, "w", encoding="utf-8") as f:
        for n, line in lines:
            if n in errors:
                cid = _custom_id(line)
                row = {"id": f"batch_req_{n}", "custom_id": cid if n not in by_line else by_line[n][0],
                       "response": None, "error": {"code": "invalid_request", "message": errors[n]}}
            else:
                cid, url, ids = by_line[n]
                o = outputs[f"line{n}"]
                n_tokens += len(o.new_token_ids)
                body = response_body(url, f"line{n}", args.model, o.text, o.finish_reason, len(ids),
                                     len(o.new_token_ids))
                row = {"id": f"batch_req_{n}", "custom_id": cid,
                       "response": {"status_code": 200, "request_id": f"line{n}", "body": body}, "error": None}
            f.write(json.dumps(row) + "\n")
    print(f"[{len(requests)} requests, {len(errors)} invalid lines, {n_tokens} tokens in {elapsed:.2f}s, "
          f"{n_tokens / max(elapsed, 1e-9):.1f} tok/s] -> {args.output}", file=sys.stderr)
    return 0


def _custom_id(line: str):
    try:
        value = json.loads(line)
        return value.get("custom_id") if isinstance(value, dict) else None
    except json.JSONDecodeError:
        return None
