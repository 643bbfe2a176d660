"""The linear layers of a decode step, separate projections vs merged ``qkv_proj`` / ``gate_up_proj``, A B A B.

    .venv/bin/python bench/tools/linear_merge.py [--rows 1,2,3,4,8,10,16] [--rounds 8]

The peer experiment's shapes (hidden 1024, 16 query and 2 KV heads of 64, intermediate 2816, 8
layers, fp32, random weights), one torch thread, each side run as the engine runs it
(``engine/packed_linear.py``): at up to PLAIN_MAX_ROWS rows F.linear, above that the oneDNN
packed weights, where PACK_MIN_ELEMENTS allows (separately, k and v are too small and stay on
F.linear). "separate": q, k, v, o, gate, up, down one call each (the layer before the merge);
"merged": q|k|v and gate|up stacked into one weight each (as vLLM loads them), one packed GEMM
per stack with the outputs split as views; at up to PLAIN_MAX_ROWS rows one F.linear per part on
row views of the stacked weight. "stacked": one F.linear on the whole stack at those rows too.
The clock is the thread's CPU time; prints the median per side and each / separate per row count.

Why the engine keeps separate projections: on the development box (2026-11-27) merged was
0.996-1.032x separate at 1-10 rows and 0.97x at 16, stacked 1.01-1.03x at 1-10 rows and 0.95x at
16; the engine's decode step with merged projections, A B against the separate ones, was no
faster at batch 1-10 within the box's noise.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pdserve.engine.packed_linear import PACK_BATCH_HINT, PACK_MIN_ELEMENTS, PLAIN_MAX_ROWS

H, I, KV, LAYERS = 1024, 2816, 128, 8


def make_layer(rng: torch.Generator) -> dict:
    w = {n: torch.randn(o, i, generator=rng) * 0.02
         for n, o, i in (("q", H, H), ("k", KV, H), ("v", KV, H), ("o", H, H), ("gate", I, H), ("up", I, H),
                         ("down", H, I))}
    w["qkv"] = torch.cat([w["q"], w["k"], w["v"]])
    w["gate_up"] = torch.cat([w["gate"], w["up"]])
    packed = {n: torch.ops.mkldnn._reorder_linear_weight(t, PACK_BATCH_HINT) for n, t in w.items()
              if t.numel() >= PACK_MIN_ELEMENTS}
    return {"w": w, "packed": packed}


def lin(x: torch.Tensor, layer: dict, name: str) -> torch.Tensor:
    packed = layer["packed"].get(name)
    if packed is None or x.shape[0] <= PLAIN_MAX_ROWS:
        return F.linear(x, layer["w"][name])
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")


def separate(x: torch.Tensor, layers: list[dict]) -> None:
    for layer in layers:
        q, _, _ = lin(x, layer, "q"), lin(x, layer, "k"), lin(x, layer, "v")
        o = lin(q, layer, "o")
        lin(F.silu(lin(o, layer, "gate")).mul_(lin(o, layer, "up")), layer, "down")


def lin_split(x: torch.Tensor, layer: dict, name: str, sizes: list[int]) -> list[torch.Tensor]:
    """One GEMM on the packed stack, else F.linear per part (row views of the stacked weight)."""
    if name in layer["packed"] and x.shape[0] > PLAIN_MAX_ROWS:
        return list(lin(x, layer, name).split(sizes, dim=-1))
    weight, start, parts = layer["w"][name], 0, []
    for n in sizes:
        parts.append(F.linear(x, weight[start:start + n]))
        start += n
    return parts


def merged(x: torch.Tensor, layers: list[dict], split=lin_split) -> None:
    for layer in layers:
        q, _, _ = split(x, layer, "qkv", [H, KV, KV])
        o = lin(q, layer, "o")
        gate, up = split(o, layer, "gate_up", [I, I])
        lin(F.silu(gate).mul_(up), layer, "down")


def stacked(x: torch.Tensor, layers: list[dict]) -> None:
    """merged, with one F.linear on the whole stack at any row count too."""
    merged(x, layers, lambda x, layer, name, sizes: list(lin(x, layer, name).split(sizes, dim=-1)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,2,3,4,8,10,16", help="decode batch sizes (rows per linear call)")
    p.add_argument("--rounds", type=int, default=8, help="A B alternations per row count (2 passes each)")
    args = p.parse_args()
    torch.set_num_threads(1)
    rng = torch.Generator().manual_seed(0)
    layers = [make_layer(rng) for _ in range(LAYERS)]
    for rows in map(int, args.rows.split(",")):
        x = torch.randn(rows, H, generator=rng)
        sides = {"separate": separate, "merged": merged, "stacked": stacked}
        times = {name: [] for name in sides}
        for r in range(args.rounds):
            for name in sides if r % 2 == 0 else reversed(sides):
                t0 = time.thread_time()
                for _ in range(2):
                    sides[name](x, layers)
                times[name].append((time.thread_time() - t0) / 2 * 1000)
        ms = {name: statistics.median(t) for name, t in times.items()}
        print(f"{rows:3d} rows, ms per step's linears: separate {ms['separate']:6.1f}, merged {ms['merged']:6.1f} "
              f"({ms['merged'] / ms['separate']:.3f}), stacked {ms['stacked']:6.1f} "
              f"({ms['stacked'] / ms['separate']:.3f})",
              flush=True)


if __name__ == "__main__":
    main()
