"""How much of the decode step would an attention that reads the paged KV in place save (issue 16)?

    .venv/bin/python tools/paged_attention/bench.py [--cases 1x640,4x640,12x640,12x2304,32x640] [--rounds 6]

Builds ``attention.cpp`` (a prototype C++ op, not on the serving path) with g++ against the
installed torch (cached under ``~/.cache/pdserve/paged-attention/<hash>``), checks it against the
engine's path on one layer (``KVCache.gather``'s two ``index_select`` + ``decode_attend``), then
times both A B A B on one torch thread (thread CPU time) per case: batch x context, 16 query / 2 KV
heads of 64, blocks of 16 scattered over a 2048-block layer, contexts of 0.5-1x the case's length.
Prints the median time per layer call of each and the ratio prototype / engine.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import include_paths

from pdserve.engine.attention import decode_attend, mask_bias

HERE = Path(__file__).resolve().parent


def build() -> Path:
    src = HERE / "attention.cpp"
    key = hashlib.sha256(src.read_bytes() + torch.__version__.encode()).hexdigest()[:16]
    out = Path.home() / ".cache/pdserve/paged-attention" / key / "attention.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        lib = Path(torch.__file__).parent / "lib"
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        cmd = ["g++", "-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp-simd", "-shared",
               "-fPIC", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *[f"-I{p}" for p in include_paths()],
               str(src), f"-L{lib}", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}", "-o", str(out)]
        print("building the prototype (about a minute) ...", flush=True)
        subprocess.run(cmd, check=True)
    return out


def case(batch: int, length: int, dtype, heads=16, kv_heads=2, dim=64, bs=16, num_blocks=2048):
    g = torch.Generator().manual_seed(batch * 10007 + length)
    layer = torch.randn(num_blocks, 2, bs, kv_heads, dim, generator=g).to(dtype)
    nb = -(-length // bs)
    tables = torch.randperm(num_blocks, generator=g)[: batch * nb].view(batch, nb)
    ctx = torch.tensor([length - (i * 37) % (length // 2) for i in range(batch)])
    q = torch.randn(batch, heads, dim, generator=g).to(dtype)
    return q, layer, tables, ctx


def step_inputs(q, layer, tables, ctx):
    """What the engine builds once per step and every layer reuses: K rows of the padded tables, the bias."""
    bs = layer.shape[2]
    rows = (tables.unsqueeze(-1) * (2 * bs) + torch.arange(bs)).view(tables.shape[0], -1)
    mask = (torch.arange(rows.shape[1]) < ctx.unsqueeze(1)).view(len(ctx), 1, 1, -1)
    return rows, mask_bias(mask, q.dtype)


def engine_path(q, layer, rows, bias):
    """One layer as engine/model.py runs it on CPU: KVCache.gather, then decode_attend."""
    bs = layer.shape[2]
    flat = layer.view(-1, layer.shape[3], layer.shape[4])
    k = flat.index_select(0, rows.reshape(-1)).view(*rows.shape, *flat.shape[1:])
    v = flat.index_select(0, rows.reshape(-1) + bs).view(*rows.shape, *flat.shape[1:])
    return decode_attend(q, k, v, bias, None)


def prototype(q, layer, tables, ctx):
    return torch.ops.pdserve.paged_decode_attention(q, layer, tables, ctx, torch.zeros_like(ctx), q.shape[-1] ** -0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="1x640,4x640,12x640,12x2304,32x640", help="batch x context, comma list")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=6, help="A B rounds per case (8 calls each)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.ops.load_library(str(build()))
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        for spec in args.cases.split(","):
            batch, length = (int(x) for x in spec.split("x"))
            inputs = case(batch, length, dtype)
            q, layer = inputs[0], inputs[1]
            sides = {"engine": (engine_path, (q, layer, *step_inputs(*inputs))), "prototype": (prototype, inputs)}
            err = (engine_path(*sides["engine"][1]).float() - prototype(*inputs).float()).abs().max().item()
            times: dict[str, list[float]] = {"engine": [], "prototype": []}
            for _ in range(args.rounds):
                for name, (fn, fn_args) in sides.items():
                    t = time.thread_time()
                    for _ in range(8):
                        fn(*fn_args)
                    times[name].append((time.thread_time() - t) / 8 * 1e3)
            e, p = statistics.median(times["engine"]), statistics.median(times["prototype"])
            print(f"{str(dtype).removeprefix('torch.'):8s} B={batch:<3d} L={length:<5d} engine {e:6.2f} ms  "
                  f"prototype {p:6.2f} ms  ratio {p / e:.2f}  max |diff| {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
