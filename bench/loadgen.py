"""Load generator against any OpenAI-compatible endpoint: TTFT, TPOT, ITL, e2e latency, goodput.

Sends streaming completions (so every token's arrival is timed) with Poisson or fixed-rate
arrivals (--request-rate, --arrival) or a fixed number of requests in flight
(--concurrency). Prompt and output lengths come from a synthetic long-tailed distribution
(default), exact lengths with random token-id prompts from the model's tokenizer
(--dataset random --tokenizer DIR), a JSONL file of lengths, a ShareGPT file, or a request trace
replayed with its own arrival times and shared prefixes (--dataset mooncake|azure: trace_replay.py,
scaled by --trace-time-scale / --trace-length-scale / --trace-window, named in the JSON's "trace").
With ignore_eos (and min_tokens, for vLLM) every request streams exactly its output length.
Warm-up requests are sent first and left out of the figures. Prints TTFT, TPOT, ITL (time
between streamed chunks) and e2e (P50/P90/P99/mean), throughput and failures; writes
<out>/<name>.json (config, summary, every request) and <out>/<name>.png (CDFs of TTFT and
ITL, a timeline). Works against any OpenAI-compatible server (pdserve, vLLM, ...).

Examples:
  pdserve bench serving --url http://127.0.0.1:8000 --num-requests 200 --request-rate 4
  pdserve bench serving --base-url http://127.0.0.1:8000 --model m --dataset random --tokenizer /ckpt
      --prompt-len 512 --output-len 64 --request-rate 1 --num-requests 30      (one command line)
  pdserve bench serving --concurrency 8 --dataset sharegpt --dataset-path sg.json
  pdserve bench serving --dataset mooncake --dataset-path bench/traces/mooncake_conversation_trace.jsonl.xz
      --token-ids 250 --trace-window 0:60 --trace-length-scale 0.125 --trace-time-scale 4 --num-requests 50
  pdserve bench serving --slo-ttft-ms 500 --slo-tbt-ms 50 --out results/

Library use (experiments): ``results, wall = asyncio.run(send_requests(LoadConfig(...),
specs, arrivals))`` then ``loadgen_report.summarize(results, wall)``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.defaults import BUILTIN_MODEL, HTTP_PORT
from pdserve.bench.provenance import write_json
from pdserve.bench.loadgen_report import RequestResult, format_summary, plot, summarize
from pdserve.bench import trace_replay
from pdserve.bench.loadgen_workload import (LengthDistribution, RequestSpec, arrival_times, build_requests,
                                            jsonl_lengths,
                                            random_requests, sharegpt_requests, synthetic_lengths, tokenizer_prompt_ids)


@dataclass(slots=True)
class LoadConfig:
    """Where and how to send requests."""

    url: str = f"http://127.0.0.1:{HTTP_PORT}"
    model: str = BUILTIN_MODEL
    api: str = "completions"          # completions | chat
    temperature: float = 0.0
    ignore_eos: bool = True           # ask for exactly max_tokens tokens (vLLM-style extension)
    request_timeout: float = 600.0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.api not in ("completions", "chat"):
            raise ValueError(f"api must be 'completions' or 'chat', got {self.api!r}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        if self.request_timeout <= 0:
            raise ValueError("request_timeout must be > 0")

    @property
    def endpoint(self) -> str:
        return self.url.rstrip("/") + ("/v1/completions" if self.api == "completions" else "/v1/chat/completions")

    def payload(self, spec: RequestSpec) -> dict:
        body = {"model": self.model, "max_tokens": spec.output_tokens, "stream": True,
                "temperature": self.temperature, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
            body["min_tokens"] = spec.output_tokens  # servers that ignore ignore_eos still stop at max_tokens
        if self.api == "completions":
            body["prompt"] = list(spec.prompt_ids) if spec.prompt_ids is not None else spec.prompt
        else:
            if spec.prompt_ids is not None:
                raise ValueError("token-id prompts need --api completions")
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        return body


def _chunk_has_token(chunk: dict, api: str) -> bool:
    choices = chunk.get("choices") or []
    if not choices:
        return False
    c = choices[0]
    if api == "completions":
        return bool(c.get("text")) or c.get("finish_reason") is None
    delta = c.get("delta") or {}
    return "content" in delta and (bool(delta["content"]) or c.get("finish_reason") is None)


async def send_one(session, config: LoadConfig, spec: RequestSpec, result: RequestResult, t0: float) -> RequestResult:
    """Send one streaming request and fill in result (never raises for server-side failures)."""
    import aiohttp

    start = time.perf_counter()
    result.sent_at = start - t0
    last = None
    try:
        async with session.post(config.endpoint, json=config.payload(spec),
                                timeout=aiohttp.ClientTimeout(total=config.request_timeout)) as resp:
            result.status = resp.status
            if resp.status != 200:
                text = (await resp.text())[:300]
                result.error = f"HTTP {resp.status}: {text}"
                return result
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    result.error = "stream error: " + (err.get("message", str(err)) if isinstance(err, dict)
                                                       else str(err))
                    return result
                if chunk.get("usage"):
                    result.usage_prompt_tokens = chunk["usage"].get("prompt_tokens")
                    result.usage_completion_tokens = chunk["usage"].get("completion_tokens")
                if _chunk_has_token(chunk, config.api):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.gaps.append(now - last)
                    last = now
                    result.chunks += 1
        result.e2e = time.perf_counter() - start
        if result.ttft is None:
            result.error = "stream ended without a token"
        else:
            result.ok = True
    except asyncio.TimeoutError:
        result.error = f"timeout: no complete answer within {config.request_timeout}s"
    except (OSError, ValueError) as e:  # aiohttp.ClientError is an OSError subclass; ValueError: bad JSON
        result.error = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - aiohttp's client errors; a load generator records and goes on
        result.error = f"{type(e).__name__}: {e}"
    return result


async def send_requests(config: LoadConfig, specs: list[RequestSpec], arrivals: list[float] | None = None,
                        concurrency: int | None = None) -> tuple[list[RequestResult], float]:
    """Send specs: at the given arrival offsets (open loop), or with `concurrency` in flight.

    Returns the results (in spec order) and the wall time from the first send to the last
    answer. Exactly one of arrivals / concurrency must be given.
    """
    import aiohttp
    from tqdm import tqdm

    if (arrivals is None) == (concurrency is None):
        raise ValueError("give either arrival times or a concurrency")
    if arrivals is not None and len(arrivals) != len(specs):
        raise ValueError("one arrival time per request")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    results = [RequestResult(i, s.prompt_tokens, s.output_tokens) for i, s in enumerate(specs)]
    bar = tqdm(total=len(specs), desc="requests", unit="req", disable=not config.progress, leave=False)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            await send_one(session, config, specs[i], results[i], t0)
            bar.update(1)

        if arrivals is not None:
            async def at(i: int, offset: float) -> None:
                delay = t0 + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                await one(i)
            await asyncio.gather(*(at(i, a) for i, a in enumerate(arrivals)))
        else:
            queue = iter(range(len(specs)))

            async def worker() -> None:
                for i in queue:
                    await one(i)
            await asyncio.gather(*(worker() for _ in range(min(concurrency, len(specs)))))
        wall = time.perf_counter() - t0
    bar.close()
    return results, wall


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("target")
    g.add_argument("--url", "--base-url", dest="url", default=f"http://127.0.0.1:{HTTP_PORT}",
                   help="base URL of the OpenAI-compatible server (without /v1)")
    g.add_argument("--model", default=BUILTIN_MODEL, help="model name to send (default: %(default)s)")
    g.add_argument("--api", choices=["completions", "chat"], default="completions", help="which endpoint to call")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default greedy)")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (outputs may then stop before max_tokens)")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds per request before it counts as failed")
    g = parser.add_argument_group("arrivals")
    g.add_argument("--num-requests", type=int, default=100, help="measured requests (default: %(default)s)")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second (open loop); inf sends all at once (default)")
    g.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson", help="gaps between arrivals")
    g.add_argument("--concurrency", type=int, default=None,
                   help="closed loop instead: keep this many requests in flight (ignores --request-rate)")
    g.add_argument("--warmup", type=int, default=2, help="warm-up requests sent first, not measured")
    g.add_argument("--seed", type=int, default=0, help="random seed for lengths, prompts and arrivals")
    g = parser.add_argument_group("workload")
    g.add_argument("--dataset", choices=["synthetic", "random", "jsonl", "sharegpt", *trace_replay.FORMATS],
                   default="synthetic",
                   help="where lengths come from (see the module help); random: exactly --prompt-len and --output-len; "
                        "mooncake / azure: a request trace replayed with its arrival times and (mooncake) its shared "
                        "prefixes (bench/trace_replay.py; needs --tokenizer or --token-ids)")
    g.add_argument("--dataset-path", type=Path, help="the JSONL, ShareGPT or trace file")
    g.add_argument("--trace-time-scale", type=float, default=1.0, metavar="X",
                   help="trace: multiply arrival times by X (0.1 = ten times the rate; default 1)")
    g.add_argument("--trace-length-scale", type=float, default=1.0, metavar="X",
                   help="trace: multiply prompt and output lengths, and the 512 tokens of a hash id, by X in (0, 1]")
    g.add_argument("--trace-window", default=None, metavar="START:DURATION",
                   help="trace: only the requests arriving in [START, START+DURATION) seconds of the trace")
    g.add_argument("--prompt-len", type=int, default=256, help="synthetic: median prompt tokens; random: exact")
    g.add_argument("--prompt-sigma", type=float, default=1.0, help="synthetic: log-normal spread of prompt lengths")
    g.add_argument("--output-len", type=int, default=64, help="synthetic: median output tokens; random: exact")
    g.add_argument("--output-sigma", type=float, default=0.7, help="synthetic: log-normal spread of output lengths")
    g.add_argument("--max-prompt-len", type=int, default=4096,
                   help="clip (synthetic; a trace, after scaling, keeping its leading blocks) "
                        "or skip (sharegpt) longer prompts")
    g.add_argument("--max-output-len", type=int, default=1024, help="clip output lengths (a trace's after scaling)")
    g.add_argument("--token-ids", type=int, metavar="VOCAB", default=None,
                   help="send prompts as random token ids below VOCAB instead of text (exact prompt lengths)")
    g.add_argument("--tokenizer", type=Path, default=None, metavar="PATH",
                   help="random: draw prompt ids from this tokenizer.json (or model "
                        "directory), special tokens left out")
    g = parser.add_argument_group("report")
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="SLO on time to first token, for goodput")
    g.add_argument("--slo-tbt-ms", type=float, default=None, help="SLO on a request's mean time between tokens")
    g.add_argument("--out", type=Path, default=Path("bench-results"), help="directory for the JSON and PNG")
    g.add_argument("--name", default="serving", help="file name stem of the outputs")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def _prompt_pool(args: argparse.Namespace) -> list[int]:
    """The token ids prompts are drawn from: the tokenizer's vocabulary (no special tokens), or 1..VOCAB-1."""
    return tokenizer_prompt_ids(args.tokenizer) if args.tokenizer is not None else list(range(1, args.token_ids))


