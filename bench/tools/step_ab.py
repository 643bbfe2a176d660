"""Decode step time of two checkouts of the engine (before / after a change), alternating A B A B.

    .venv/bin/python bench/tools/step_ab.py --tree before=/work/wt/old --tree after=. \
        [--cases 1x640,4x640,12x640,32x128] [--dtype float32] [--rounds 3]

Each tree is a checkout of this repository (``git worktree add /work/wt/old <rev>``); its code
runs in a child process of this environment's python with the editable install's package map
pointed at that tree, pinned to the last CPU, one torch thread. Per case (batch x prompt tokens)
the child prefills the batch, then times 15 decode steps on the thread's CPU clock and reports
the median. Rounds alternate the order (A B, B A, ...); the summary is the median per tree and
case, and each tree's ratio to the first. The model is the peer experiment's checkpoint
(``pdserve bench experiment peer`` writes it) or --model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = r'''
import json, statistics, sys, time
import torch
finder = next(m for n, m in sys.modules.items() if n.startswith("__editable___pdserve") and hasattr(m, "MAPPING"))
repo, tree, model, dtype, cases, tools = sys.argv[1:7]
for name, path in list(finder.MAPPING.items()):
    finder.MAPPING[name] = path.replace(repo, tree, 1)
sys.path.insert(0, tools)
from decode_step import PEER_MODEL, primed_engine  # imports the engine: after the map points at the tree
from pdserve.engine.loader import load_model
torch.set_num_threads(1)
loaded = load_model(model or str(PEER_MODEL), dtype=getattr(torch, dtype))
out = {}
for case in cases.split(","):
    batch, prompt = map(int, case.split("x"))
    engine = primed_engine(loaded, batch, prompt)
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(15):
        t0 = time.thread_time()
        engine.step()
        times.append(time.thread_time() - t0)
    out[case] = statistics.median(times) * 1000
print("RESULT " + json.dumps(out), flush=True)
'''


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tree", action="append", required=True, help="NAME=PATH of a checkout (two or more)")
    p.add_argument("--cases", default="1x640,4x640,12x640,32x128")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="", help="a checkpoint directory (default: the peer experiment's)")
    args = p.parse_args()
    trees = [(n, str(Path(t).resolve())) for n, t in (x.split("=", 1) for x in args.tree)]
    cpu = str(max(os.sched_getaffinity(0)))
    results: dict[str, list[dict]] = {n: [] for n, _ in trees}
    for r in range(args.rounds):
        for name, tree in trees if r % 2 == 0 else trees[::-1]:
            cmd = ["taskset", "-c", cpu, sys.executable, "-c", CHILD, str(REPO), tree, args.model, args.dtype,
                   args.cases, str(REPO / "bench" / "tools")]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                raise SystemExit(f"{name} ({tree}) failed:\n{proc.stderr[-3000:]}")
            results[name].append(json.loads(line[7:]))
            print(json.dumps({"round": r + 1, "tree": name, **{c: round(v, 1) for c, v in results[name][-1].items()}}),
                  flush=True)
    first = trees[0][0]
    print(f"median decode step, ms (thread CPU time), {args.dtype}, {args.rounds} rounds; ratio to {first}:")
    for name, _ in trees:
        cells = []
        for case in args.cases.split(","):
            med = statistics.median(x[case] for x in results[name])
            base = statistics.median(x[case] for x in results[first])
            cells.append(f"{case} {med:.1f} ({med / base:.2f})")
        print(f"  {name}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
