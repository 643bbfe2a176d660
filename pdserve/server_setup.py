"""What the prefill and decode servers share at start-up: engine flags, engine + CacheStore
construction, the compat message, and running until SIGTERM/SIGINT with a drain.

Both ``pdserve prefill`` and ``pdserve decode`` call ``add_engine_arguments`` and
``build_engine``; the KV pool tensor built here is the memory the CacheStore registers
once (``kv_region``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from pdserve import defaults
from pdserve.cachestore import TRANSPORTS


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and engine")
    g.add_argument("--model", default=defaults.BUILTIN_MODEL,
                   help=f"'{defaults.BUILTIN_MODEL}' (built-in, offline) or a directory with config.json + safetensors")
    g.add_argument("--served-model-name", default=None,
                   help="name clients use in 'model' (default: --model without a 'builtin:' prefix)")
    g.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="weights and KV cache dtype")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--block-size", type=int, default=defaults.BLOCK_SIZE, help="KV cache block size in tokens")
    g.add_argument("--num-blocks", type=int, default=256, help="KV cache blocks in the pool")
    g.add_argument("--max-num-seqs", type=int, default=32, help="most requests in one running batch")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--transfer", choices=TRANSPORTS, default="tcp", help="CacheStore transport for KV")
    g.add_argument("--session-timeout", type=float, default=30.0,
                   help="seconds a Session may wait for KV/first token/answers before both ends free it")
    g.add_argument("--log-level", default="INFO", help="logging level")


def served_model_name(args) -> str:
    """What clients put in "model": --served-model-name, else --model ("builtin:tiny" -> "tiny")."""
    if args.served_model_name:
        return args.served_model_name
    return args.model.removeprefix("builtin:")


def setup_logging(level: str, role: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")


def build_engine(args):
    """(loaded model, AsyncLLMEngine) from the flags; not started."""
    import torch

    from pdserve.engine import AsyncLLMEngine, EngineConfig, LLMEngine, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    try:
        loaded = load_model(args.model, dtype=dtype, device=args.device)
        max_len = args.max_model_len or loaded.config.max_position_embeddings
        cfg = EngineConfig(num_blocks=args.num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                           max_model_len=max_len)
        engine = LLMEngine(loaded, cfg)
    except (ValueError, OSError) as exc:  # bad flags or model files: a message, not a traceback
        raise SystemExit(f"pdserve: cannot start the engine: {exc}") from None
    return loaded, AsyncLLMEngine(engine), max_len


def kv_parts(engine, loaded, args):
    """(MemoryRegion, KVLayout, CompatInfo) of the engine's KV pool for the CacheStore."""
    from pdserve.cachestore import CompatInfo, KVLayout, MemoryRegion

    kv = engine.kv_cache
    layout = KVLayout(num_layers=kv.num_layers, num_blocks=kv.num_blocks, block_nbytes=kv.block_nbytes)
    compat = CompatInfo(dtype=args.dtype, num_layers=kv.num_layers, num_kv_heads=kv.num_kv_heads,
                        head_dim=kv.head_dim, block_size=kv.block_size)
    return MemoryRegion.from_tensor(kv.tensor), layout, compat


def compat_message(engine, args, model_name: str):
    from pdserve.protos import session_pb2 as pb

    kv = engine.kv_cache
    return pb.Compat(dtype=args.dtype, num_layers=kv.num_layers, num_kv_heads=kv.num_kv_heads, head_dim=kv.head_dim,
                     block_size=kv.block_size, model=model_name, transport=args.transfer)


async def wait_for_stop_signal() -> str:
    """Return the name of the first SIGTERM/SIGINT received."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: fut.done() or fut.set_result(s.name))
    return await fut


async def drain(count_fn, grace_s: float) -> int:
    """Wait until ``count_fn()`` is 0 or ``grace_s`` passes; return what is left."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while count_fn() > 0 and loop.time() < deadline:
        await asyncio.sleep(0.05)
    return count_fn()