def trace_from_args(args: argparse.Namespace, n: int, seed: int) -> tuple[list[RequestSpec], list[float], str]:
    """A trace's first n requests of the window, scaled, their arrivals and the scaling's description."""
    if args.tokenizer is None and args.token_ids is None:
        raise ValueError(f"--dataset {args.dataset} needs --tokenizer PATH (or --token-ids VOCAB) to build prompts")
    if args.dataset_path is None or not args.dataset_path.is_file():
        raise ValueError(f"--dataset {args.dataset} needs --dataset-path FILE (got {args.dataset_path})")
    start, duration = 0.0, None
    if args.trace_window:
        try:
            start_text, _, duration_text = args.trace_window.partition(":")
            start, duration = float(start_text), float(duration_text)
        except ValueError:
            raise ValueError(f"--trace-window {args.trace_window!r}: expected START:DURATION in seconds") from None
    scaling = trace_replay.Scaling(args.trace_time_scale, args.trace_length_scale, start, duration, n,
                                   args.max_prompt_len, args.max_output_len)
    pool = _prompt_pool(args)
    reqs = trace_replay.read_trace(args.dataset_path, args.dataset)
    specs, arrivals = trace_replay.replay_requests(reqs, scaling, pool, seed)
    return specs, arrivals, scaling.describe()


