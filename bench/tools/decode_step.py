"""Decode step time of the engine at batch, before/after the three CPU decode changes, A B A B.

    .venv/bin/python bench/tools/decode_step.py [--cases 1x512,4x512,8x512,16x512,4x2048]

For each case (batch x prompt tokens) it prefills the batch once, then times decode steps of
the same engine while switching, step group by step group, between:
  linear:    F.linear everywhere (packed_linear.PLAIN_MAX_ROWS huge) vs the packed path;
  attention: the previous decode attention (SDPA over [B, KVH, L, D] views with a bool mask)
             vs ``decode_attend`` (the torch backend's, ``attention_backends.py``; both with the C++ kernel off);
  kernel:    the torch path (gather + ``decode_attend``) vs the C++ kernel over the paged cache
             in place (engine/native.py).
The clock is the thread's CPU time (one torch thread): robust on a shared box. Prints the
median step time of each side and the ratio new / old per case. ``--profile`` instead prints,
per case, torch.profiler's table of 20 decode steps as the engine runs them now (the ops by
their own CPU time): where a step's time goes. The model is the peer
experiment's checkpoint (``~/.cache/pdserve/bench-models/peer-model-peer-4096``, written by
``pdserve bench experiment peer``) or --model.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

import pdserve.engine.attention_backends as backends_mod
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, native, packed_linear
from pdserve.engine.attention import attend
from pdserve.engine.loader import load_model

PEER_MODEL = Path.home() / ".cache/pdserve/bench-models/peer-model-peer-4096"


def sdpa_decode(q, k, v, bias, scale=None):
    """The decode attention before decode_attend (the bool mask rebuilt from the bias, cached)."""
    if sdpa_decode.bias is not bias:
        sdpa_decode.bias, sdpa_decode.mask = bias, torch.isfinite(bias).view(bias.shape[0], 1, 1, -1)
    return attend(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), mask=sdpa_decode.mask, scale=scale).squeeze(2)


sdpa_decode.bias = sdpa_decode.mask = None
SIDES = {
    "linear": {"old": lambda: setattr(packed_linear, "PLAIN_MAX_ROWS", 10**9),
               "new": lambda: setattr(packed_linear, "PLAIN_MAX_ROWS", 3)},
    "attention": {"old": lambda: (_kernel(False), setattr(backends_mod, "decode_attend", sdpa_decode)),
                  "new": lambda: (_kernel(False), setattr(backends_mod, "decode_attend", NEW_ATTEND))},
    "kernel": {"old": lambda: _kernel(False), "new": lambda: _kernel(True)},
}
NEW_ATTEND = backends_mod.decode_attend  # (moved from model.py with the attention backends)
KERNEL = native.paged_decode_attention()


def _kernel(on: bool) -> None:
    """Decode attention through engine/native.py's C++ kernel (on) or the torch path (off)."""
    native._state.clear()
    native._state.update({"op": KERNEL} if on and KERNEL is not None else {"error": "switched off by the bench"})


def primed_engine(loaded, batch: int, prompt: int) -> LLMEngine:
    """An engine holding ``batch`` greedy requests of ``prompt`` random tokens, all prefilled:
    each later ``step()`` is one decode step of the whole batch (for 400 tokens)."""
    engine = LLMEngine(loaded, EngineConfig(num_blocks=batch * (prompt // 64 + 8) + 8, block_size=64,
                                            max_num_seqs=batch, max_num_batched_tokens=max(8192, batch * prompt),
                                            enable_prefix_cache=False))
    rng = random.Random(batch)
    sp = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [rng.randrange(loaded.config.vocab_size - 1) for _ in range(prompt)], sp)
    while engine.scheduler.waiting:
        engine.step()
    return engine


def profile(engine: LLMEngine, case: str, steps: int = 20) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(3):
        engine.step()
    t0 = time.thread_time()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    print(f"{case}: {(time.thread_time() - t0) / steps * 1000:.1f} ms per step under the profiler")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(PEER_MODEL))
    p.add_argument("--cases", default="1x512,4x512,8x512,16x512,4x2048")
    p.add_argument("--rounds", type=int, default=6, help="A B alternations per change (3 steps each)")
    p.add_argument("--profile", action="store_true", help="the ops of 20 steps per case (torch.profiler), no A B")
    args = p.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(args.model, dtype=torch.float32)
    for case in args.cases.split(","):
        batch, prompt = map(int, case.split("x"))
        engine = primed_engine(loaded, batch, prompt)
        if args.profile:
            profile(engine, case)
            continue
        row = {"batch": batch, "prompt": prompt}
        for change, sides in SIDES.items():
            times = {"old": [], "new": []}
            for r in range(args.rounds):
                for side in ("old", "new") if r % 2 == 0 else ("new", "old"):
                    sides[side]()
                    for _ in range(3):
                        t0 = time.thread_time()
                        engine.step()
                        times[side].append(time.thread_time() - t0)
            sides["new"]()
            old, new = (statistics.median(times[s]) * 1000 for s in ("old", "new"))
            row[change] = {"old_ms": round(old, 1), "new_ms": round(new, 1), "new/old": round(new / old, 3)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
