"""The engine's C++ decode attention (engine/csrc/paged_decode.cpp) against its torch path, per layer call.

    .venv/bin/python bench/tools/native_attention.py [--cases 1x640,4x640,12x640,12x2304,32x640] [--rounds 6] \
        [--kv-heads 2] [--block-size 64] [--kv-cache-dtypes auto,fp8] [--against REV]

Builds (or finds) the kernel through ``engine/native.py``, checks it against the torch path on one layer
(``KVCache.gather``'s two ``index_select`` + ``decode_attend``), then times both A B A B on one torch thread
(thread CPU time) per case: batch x context, 16 query heads of 64 over --kv-heads KV heads, blocks scattered
over the layer, contexts of 0.5-1x the case's length. Prints the median time per layer call of each and the
ratio kernel / torch path. ``--kv-cache-dtypes auto,fp8`` also times each case over an fp8 cache (rows of
float8_e4m3fn + a bfloat16 scale, engine/kv_quant.py; the torch path dequantizes in ``gather``), so the
fp8 kernel's time can be read against the same dtype's auto cache (the last column: fp8 / auto).

``--against REV`` (a git revision, e.g. ``HEAD~1``) also builds the kernel as it was at REV, under its
own op name, and times it in the same rounds: the third column is that kernel, the last ratio this
kernel / that one (how much a change to ``engine/csrc/paged_decode.cpp`` gained, measured A B A B).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

import torch

from pdserve.engine import native
from pdserve.engine.attention import decode_attend, mask_bias
from pdserve.engine.kv_cache import KVCache


def case(batch: int, length: int, dtype, kv_heads: int, bs: int, heads=16, dim=64, kv_dtype="auto"):
    """One layer of an engine KVCache with random K/V, each sequence's blocks scattered over it; q,
    block tables and context lengths (0.5-1x ``length``)."""
    g = torch.Generator().manual_seed(batch * 10007 + length)
    nb = -(-length // bs)
    kv = KVCache(1, 2 * batch * nb + 8, bs, kv_heads, dim, dtype, kv_dtype=kv_dtype)
    n = kv.num_blocks * bs
    rows = kv.slot_indices(torch.arange(n) // bs, torch.arange(n) % bs)
    kv.write(0, rows, torch.randn(n, kv_heads, dim, generator=g).to(dtype),
             torch.randn(n, kv_heads, dim, generator=g).to(dtype))
    tables = torch.randperm(kv.num_blocks, generator=g)[: batch * nb].view(batch, nb)
    ctx = torch.tensor([length - (i * 37) % (length // 2) for i in range(batch)])
    q = torch.randn(batch, heads, dim, generator=g).to(dtype)
    return q, kv, tables, ctx


def step_inputs(kv, tables, ctx, dtype):
    """What the engine builds once per step and every layer reuses: K rows of the padded tables, the bias."""
    rows = kv.table_rows(tables)
    mask = (torch.arange(rows.shape[1]) < ctx.unsqueeze(1)).view(len(ctx), 1, 1, -1)
    return rows, mask_bias(mask, dtype)


def engine_path(q, kv, rows, bias):
    """One layer as engine/model.py runs it on CPU without the kernel: KVCache.gather, then decode_attend."""
    k, v = kv.gather(0, rows)
    return decode_attend(q, k, v, bias, None)


def kernel(q, kv, tables, ctx):
    return native.paged_decode_attention()(q, kv.layer(0), tables, torch.zeros_like(ctx), ctx, q.shape[-1] ** -0.5)


def kernel_at(rev: str):
    """The kernel's source at git revision ``rev``, built under the op name pdserve_native_at_rev."""
    src = subprocess.run(["git", "show", f"{rev}:engine/csrc/paged_decode.cpp"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2])
    if src.returncode != 0:
        raise SystemExit(f"--against {rev}: {src.stderr.strip()}")
    try:
        op = native.build_variant("pdserve_native_at_rev", source_text=src.stdout)
    except RuntimeError as e:
        raise SystemExit(f"--against {rev}: {e}") from None
    return lambda q, kv, tables, ctx: op(q, kv.layer(0), tables, torch.zeros_like(ctx), ctx, q.shape[-1] ** -0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="1x640,4x640,12x640,12x2304,32x640", help="batch x context, comma list")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=6, help="A B rounds per case (8 calls each)")
    ap.add_argument("--kv-heads", type=int, default=2, help="KV heads (16 query heads of 64)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--kv-cache-dtypes", default="auto", help="auto and/or fp8, comma list")
    ap.add_argument("--against", metavar="REV", help="also time the kernel as it was at this git revision")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if native.paged_decode_attention() is None:
        raise SystemExit(f"the kernel is unavailable: {native.unavailable_reason()}")
    before = kernel_at(args.against) if args.against else None
    kernel_ms: dict[tuple, float] = {}  # (dtype, case, kv dtype) -> the kernel's median time
    for dtype, spec, kv_dtype in [(getattr(torch, d), c, k) for d in args.dtypes.split(",")
                                  for c in args.cases.split(",") for k in args.kv_cache_dtypes.split(",")]:
        batch, length = (int(x) for x in spec.split("x"))
        inputs = case(batch, length, dtype, args.kv_heads, args.block_size, kv_dtype=kv_dtype)
        q, kv, tables, ctx = inputs
        sides = {"engine": (engine_path, (q, kv, *step_inputs(kv, tables, ctx, dtype))), "kernel": (kernel, inputs)}
        if before is not None and kv_dtype == "auto":
            sides["before"] = (before, inputs)
        err = (engine_path(*sides["engine"][1]).float() - kernel(*inputs).float()).abs().max().item()
        times: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, (fn, fn_args) in sides.items():
                t = time.thread_time()
                for _ in range(8):
                    fn(*fn_args)
                times[name].append((time.thread_time() - t) / 8 * 1e3)
        e, p = statistics.median(times["engine"]), statistics.median(times["kernel"])
        then = ""
        if before is not None and kv_dtype == "auto":  # the kernel at REV may not read fp8 rows
            b = statistics.median(times["before"])
            then = f"  kernel at {args.against} {b:6.2f} ms  now / then {p / b:.2f}"
        kernel_ms[dtype, spec, kv_dtype] = p
        if kv_dtype != "auto" and (dtype, spec, "auto") in kernel_ms:
            then += f"  kernel {kv_dtype} / auto {p / kernel_ms[dtype, spec, 'auto']:.2f}"
        print(f"{str(dtype).removeprefix('torch.'):8s} kv {kv_dtype:4s} B={batch:<3d} L={length:<5d} torch path "
              f"{e:6.2f} ms  kernel {p:6.2f} ms  ratio {p / e:.2f}  max |diff| {err:.1e}{then}", flush=True)


if __name__ == "__main__":
    main()