def workload_from_args(args: argparse.Namespace, n: int, seed: int) -> list[RequestSpec]:
    """n requests as the arguments describe (a dataset file is cycled or cut to n)."""
    rng = random.Random(seed)
    if args.dataset in trace_replay.FORMATS:
        return trace_from_args(args, n, seed)[0]
    if args.dataset == "random":
        if args.tokenizer is None and args.token_ids is None:
            raise ValueError("--dataset random needs --tokenizer PATH (or --token-ids VOCAB) to draw prompt ids from")
        return random_requests(n, args.prompt_len, args.output_len, rng, _prompt_pool(args))
    if args.dataset == "synthetic":
        lengths = synthetic_lengths(
            n, LengthDistribution(args.prompt_len, args.prompt_sigma, 1, args.max_prompt_len),
            LengthDistribution(args.output_len, args.output_sigma, 1, args.max_output_len), rng)
        return build_requests(lengths, rng, args.token_ids)
    if args.dataset_path is None:
        raise ValueError(f"--dataset {args.dataset} needs --dataset-path")
    if not args.dataset_path.is_file():
        raise ValueError(f"--dataset-path {args.dataset_path}: no such file")
    if args.dataset == "jsonl":
        lengths = [(min(p, args.max_prompt_len), min(o, args.max_output_len))
                   for p, o in jsonl_lengths(args.dataset_path)]
        return build_requests([lengths[i % len(lengths)] for i in range(n)], rng, args.token_ids)
    pool = sharegpt_requests(args.dataset_path, args.max_prompt_len, args.max_output_len)
    rng.shuffle(pool)
    return [pool[i % len(pool)] for i in range(n)]


