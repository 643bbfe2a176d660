"""The event loop's CPU per decode step for a step's outputs delivered one wake-up per output (before) or one
per step (``EngineThread._deliver_all``), alternating A B A B in one process.

    .venv/bin/python docs/bench_raw/2026-12-06-seam3/tools/deliver_ab.py [--streams 16] [--tokens 200] [--rounds 4]

Each run: an AsyncLLMEngine on the built-in model, ``--streams`` greedy requests generating ``--tokens``
each at once, consumed by coroutines on this thread's event loop (as a server's sessions consume them,
without the gRPC write). Measured: the event loop thread's CPU time (``time.thread_time`` around the run,
on the loop's thread) divided by the engine's steps, and the run's wall time. Prints each run and the
median per variant with the ratio after / before. The engine thread and the loop share the box's cores:
name the CPU and the load with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from pdserve.engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams, load_model
from pdserve.engine.engine_thread import EngineThread


def per_output(self, outs) -> None:
    """The delivery before: one call_soon_threadsafe (a wake-up of the loop) per output."""
    for out in outs:
        self._deliver(out)


async def one_run(loaded, streams: int, tokens: int) -> dict:
    engine = LLMEngine(loaded, EngineConfig(num_blocks=streams * (tokens // 16 + 4), block_size=16,
                                            max_num_seqs=streams, enable_prefix_cache=False))
    aeng = AsyncLLMEngine(engine)
    await aeng.start()
    sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)

    async def consume(i: int) -> int:
        n = 0
        async for out in aeng.generate(f"r{i}", [5 + i, 9, 13, 2, 7], sp):
            n += len(out.new_token_ids)
        return n

    cpu0, wall0 = time.thread_time(), time.perf_counter()
    counts = await asyncio.gather(*[consume(i) for i in range(streams)])
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    await aeng.stop()
    assert counts == [tokens] * streams, counts
    # all requests run together (max_num_seqs = streams): one prefill step, then one step per further token
    return {"loop_cpu_ms_per_step": 1000 * cpu / tokens, "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    loaded = load_model("tiny")
    after = EngineThread._deliver_all
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for variant in ("before", "after") if r % 2 == 0 else ("after", "before"):
            EngineThread._deliver_all = per_output if variant == "before" else after
            res = asyncio.run(one_run(loaded, args.streams, args.tokens))
            runs[variant].append(res)
            print(json.dumps({"round": r + 1, "variant": variant, **{k: round(v, 4) for k, v in res.items()}}),
                  flush=True)
    EngineThread._deliver_all = after
    med = {v: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for v, rs in runs.items()}
    print(f"{args.streams} streams x {args.tokens} tokens, {args.rounds} rounds, medians (after / before):")
    for k in med["before"]:
        print(f"  {k}: before {med['before'][k]:.4g}, after {med['after'][k]:.4g} "
              f"({med['after'][k] / med['before'][k]:.3f}x)")
    pairs = [a["loop_cpu_ms_per_step"] / b["loop_cpu_ms_per_step"] for a, b in zip(runs["after"], runs["before"])]
    print("  loop CPU per step, after / before per round: " + ", ".join(f"{x:.3f}" for x in pairs))


if __name__ == "__main__":
    main()
