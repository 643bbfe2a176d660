"""``build_sim_server_engine(args, role)``: the ServerParts of a server on the simulated engine
(``--engine sim --sim-profile PATH``: ``pdserve.engine.sim``), the sim's counterpart of
``server_setup.build_server_engine``'s built-in path. Loads no torch.

1. The profile (a JSON file, or a shipped one by name) gives the model's shape and step time; --dtype is
   the profile's (its KV bytes), --device must be cpu (nothing runs on a device).
2. The tokenizer: --model's ``tokenizer.json`` when --model is a directory that has one, else the
   byte-level tokenizer (the built-in and bench models').
3. The KV pool is sized by the usual flags (``kv_sizing``: --num-blocks, --kv-cache-memory, the CPU
   default) at the profile's bytes per block, and the CacheStore registers a region of that size: an
   anonymous memory map, so only the pages KV is written to take memory (a block moved between a sim
   prefill and a sim decode is the real number of bytes).
4. The Compat the Session carries tags the model ``+sim``: a sim server pairs only with sim servers.

Not built: a scaled payload with a modelled link time (the bytes move at the wire's own speed), KV
tiers, the decode's swap to host memory (--eviction is turned off), --kv-pool, tensor parallelism.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from pathlib import Path
from types import SimpleNamespace

from pdserve import kv_sizing
from pdserve.server_setup import ServerParts, kv_flags, resolve_device, served_model_name

log = logging.getLogger("pdserve.server")
SIM_MODEL_TAG = "+sim"  # on the Compat's model: a sim server pairs only with sim servers


def build_sim_server_engine(args, role: str) -> ServerParts:
    from pdserve.cachestore import CompatInfo, KVLayout, MemoryRegion
    from pdserve.engine.async_engine import AsyncLLMEngine
    from pdserve.engine.engine_config import EngineConfig
    from pdserve.engine.sim.engine import SimEngine
    from pdserve.engine.sim.profile import ProfileError, load_profile
    from pdserve.protos import session_pb2 as pb
    from pdserve.test_hooks import prefill_step_floor_s

    if not args.sim_profile:
        raise SystemExit("pdserve: --engine sim needs --sim-profile PATH (a profile JSON file, or a shipped one: "
                         "cpu-small, h200-llama3-8b)")
    if kv_sizing.is_cuda(args.device):
        raise SystemExit(f"pdserve: --engine sim runs on no device: --device cpu, got {args.device}")
    try:
        profile = load_profile(args.sim_profile)
    except ProfileError as exc:
        raise SystemExit(f"pdserve: {exc}") from None
    shape = profile.model
    if args.dtype and args.dtype != shape.dtype:
        log.info("--dtype %s ignored: --engine sim takes the profile's (%s)", args.dtype, shape.dtype)
    args.dtype = shape.dtype
    resolve_device(args)
    if role == "decode" and getattr(args, "eviction", False):
        log.info("KV eviction to host memory off: --engine sim keeps no KV to evict")
        args.eviction = False
    tokenizer = sim_tokenizer(args.model, shape.eos_token_ids, shape.vocab_size)
    max_len = args.max_model_len or shape.context_length
    compat = CompatInfo(dtype=shape.dtype, num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
                        head_dim=shape.head_dim, block_size=args.block_size)
    try:
        size = kv_sizing.size_kv_pool(kv_flags(args), dtype=shape.dtype, block_size=args.block_size,
                                      bytes_per_block=compat.block_nbytes * shape.num_layers)
        log.info("%s", size.describe())
        config = EngineConfig(num_blocks=size.num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                              max_model_len=max_len, max_num_batched_tokens=args.max_num_batched_tokens,
                              long_prefill_threshold=args.long_prefill_threshold,
                              kv_host_tier_bytes=args.kv_host_tier_bytes, kv_disk_tier_dir=args.kv_disk_tier_dir,
                              kv_disk_tier_bytes=args.kv_disk_tier_bytes,
                              tensor_parallel_size=args.tensor_parallel_size)
        sim = SimEngine(profile, tokenizer, config)
    except ValueError as exc:
        raise SystemExit(f"pdserve: cannot start the engine: {exc}") from None
    engine = AsyncLLMEngine(sim)
    if role == "prefill":
        engine.step_floor_s = prefill_step_floor_s()  # a test hook (pdserve/test_hooks.py), 0 in production
    layout = KVLayout(num_layers=shape.num_layers, num_blocks=size.num_blocks, block_nbytes=compat.block_nbytes)
    pool = mmap.mmap(-1, layout.nbytes)  # anonymous: pages take memory once written
    region = MemoryRegion(ctypes.addressof(ctypes.c_char.from_buffer(pool)), layout.nbytes, "cpu", 0, owner=pool)
    model_name = served_model_name(args)
    message = pb.Compat(dtype=shape.dtype, num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
                        head_dim=shape.head_dim, block_size=args.block_size, model=model_name + SIM_MODEL_TAG,
                        transport=args.transfer, kv_cache_dtype="auto")
    log.info("simulated engine: profile %s (%s), %d KV blocks, %d KV bytes per token", profile.name,
             profile.source[:120] or "no source given", size.num_blocks, shape.kv_bytes_per_token)
    loaded = SimpleNamespace(name=model_name, config=SimpleNamespace(vocab_size=shape.vocab_size), tokenizer=tokenizer)
    return ServerParts(loaded, engine, max_len, model_name, region, layout, compat, message)  # type: ignore[arg-type]


def sim_tokenizer(model: str, eos_token_ids, vocab_size: int):
    """--model's tokenizer.json when it is a directory holding one, else the byte-level tokenizer; a
    tokenizer whose ids exceed the profile's vocabulary exits naming both."""
    from pdserve.engine.tokenizer import ByteTokenizer, HFTokenizer

    path = Path(model)
    tokenizer = HFTokenizer(path, list(eos_token_ids)) if (path / "tokenizer.json").is_file() else ByteTokenizer()
    if tokenizer.vocab_size > vocab_size:
        raise SystemExit(f"pdserve: --model {model}'s tokenizer has {tokenizer.vocab_size} ids but the sim profile's "
                         f"vocabulary {vocab_size}: use the profile's model or a profile of this one")
    return tokenizer
