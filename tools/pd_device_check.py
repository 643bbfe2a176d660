"""P/D on one device, end to end: a real decode and prefill server, greedy text equal to the engine alone.

    python tools/pd_device_check.py [--device cuda] [--dtype bfloat16] [--model tiny] [--requests 4] [--transfer tcp|nixl|samenode]
        [--prompt-lens 1024,2048,8192]

Starts ``pdserve decode`` and ``pdserve prefill`` (``python -m pdserve``, this interpreter, free
loopback ports, KV over ``--transfer``: tcp by default, which on CUDA stages each layer through
pinned host memory; nixl needs the NIXL package; samenode: the decode's pool shared with the prefill,
which copies each layer straight into it, a device-to-device copy from CUDA IPC memory on cuda, a
memcpy into a memfd on the CPU: ``--kv-same-node on``, and the check fails unless the prefill
used it; tcp and nixl run with ``--kv-same-node off``) on ``--device``, sends ``--requests`` greedy
completions of 32 tokens (prompts of 40-160 token ids) through the prefill's OpenAI endpoint one
after the other, and checks that each text equals what one LLMEngine on the same device gives
for the same prompt, and that after the last one both servers hold no KV block, Session or
CacheStore entry. Prints per request the end-to-end time and the verdict; exits 1 on any
difference. Meant for a machine where the test suite cannot run (a GPU box with only torch and a
few wheels): it needs no pytest.

With ``--prompt-lens L1,L2,...`` (issue 51's cell: 1k, 2k, 8k tokens; ``--model`` a checkpoint whose
context holds them) each length gets ``--requests`` prompts of exactly that length, sent streamed, and
each request's line adds: its TTFT through P/D (first streamed token) against the prefill alone (the
same prompt's time to its first token in the engine alone on this device, warm, median of 3), and its
KV transfer from the prefill's /metrics deltas: the span from its first layer sent to its last layer
done (``pdserve_kv_transfer_seconds``, which overlaps the prefill's compute: layer-wise push), the sum
of its layers' send times (``..._layer_seconds``: the transport's own time) and the bytes moved.
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request

import torch
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model
from pdserve.engine.defaults import BLOCK_SIZE
from pdserve.net import free_ports

NUM_BLOCKS = 128  # each server's KV pool, and the engine alone's (more when --prompt-lens needs it)
HELD = ("sessions", "kv_blocks_used", "in_flight", "queued")
MAX_TOKENS = 32
KV_SAMPLES = ("pdserve_kv_transfer_seconds_sum", "pdserve_kv_transfer_layer_seconds_sum",
              "pdserve_kv_transfer_bytes_total")


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def wait_ready(name: str, proc: subprocess.Popen, url: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode} before it was ready")
        try:
            if get(url + "/ready")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{name} not ready within {timeout:.0f} s")


def kv_totals(url: str) -> dict[str, float]:
    """The prefill's KV transfer sums so far (a request's figures are the change across it)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(KV_SAMPLES, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


def stream_ttft(url: str, body: dict) -> tuple[float, str]:
    """Seconds to the first streamed token and the whole text, of one streamed completion."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    t0, first, parts = time.perf_counter(), None, []
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            text = json.loads(line[5:])["choices"][0].get("text", "")
            if text and first is None:
                first = time.perf_counter() - t0
            parts.append(text)
    return (first if first is not None else float("nan")), "".join(parts)


def alone_ttft(engine: LLMEngine, ids: list[int], device: str) -> float:
    """The prompt's time to its first token in the engine alone (warm: the median of 3 after one)."""
    times = []
    for rep in range(4):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.add_request(f"alone{rep}", ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[1]


def held(url: str) -> dict:
    health = get(url + "/health")[1]
    out = {k: health[k] for k in HELD if k in health}
    for key, value in (health.get("cachestore") or {}).items():
        if isinstance(value, (int, float)) and any(k in key for k in ("pinned", "inflight", "queued", "sending",
                                                                       "receiving", "waiters")):
            out[f"cachestore.{key}"] = value
    return out


def make_prompts(args, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    if not args.prompt_lens:
        return [[rng.randrange(3, vocab - 1) for _ in range(rng.randrange(40, 160))] for _ in range(args.requests)]
    return [[rng.randrange(3, vocab - 1) for _ in range(n)] for n in args.prompt_lens for _ in range(args.requests)]


def engine_alone(loaded, args, num_blocks: int, prefix_cache: bool = True) -> LLMEngine:
    # the servers' block size, pool and batch limit: the same attention splits and graph buckets, so
    # the same roundings in bf16 (with blocks of 16, bf16 texts drifted apart on an H200 at near-ties)
    return LLMEngine(loaded, EngineConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=32,
                                          kv_cache_dtype=args.kv_cache_dtype, enable_prefix_cache=prefix_cache))


def expected_texts(loaded, args, prompts: list[list[int]], num_blocks: int) -> tuple[list[str], dict[int, float]]:
    """The engine alone's greedy text per prompt, and (with --prompt-lens) its warm TTFT per length."""
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    texts = []
    for i, ids in enumerate(prompts):
        engine = engine_alone(loaded, args, num_blocks)
        engine.add_request(f"r{i}", ids, sp)
        toks = []
        while engine.has_unfinished():
            for out in engine.step():
                toks += out.new_token_ids
        texts.append(loaded.tokenizer.decode(toks))
    alone: dict[int, float] = {}
    if args.prompt_lens:
        engine = engine_alone(loaded, args, num_blocks, prefix_cache=False)
        for ids in prompts:
            if len(ids) not in alone:
                alone[len(ids)] = alone_ttft(engine, ids, args.device)
    return texts, alone


def one_request(purl: str, args, i: int, ids: list[int], expected: str, alone: dict[int, float]) -> bool:
    """Send prompt ``i``, print its line; True when its text equals the engine alone's."""
    body = {"model": args.model, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    extra = ""
    if args.prompt_lens:
        before = kv_totals(purl)
        ttft, text = stream_ttft(purl + "/v1/completions", body)
        after = kv_totals(purl)
        span, layers, nbytes = (after[k] - before[k] for k in KV_SAMPLES)
        base = alone[len(ids)]
        extra = (f"ttft {ttft * 1e3:.1f} ms vs prefill alone {base * 1e3:.1f} ms ({ttft / base:.2f}x), kv span "
                 f"{span * 1e3:.1f} ms, kv layer sends {layers * 1e3:.1f} ms, kv {nbytes / 2**20:.1f} MiB, ")
    else:
        text = post(purl + "/v1/completions", body)["choices"][0]["text"]
    same = text == expected
    print(f"request {i}: {len(ids)} prompt tokens, {time.perf_counter() - t0:.2f} s, {extra}"
          f"{'same text as the engine alone' if same else 'DIFFERENT'}"
          + ("" if same else f": {text!r} vs {expected!r}"), flush=True)
    return same


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=4, help="prompts (per length with --prompt-lens)")
    p.add_argument("--transfer", default="tcp", choices=["tcp", "nixl", "samenode"],
                   help="the servers' KV transport (samenode: cachestore/samenode.py over tcp's control channel; "
                        "tcp and nixl run with --kv-same-node off)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="the KV cache of the engine alone and of both servers (fp8: FP8 KV moved with its scales)")
    p.add_argument("--prompt-lens", type=lambda v: [int(x) for x in v.split(",") if x], default=[],
                   help="prompts of exactly these lengths, streamed, with TTFT against the prefill alone and the "
                        "KV transfer per request (default: 40-160 random, not streamed)")
    args = p.parse_args()
    loaded = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    prompts = make_prompts(args, loaded.config.vocab_size)
    longest = max(len(ids) for ids in prompts) + MAX_TOKENS
    num_blocks = max(NUM_BLOCKS, 2 * -(-longest // BLOCK_SIZE) + 8)
    expected, alone = expected_texts(loaded, args, prompts, num_blocks)
    del loaded
    dport, dhttp, kv, phttp, pgrpc = free_ports(5)
    common = ["--model", args.model, "--device", args.device, "--dtype", args.dtype, "--threads", "1",
              "--log-level", "WARNING", "--num-blocks", str(num_blocks),
              "--transfer", "tcp" if args.transfer == "samenode" else args.transfer,
              "--kv-same-node", "on" if args.transfer == "samenode" else "off",
              "--max-num-seqs", "32", "--kv-cache-dtype", args.kv_cache_dtype]
    cmd = [sys.executable, "-m", "pdserve"]
    procs = []
    try:
        decode = subprocess.Popen(cmd + ["decode", "--port", str(dport), "--http-port", str(dhttp), "--kv-port",
                                         str(kv), *common])
        procs.append(decode)
        prefill = subprocess.Popen(cmd + ["prefill", "--port", str(phttp), "--grpc-port", str(pgrpc),
                                          "--decode", f"127.0.0.1:{dport}", *common])
        procs.append(prefill)
        durl, purl = f"http://127.0.0.1:{dhttp}", f"http://127.0.0.1:{phttp}"
        wait_ready("decode", decode, durl)
        wait_ready("prefill", prefill, purl)
        bad = sum(not one_request(purl, args, i, ids, expected[i], alone) for i, ids in enumerate(prompts))
        time.sleep(1.0)
        left = {"decode": held(durl), "prefill": held(purl)}
        leaked = {name: {k: v for k, v in r.items() if v} for name, r in left.items()}
        leaked = {name: r for name, r in leaked.items() if r}
        links = get(purl + "/health")[1]["cachestore"].get("same_node_links", 0)
        if (links > 0) != (args.transfer == "samenode"):
            print(f"the prefill opened {links} same-node link(s) with --transfer {args.transfer}", flush=True)
            bad += 1
        print(f"{args.device} {args.dtype} {args.transfer}: {len(prompts) - bad} of {len(prompts)} P/D "
              f"texts equal the engine alone; held after: {leaked or 'nothing'}", flush=True)
        return 1 if bad or leaked else 0
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    raise SystemExit(main())
