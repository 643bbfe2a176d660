"""P/D on one device, end to end: a real decode and prefill server, greedy text equal to the engine alone.

    python tools/pd_device_check.py [--device cuda] [--dtype bfloat16] [--model tiny] [--requests 4] [--transfer tcp|nixl|samenode]

Starts ``pdserve decode`` and ``pdserve prefill`` (``python -m pdserve``, this interpreter, free
loopback ports, KV over ``--transfer``: tcp by default, which on CUDA stages each layer through
pinned host memory; nixl needs the NIXL package; samenode: the decode's pool shared with the prefill,
which copies each layer straight into it, a device-to-device copy from CUDA IPC memory on cuda, a
memcpy into a memfd on the CPU: ``--kv-same-node on``, and the check fails unless the prefill
used it) on ``--device``, sends ``--requests`` greedy
completions of 32 tokens (prompts of 40-160 token ids) through the prefill's OpenAI endpoint one
after the other, and checks that each text equals what one LLMEngine on the same device gives
for the same prompt, and that after the last one both servers hold no KV block, Session or
CacheStore entry. Prints per request the end-to-end time and the verdict; exits 1 on any
difference. Meant for a machine where the test suite cannot run (a GPU box with only torch and a
few wheels): it needs no pytest.
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

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model
from pdserve.engine.defaults import BLOCK_SIZE
from pdserve.net import free_ports

NUM_BLOCKS = 128  # each server's KV pool, and the engine alone's
HELD = ("sessions", "kv_blocks_used", "in_flight", "queued")


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


def held(url: str) -> dict:
    health = get(url + "/health")[1]
    out = {k: health[k] for k in HELD if k in health}
    for key, value in (health.get("cachestore") or {}).items():
        if isinstance(value, (int, float)) and any(k in key for k in ("pinned", "inflight", "queued", "sending",
                                                                       "receiving", "waiters")):
            out[f"cachestore.{key}"] = value
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--transfer", default="tcp", choices=["tcp", "nixl", "samenode"],
                   help="the servers' KV transport (samenode: cachestore/samenode.py over tcp's control channel; "
                        "tcp and nixl run with --kv-same-node off)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="the KV cache of the engine alone and of both servers (fp8: FP8 KV moved with its scales)")
    args = p.parse_args()
    loaded = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, loaded.config.vocab_size - 1) for _ in range(rng.randrange(40, 160))]
               for _ in range(args.requests)]
    sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    expected = []
    for i, ids in enumerate(prompts):
        # the servers' block size, pool and batch limit: the same attention splits and graph buckets, so
        # the same roundings in bf16 (with blocks of 16, bf16 texts drifted apart on an H200 at near-ties)
        engine = LLMEngine(loaded, EngineConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=32,
                                                kv_cache_dtype=args.kv_cache_dtype))
        engine.add_request(f"r{i}", ids, sp)
        toks = []
        while engine.has_unfinished():
            for out in engine.step():
                toks += out.new_token_ids
        expected.append(loaded.tokenizer.decode(toks))
    del loaded
    dport, dhttp, kv, phttp, pgrpc = free_ports(5)
    common = ["--model", args.model, "--device", args.device, "--dtype", args.dtype, "--threads", "1",
              "--log-level", "WARNING", "--num-blocks", str(NUM_BLOCKS),
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
        bad = 0
        for i, ids in enumerate(prompts):
            t0 = time.perf_counter()
            body = post(purl + "/v1/completions", {"model": args.model, "prompt": ids, "max_tokens": 32,
                                                   "temperature": 0, "ignore_eos": True})
            text = body["choices"][0]["text"]
            same = text == expected[i]
            bad += not same
            print(f"request {i}: {len(ids)} prompt tokens, {time.perf_counter() - t0:.2f} s, "
                  f"{'same text as the engine alone' if same else 'DIFFERENT'}"
                  + ("" if same else f": {text!r} vs {expected[i]!r}"), flush=True)
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
