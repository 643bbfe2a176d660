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

5. A scaled payload (``--sim-kv-scale N``): the CacheStore's blocks are 1/N of the profile's bytes (its wire
   shape, ``wire_compat``: one KV head of ``kv_heads * head_dim / N``), so the region, the pages touched and the
   bytes moved are 1/N; the pool's size in blocks is the profile's (sized at the real bytes per block).
6. A modelled link (``--sim-link-gbps``, ``--sim-link-latency-us``, prefill): the sender paces each slice as the
   modelled link would carry its real bytes (``cachestore/link_model.py``).

Not built: KV tiers, the decode's swap to host memory (--eviction is turned off), --kv-pool, tensor
parallelism.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from pathlib import Path
from types import SimpleNamespace

from pdserve import kv_sizing
from pdserve.server_setup import ServerParts, kv_flags, resolve_device, served_model_name, step_switches

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
    real = CompatInfo(dtype=shape.dtype, num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
                      head_dim=shape.head_dim, block_size=args.block_size)
    compat = wire_compat(real, args.sim_kv_scale)
    try:
        size = kv_sizing.size_kv_pool(kv_flags(args), dtype=shape.dtype, block_size=args.block_size,
                                      bytes_per_block=real.block_nbytes * shape.num_layers)
        log.info("%s", size.describe())
        config = EngineConfig(num_blocks=size.num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                              max_model_len=max_len, max_num_batched_tokens=args.max_num_batched_tokens,
                              long_prefill_threshold=args.long_prefill_threshold,
                              solo_prompt_tokens=args.solo_prompt_tokens or 0,  # a profile names no device: as given
                              kv_host_tier_bytes=args.kv_host_tier_bytes, kv_disk_tier_dir=args.kv_disk_tier_dir,
                              kv_disk_tier_bytes=args.kv_disk_tier_bytes,
                              tensor_parallel_size=args.tensor_parallel_size, **step_switches(args))
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
    message = pb.Compat(dtype=shape.dtype, num_layers=shape.num_layers, num_kv_heads=compat.num_kv_heads,
                        head_dim=compat.head_dim, block_size=args.block_size, model=model_name + SIM_MODEL_TAG,
                        transport=args.transfer, kv_cache_dtype="auto")
    log.info("simulated engine: profile %s (%s), %d KV blocks, %d KV bytes per token", profile.name,
             profile.source[:120] or "no source given", size.num_blocks, shape.kv_bytes_per_token)
    loaded = SimpleNamespace(name=model_name, config=SimpleNamespace(vocab_size=shape.vocab_size), tokenizer=tokenizer)
    link = sim_link_model(args, real.block_nbytes // compat.block_nbytes) if role == "prefill" else None
    if link is not None:
        log.info("%s", link.describe())
    return ServerParts(loaded, engine, max_len, model_name, region, layout, compat, message,  # type: ignore[arg-type]
                       link)


def wire_compat(real, scale: int):
    """The CacheStore's shape for ``--sim-kv-scale scale``: the real one (scale 1), or one KV head of
    ``kv_heads * head_dim / scale`` elements, so a block carries 1/scale of its real bytes."""
    from pdserve.cachestore import CompatInfo

    row = real.num_kv_heads * real.head_dim
    if scale < 1 or row % scale:
        raise SystemExit(f"pdserve: --sim-kv-scale {scale} must be >= 1 and divide kv_heads x head_dim ({row})")
    if scale == 1:
        return real
    return CompatInfo(dtype=real.dtype, num_layers=real.num_layers, num_kv_heads=1, head_dim=row // scale,
                      block_size=real.block_size)


def sim_link_model(args, payload_scale: int):
    """The prefill's modelled KV link (--sim-link-gbps), or None (the bytes move at the wire's speed)."""
    from pdserve.cachestore.link_model import LinkModel

    if args.sim_link_gbps is None:
        return None
    if args.transfer != "tcp":
        raise SystemExit(f"pdserve: --sim-link-gbps paces the tcp transport only, got --transfer {args.transfer}")
    try:
        return LinkModel(args.sim_link_gbps * 1e9 / 8, args.sim_link_latency_us / 1e6, payload_scale)
    except ValueError as exc:
        raise SystemExit(f"pdserve: --sim-link-gbps: {exc}") from None


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
