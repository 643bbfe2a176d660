"""KV transfer of a Pp -> Dd pair on the CPU: the per-rank push against rank 0's gather, A B A B.

    .venv/bin/python bench/tools/tp_kv_push.py [--rounds 4] [--prompt-len 2048] [--transfer tcp] \
        [--prefill-tp 2] [--decode-tp 2]

Two P/D pairs run side by side, each a prefill of tensor-parallel size ``--prefill-tp`` and a decode of
``--decode-tp`` (one torch thread per rank) on the peer experiment's ~121M-parameter random Llama
(``experiments/peer_model.py`` "peer": 8 layers, 2 KV heads; float32): A, both ends ``--kv-push per-rank``
(each piece, heads of one decode rank from one prefill rank, on its own CacheStore sender straight into the
decode rank holding those heads; P1 -> D2: each decode rank a slice of the prefill's heads, packed contiguous;
P2 -> D1: each prefill rank's head into a staging pool of the decode, unpacked); B, the prefill ``--kv-push
gather`` (the decode then answers with rank 0's receiver: every head gathered into the prefill's transfer pool
per layer at P > 1, scattered from the decode's at D > 1). Each round sends one request of ``--prompt-len`` random
tokens, max_tokens 1, to A then B (B then A every other round) over gRPC, and reads the prefill's
/debug/requests timings:

- ``kv transfer``: the first layer handed to the CacheStore -> the last layer delivered (overlaps compute);
- ``tail``: the prompt computed -> the last layer delivered (the transfer time compute did not hide);
- ``prefill``: the decode's Allocation -> the prompt computed (the gather, if any, runs inside it);
- ``ttft``: the client's request -> its first token (the decode's scatter, if any, is inside it).

A ratio is the median over rounds of B's time over A's (above 1: the per-rank push is faster), with its
min-max. Then the KV bytes each decode received, from its /health: on rank 0's transfer pool (the receiver on
--kv-port: the gather path's, every head), on each rank's own receiver, and on head slices' staging receivers.
The CPU is named from lscpu and the load average printed before and after: the box may be shared,
and up to 8 processes (2 pairs x 2 servers x 2 ranks) share its cores.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc

from pdserve.bench.experiments.launcher import Launcher
from pdserve.bench.experiments.peer_model import peer_config
from pdserve.bench.provenance import git_state, machine

BLOCK_SIZE = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_pair(launcher: Launcher, name: str, model: str, blocks: int, transfer: str, push: str,
               sizes: tuple[int, int]) -> str:
    """A decode and a prefill of TP sizes ``sizes`` (prefill, decode); the prefill's gRPC and HTTP address and the
    decode's HTTP address."""
    common = ["--model", model, "--threads", "1", "--block-size", str(BLOCK_SIZE),
              "--num-blocks", str(blocks), "--transfer", transfer, "--kv-same-node", "off", "--log-level", "WARNING"]
    d_grpc, d_http, d_kv, p_http, p_grpc = (free_port() for _ in range(5))
    rank_ports = ",".join(str(free_port()) for _ in range(sizes[1] + 2))  # the ranks', then head slices'
    decode = launcher.start(f"{name}-decode", ["decode", "--port", str(d_grpc), "--http-port", str(d_http),
                                               "--kv-port", str(d_kv), "--kv-rank-ports", rank_ports,
                                               "--tensor-parallel-size", str(sizes[1]), *common])
    launcher.wait_ready(decode, f"http://127.0.0.1:{d_http}/ready", timeout=600)
    prefill = launcher.start(f"{name}-prefill", ["prefill", "--port", str(p_http), "--grpc-port", str(p_grpc),
                                                 "--decode", f"127.0.0.1:{d_grpc}", "--disaggregation", "always",
                                                 "--max-num-batched-tokens", "4096", "--kv-push", push,
                                                 "--tensor-parallel-size", str(sizes[0]), *common])
    launcher.wait_ready(prefill, f"http://127.0.0.1:{p_http}/ready", timeout=600)
    return f"127.0.0.1:{p_grpc} 127.0.0.1:{p_http} 127.0.0.1:{d_http}"