def _validate(args: argparse.Namespace) -> None:
    for name in ("num_requests", "prompt_len", "output_len", "max_prompt_len", "max_output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        raise ValueError("--warmup must be >= 0")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0")
    for name in ("slo_ttft_ms", "slo_tbt_ms"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")


def run(args: argparse.Namespace) -> int:
    try:
        _validate(args)
        config = LoadConfig(url=args.url, model=args.model, api=args.api, temperature=args.temperature,
                            ignore_eos=args.ignore_eos, request_timeout=args.request_timeout, progress=args.progress)
        trace_arrivals, trace = None, None
        if args.dataset in trace_replay.FORMATS:  # the trace's own arrivals (and prefixes); warm-up: random prompts
            specs, trace_arrivals, trace = trace_from_args(args, args.num_requests, args.seed)
            # warm-up: short random prompts (the trace's own would fill the prefix caches ahead of the measure)
            warm = random_requests(args.warmup, 32, 8, random.Random(args.seed + 1), _prompt_pool(args))
        else:
            specs = workload_from_args(args, args.num_requests, args.seed)
            warm = workload_from_args(args, args.warmup, args.seed + 1) if args.warmup else []
    except ValueError as e:
        print(f"pdserve bench serving: error: {e}", file=sys.stderr)
        return 2
    if warm:
        warm_results, _ = asyncio.run(send_requests(config, warm, concurrency=min(4, len(warm))))
        failed = [r for r in warm_results if not r.ok]
        if len(failed) == len(warm_results):
            print(f"pdserve bench serving: every warm-up request failed; first error: {failed[0].error}",
                  file=sys.stderr)
            return 1
    if args.concurrency is not None:
        results, wall = asyncio.run(send_requests(config, specs, concurrency=args.concurrency))
    else:
        arrivals = trace_arrivals or arrival_times(len(specs), args.request_rate, args.arrival,
                                                   random.Random(args.seed + 2))
        results, wall = asyncio.run(send_requests(config, specs, arrivals=arrivals))
    summary = summarize(results, wall, args.slo_ttft_ms / 1000 if args.slo_ttft_ms else None,
                        args.slo_tbt_ms / 1000 if args.slo_tbt_ms else None)
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    cfg["request_rate"] = str(args.request_rate) if math.isinf(args.request_rate) else args.request_rate
    doc = {"config": cfg, "client": asdict(config), "summary": summary, "requests": [r.to_json() for r in results]}
    if trace is not None:
        doc["trace"] = trace  # how the trace was cut and scaled: every result names it
        print(f"workload: {args.dataset_path} ({args.dataset}), {trace}")
    json_path = write_json(args.out / f"{args.name}.json", doc)
    png = plot(results, args.out / f"{args.name}.png", title=f"pdserve bench serving: {args.url}")
    print(format_summary(summary))
    print(f"wrote {json_path} and {png}")
    return 0 if summary["succeeded"] else 1