def one_request(addresses: str, rid: str, prompt: list[int]) -> dict:
    """Send one request; its TTFT and the prefill's timings of it (seconds)."""
    from pdserve.protos import generate_pb2 as gpb
    from pdserve.protos import generate_pb2_grpc as gpb_grpc

    grpc_address, http_address, _ = addresses.split()
    start = time.monotonic()
    with grpc.insecure_channel(grpc_address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        for _ in gpb_grpc.GeneratorStub(ch).Generate(gpb.GenerateRequest(
                prompt_token_ids=prompt, max_tokens=1, temperature=0, ignore_eos=True, request_id=rid), timeout=600):
            break
    ttft = time.monotonic() - start
    with urllib.request.urlopen(f"http://{http_address}/debug/requests/{rid}", timeout=30) as resp:
        t = json.loads(resp.read())
    return {"kv transfer": t["kv_sent"] - t["layer_stored"][0], "tail": t["kv_sent"] - t["prefill_done"],
            "prefill": t["prefill_done"] - t["allocated"], "ttft": ttft}


def health(addresses: str, which: int = 1) -> dict:
    """The prefill's (``which`` 1) or the decode's (2) /health."""
    with urllib.request.urlopen(f"http://{addresses.split()[which]}/health", timeout=30) as resp:
        return json.loads(resp.read())


def received(addresses: str) -> str:
    """The decode's KV bytes by receiver, in MiB: rank 0's transfer pool (the gather path's), each rank's own, the
    head slices' staging pools."""
    h = health(addresses, 2)
    push = h["kv_push"] or {}
    ranks, slices = push.get("bytes_received", []), push.get("slice_bytes_received", 0)
    own = push.get("ranks", 0) > 1  # at decode TP 1 the rank's receiver is the one on --kv-port
    total = h["cachestore"]["bytes_received"]
    transfer = total - (sum(ranks) if own else 0) - slices
    mib = 1 << 20
    return (f"total {total / mib:.1f} MiB: rank 0's transfer pool{'' if own else ' (= its pool at TP 1)'} "
            f"{transfer / mib:.1f}, ranks' own {[round(b / mib, 1) for b in ranks] if own else '-'}, "
            f"head slices {slices / mib:.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--transfer", choices=["tcp", "nixl"], default="tcp")
    p.add_argument("--prefill-tp", type=int, default=2)
    p.add_argument("--decode-tp", type=int, default=2)
    a = p.parse_args()
    sizes = (a.prefill_tp, a.decode_tp)
    max_len = a.prompt_len + 64
    cfg = peer_config("peer", max_len)
    m = machine()
    commit, dirty = git_state()
    print(f"{m['cpu_model']} ({m['cpus']} CPUs), load average {m['load_avg']}; commit {commit}"
          f"{' (dirty)' if dirty else ''}")
    import random

    rng = random.Random(0)
    blocks = 2 * (max_len // BLOCK_SIZE + 2)
    with tempfile.TemporaryDirectory() as tmp, Launcher(Path(tmp) / "logs") as launcher:
        from pdserve.engine.checkpoint import random_hf_weights, save_hf_checkpoint

        save_hf_checkpoint(random_hf_weights(cfg, seed=0, std=0.05), cfg, tmp)
        print(f"peer Llama: hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_heads}/{cfg.num_kv_heads} "
              f"heads, float32; P{sizes[0]} -> D{sizes[1]} over {a.transfer}; {a.prompt_len}-token prompts; "
              f"{a.rounds} rounds, order reversed every other round")
        pairs = {"A per-rank": start_pair(launcher, "a", tmp, blocks, a.transfer, "per-rank", sizes),
                 "B gather": start_pair(launcher, "b", tmp, blocks, a.transfer, "gather", sizes)}
        names = list(pairs)
        for name in names:  # warm-up
            one_request(pairs[name], f"warm-{name[0]}", [rng.randrange(cfg.vocab_size - 2) for _ in range(256)])
        times: dict[str, list[dict]] = {name: [] for name in names}
        for r in range(a.rounds):
            prompt = [rng.randrange(cfg.vocab_size - 2) for _ in range(a.prompt_len)]
            for name in names if r % 2 == 0 else reversed(names):
                times[name].append(one_request(pairs[name], f"r{r}-{name[0]}", prompt))
        paths = {name: health(pairs[name])["kv_push"] or {} for name in names}
        bytes_in = {name: received(pairs[name]) for name in names}
    print(f"per-rank pieces sent (A): {paths['A per-rank'].get('shards_sent')}, of them slices packed: "
          f"{paths['A per-rank'].get('sliced')}, whole-head pushes (A): {paths['A per-rank'].get('whole_heads')}; "
          f"B speaks no per-rank push: {paths['B gather'] == {}}")
    for name in names:
        print(f"  decode {name}: KV received {bytes_in[name]}")
    for what in ("kv transfer", "tail", "prefill", "ttft"):
        a_t, b_t = [t[what] for t in times[names[0]]], [t[what] for t in times[names[1]]]
        ratios = [b / x for b, x in zip(b_t, a_t) if x > 0]
        print(f"  {what:12s} per-rank {statistics.median(a_t) * 1e3:8.1f} ms   gather "
              f"{statistics.median(b_t) * 1e3:8.1f} ms   gather / per-rank {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f})")
    print(f"load average after: {list(os.getloadavg())}")


if __name__ == "__main__":
    main()
