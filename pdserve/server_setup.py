"""What the prefill and decode servers share at start-up: their common flags, engine +
KV-pool construction, the compat message, and running until SIGTERM/SIGINT with a drain.

Start-up contract (both ``pdserve prefill`` and ``pdserve decode``):

1. ``add_server_arguments(parser, ...)`` (``server_args.py``) - the flags every server takes: --host,
   --drain-timeout, --tls-cert/--tls-key/--tls-ca (``tls.py``) and the model/engine/transfer group
   (model, dtype, block size, ...).
2. ``build_server_engine(args)`` -> ``ServerParts`` - --device checked and --dtype's default
   filled in, the model, the KV pool sized from --num-blocks / --kv-cache-memory /
   --gpu-memory-utilization (``kv_sizing.py``; one INFO line says how), the engine (a
   ``pdserve.engine.server_engine.ServerEngine``: the AsyncLLMEngine, or vLLM's; not started
   yet) and the KV pool's facts read once, before the engine thread runs: the memory region the
   CacheStore registers once, its layout and compat info, and the compat message the
   Session carries. ``--tensor-parallel-size N`` (``check_tensor_parallel``): the engine starts N - 1 worker
   ranks (engine/tp/); a rank that dies or hangs ends this process (``exit_server``, exit code 3).
3. ``wait_for_stop_signal()`` then ``drain(count, grace)`` - stop admitting, let what is
   in flight finish, then the caller stops its servers, CacheStore and engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pdserve import kv_sizing
from pdserve.cachestore.checksum import default_on as checksum_default_on
from pdserve.engine.kv_formats import describe as describe_kv
from pdserve.test_hooks import prefill_step_floor_s
from pdserve.server_args import (  # noqa: F401 - the servers' flags, re-exported for their callers
    ENGINES, KV_PUSH_MODES, add_engine_arguments, add_server_arguments, byte_size)


if TYPE_CHECKING:
    from pdserve.cachestore import CompatInfo, KVLayout, MemoryRegion
    from pdserve.engine import LLMEngine, LoadedModel, server_engine
    from pdserve.protos import session_pb2 as pb


log = logging.getLogger("pdserve.server")
# --engine vllm: reached by module name, lazily (only that module, in vLLM's environment, imports vllm)
VLLM_SERVER_MODULE = "pdserve.vllm_backend.server"
TP_LOST_EXIT_CODE = 3  # a tensor-parallel rank died or hung (exit_server): the supervisor restarts the server

def served_model_name(args) -> str:
    """What clients put in "model": --served-model-name, else --model ("builtin:tiny" -> "tiny")."""
    if args.served_model_name:
        return args.served_model_name
    return args.model.removeprefix("builtin:")


def setup_logging(level: str, role: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")


def resolve_device(args) -> None:
    """--device checked against this process (CUDA asked for where torch sees none: exit with a
    message naming CUDA and --device), and the defaults that follow from it, in ``args``: --dtype's
    and --kv-checksum's (cachestore/checksum.py: default_on)."""
    if kv_sizing.is_cuda(args.device):
        import torch

        try:
            kv_sizing.check_cuda(args.device, torch.cuda.is_available(), torch.cuda.device_count())
        except ValueError as exc:
            raise SystemExit(f"pdserve: {exc}") from None
    args.dtype = args.dtype or kv_sizing.default_dtype(args.device)
    if getattr(args, "kv_checksum", False) is None:
        args.kv_checksum, why = checksum_default_on(args.transfer, kv_sizing.is_cuda(args.device))
        log.info("KV checksums %s", why)


def kv_flags(args) -> kv_sizing.KVFlags:
    """The flags that size the KV pool (kv_sizing's precedence); bad values exit with a message."""
    try:
        flags = kv_sizing.KVFlags(args.device, args.num_blocks, args.kv_cache_memory, args.gpu_memory_utilization)
        flags.source()  # --gpu-memory-utilization on the CPU: refused before the model loads
        return flags
    except ValueError as exc:
        raise SystemExit(f"pdserve: {exc}") from None


def load_engine(args, kv_transfer: bool = False, role: str = "prefill") -> tuple[LoadedModel, LLMEngine, int]:
    """(loaded model, LLMEngine, context length) from the flags, the KV pool sized by kv_sizing (one
    INFO line says how); bad flags or files exit with a message. ``kv_transfer``: KV moves in or out (P/D):
    at --tensor-parallel-size > 1 rank 0 holds a transfer pool too (engine/tp/transfer.py), sized with it.
    A decode's CPU pool KV moves into (the pool, or the transfer pool) is in shared memory unless
    ``--kv-same-node off`` (a prefill of this machine writes KV straight into it)."""
    import torch

    from pdserve.engine import EngineConfig, LLMEngine, load_model
    from pdserve.engine.errors import TensorParallelError

    resolve_device(args)
    flags = kv_flags(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    try:
        loaded = load_model(args.model, dtype=dtype, device=args.device, quantization=args.quantization,
                            tensor_parallel_size=args.tensor_parallel_size)
        max_len = args.max_model_len or loaded.config.max_position_embeddings
        cfg = EngineConfig(num_blocks=None, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                           max_model_len=max_len, max_num_batched_tokens=args.max_num_batched_tokens,
                           long_prefill_threshold=args.long_prefill_threshold,
                           kv_host_tier_bytes=args.kv_host_tier_bytes,
                           kv_disk_tier_dir=args.kv_disk_tier_dir, kv_disk_tier_bytes=args.kv_disk_tier_bytes,
                           cuda_graphs=not args.enforce_eager, native_kernels=args.native_kernels,
                           packed_linear=args.packed_linear, fused_elementwise=args.fused_elementwise,
                           merged_projections=args.merged_projections, kv_cache_dtype=args.kv_cache_dtype,
                           tensor_parallel_size=args.tensor_parallel_size, kv_transfer=kv_transfer,
                           kv_push_per_rank=getattr(args, "kv_push", "gather") == "per-rank",
                           kv_checksum=bool(getattr(args, "kv_checksum", False)),
                           kv_cache_shared=role == "decode" and getattr(args, "kv_same_node", "off") != "off",
                           **step_switches(args))
        size = kv_sizing.size_kv_pool(
            flags, dtype=describe_kv(args.kv_cache_dtype, args.dtype), block_size=args.block_size,
            bytes_per_block=rank0_bytes_per_block(args, loaded, kv_transfer),
            measure_gpu=lambda: kv_sizing.measure_gpu_memory(loaded, cfg))
        log.info("%s", size.describe())
        if size.tokens < max_len:
            log.warning("the KV pool holds %d tokens, fewer than the context length %d: a request needing more "
                        "is refused", size.tokens, max_len)
        engine = LLMEngine(loaded, replace(cfg, num_blocks=size.num_blocks))
    except (ValueError, OSError, TensorParallelError) as exc:  # bad flags or model files, a rank that could not
        raise SystemExit(f"pdserve: cannot start the engine: {exc}") from None  # start: a message, not a traceback
    return loaded, engine, max_len


STEP_TRACE_STEPS = 500_000  # steps a decode's --step-trace keeps (the newest; about 100 MB at most)


def step_switches(args) -> dict:
    """The EngineConfig fields of a decode's step flags: --tbt-slo-ms (the TBT-bounded batch) and --step-trace
    (the step records, engine/step_trace.py); absent flags (the prefill's) leave both off."""
    return {"tbt_slo_ms": float(getattr(args, "tbt_slo_ms", 0.0) or 0.0),
            "step_trace": STEP_TRACE_STEPS if getattr(args, "step_trace", None) else 0}


def rank0_bytes_per_block(args, loaded: LoadedModel, kv_transfer: bool) -> int:
    """What one block id costs this process's device: its pool's KV heads (tensor parallelism: rank 0's, which
    every rank holds as many of), plus at --tensor-parallel-size > 1 with ``kv_transfer`` every KV head of the
    model again (rank 0's transfer pool, engine/tp/transfer.py): rank 0 is the tightest rank, so it sizes the
    pool every rank holds."""
    mc = loaded.model.cfg  # this rank's KV heads (tensor parallelism): the pool each rank holds
    heads = mc.num_kv_heads
    if kv_transfer and loaded.tensor_parallel_size > 1:
        heads += loaded.config.num_kv_heads
    return kv_sizing.pool_bytes_per_block(args.dtype, mc.num_layers, heads, mc.head_dim, args.block_size,
                                          args.kv_cache_dtype)


def moves_kv(args, role: str) -> bool:
    """Whether this server's KV moves in or out (P/D): a decode's always may; a prefill's unless it never
    disaggregates."""
    return role == "decode" or getattr(args, "disaggregation", "never") != "never"


@dataclass(slots=True)
class ServerParts:
    """The engine of one server process and the facts of its KV pool, read at start-up."""

    loaded: LoadedModel
    engine: server_engine.ServerEngine  # AsyncLLMEngine or vLLM's; not started: the caller awaits engine.start()
    max_model_len: int
    model_name: str  # what clients put in "model"
    region: MemoryRegion  # the KV pool tensor, registered once by the CacheStore
    layout: KVLayout
    compat: CompatInfo  # for the CacheStore handshake
    compat_message: pb.Compat  # for the Session's Start (prefill) and admission check (decode)
    link_model: Any = None  # --engine sim: the modelled KV link (cachestore/link_model.py) the sender paces by
    # one block of every layer, K and V, in each rank's pool (tensor parallelism: a rank's KV heads; every rank
    # holds the same block ids, so the tightest rank's free bytes are the free blocks times this); 0: the wire's
    rank_bytes_per_block: int = 0
    # the per-rank push (--kv-push per-rank; engine/tp/rank_pools.py): (region, layout, compat) of every rank's pool
    # in rank order, each compat naming the rank's KV heads; [] when this server does not offer it
    rank_parts: list = field(default_factory=list)
    rank_pools: list = field(default_factory=list)  # engine/tp/rank_pools.RankPool of each rank, as rank_parts
    tensor_parallel_size: int = 1
    kv_landed: set[str] | None = None  # the engine's LLMEngine.kv_landed (decode: KV in every rank's pool)

    @property
    def kv_bytes_per_block(self) -> int:
        """One block of every layer, K and V, as the CacheStore moves it (every KV head)."""
        return self.layout.block_nbytes * self.layout.num_layers

    @property
    def free_bytes_per_block(self) -> int:
        """What a free block is worth in a decode's free-memory report: its tightest rank's (one rank's pool)."""
        return self.rank_bytes_per_block or self.kv_bytes_per_block


def build_server_engine(args, role: str = "prefill") -> ServerParts:
    """Model, engine and KV facts from the flags; the KV pool is read here, before the
    engine thread starts (the engine is not started). ``--engine vllm``: vLLM's engine behind
    the same calls (``role`` "prefill" or "decode" sets its prefix cache). ``--engine sim``: the simulated
    engine (``sim_server.py``; loads no torch)."""
    check_tensor_parallel(args, role)
    if getattr(args, "engine", "builtin") != "sim" and (getattr(args, "sim_kv_scale", 1) != 1
                                                        or getattr(args, "sim_link_gbps", None) is not None):
        raise SystemExit("pdserve: --sim-kv-scale and --sim-link-gbps model a simulated cluster: they need "
                         "--engine sim")
    if getattr(args, "engine", "builtin") == "sim":
        from pdserve.sim_server import build_sim_server_engine  # loads no torch

        return build_sim_server_engine(args, role)
    from pdserve.engine import AsyncLLMEngine

    if getattr(args, "engine", "builtin") == "vllm":
        import importlib

        resolve_device(args)
        return importlib.import_module(VLLM_SERVER_MODULE).build_vllm_server_engine(args, role)

    loaded, llm, max_len = load_engine(args, kv_transfer=moves_kv(args, role), role=role)
    model_name = served_model_name(args)
    region, layout, compat = kv_parts(llm, args)
    engine = AsyncLLMEngine(llm)
    engine.on_lost = exit_server
    if role == "prefill":
        engine.step_floor_s = prefill_step_floor_s()  # a test hook (pdserve/test_hooks.py), 0 in production
    ranks = rank_parts(llm, args)
    pools = list(llm.rank_pools) if ranks else []
    return ServerParts(loaded, engine, max_len, model_name, region, layout, compat,
                       compat_message(llm, args, model_name, kv_push_version(pools)),
                       rank_bytes_per_block=llm.kv_cache.block_nbytes * llm.kv_cache.num_layers, rank_parts=ranks,
                       rank_pools=pools,
                       tensor_parallel_size=llm.config.tensor_parallel_size, kv_landed=llm.kv_landed)


def exit_server(exc: BaseException) -> None:
    """A tensor-parallel rank died or hung: the engine cannot step again, so the process ends now, one line
    naming the rank, and its supervisor (``pdserve up``, Kubernetes) restarts it."""
    log.critical("%s: exiting", exc)
    logging.shutdown()
    os._exit(TP_LOST_EXIT_CODE)


def check_tensor_parallel(args, role: str) -> None:
    """--tensor-parallel-size against the other flags: exit with one line naming the clash. A decode's KV
    eviction to host memory (lso.py) is turned off at N > 1 (each rank holds only its KV heads)."""
    n = getattr(args, "tensor_parallel_size", 1)
    if n < 1:
        raise SystemExit(f"pdserve {role}: --tensor-parallel-size must be >= 1, got {n}")
    if n == 1:
        return
    if getattr(args, "engine", "builtin") == "vllm":
        raise SystemExit(f"pdserve {role}: --tensor-parallel-size {n} needs the built-in engine (--engine builtin); "
                         "pass vLLM's own parallelism through its engine arguments")
    if role == "decode" and getattr(args, "kv_pool", ""):
        raise SystemExit(f"pdserve decode: --kv-pool needs --tensor-parallel-size 1 (lent blocks would hold rank 0's "
                         f"KV heads only), got {n}")
    if role == "decode" and getattr(args, "eviction", False):
        log.info("KV eviction to host memory off: --tensor-parallel-size %d (each rank holds only its KV heads)", n)
        args.eviction = False


def ensure_engine_environment(args) -> None:
    """``--engine vllm`` without vLLM here: re-run this command under the vLLM environment
    (vllm_backend/env.py), or exit naming the install command."""
    if getattr(args, "engine", "builtin") != "vllm":
        return
    import importlib

    env = importlib.import_module("pdserve.vllm_backend.env")
    try:
        env.ensure_vllm()
    except env.VllmMissing as exc:
        raise SystemExit(f"pdserve: {exc}") from None


def attach_kv_events(engine, publisher) -> None:
    """The engine's prefix cache publishes its KV events: the built-in engine's block manager, or
    vLLM's (``--engine vllm``: ``vllm_backend/kv_events.py``). Call before the engine thread
    starts."""
    inner = getattr(engine, "engine", None)
    if inner is not None and hasattr(inner, "block_manager"):
        inner.block_manager.listener = publisher
    elif hasattr(engine, "publish_kv_events"):
        engine.publish_kv_events(publisher)


def follow_tier_metrics(metrics, engine: server_engine.ServerEngine) -> None:
    """The pdserve_kv_tier_* metrics follow the engine's KV tiers (read at each scrape); none without tiers."""
    for tier in engine.tier_stats():
        def read(field: str, tier: str = tier):
            return lambda: getattr(engine.tier_stats()[tier], field)
        metrics.follow_counter("kv_tier_hits", read("hits"), tier=tier)
        metrics.follow_counter("kv_tier_evictions", read("evictions"), tier=tier)
        metrics.follow_counter("kv_tier_checksum_mismatches", read("checksum_mismatches"), tier=tier)
        metrics.follow_counter("kv_tier_write_errors", read("write_errors"), tier=tier)
        for direction in ("in", "out"):
            metrics.follow_counter("kv_tier_moved_bytes", read(f"bytes_{direction}"), tier=tier, direction=direction)
            metrics.follow_counter("kv_tier_move_time", read(f"seconds_{direction}"), tier=tier, direction=direction)
        metrics.follow_gauge("kv_tier_bytes", read("bytes"), tier=tier)


def kv_parts(engine: LLMEngine, args):
    """(MemoryRegion, KVLayout, CompatInfo) of the engine's KV pool for the CacheStore."""
    from pdserve.cachestore import CompatInfo, KVLayout, MemoryRegion

    kv = engine.transfer_cache  # every KV head: the pool, or with tensor parallelism rank 0's transfer pool
    layout = KVLayout(num_layers=kv.num_layers, num_blocks=kv.num_blocks, block_nbytes=kv.block_nbytes)
    compat = CompatInfo(dtype=args.dtype, num_layers=kv.num_layers, num_kv_heads=kv.num_kv_heads,
                        head_dim=kv.head_dim, block_size=kv.block_size, kv_dtype=kv.kv_dtype,
                        model_kv_heads=engine.model_config.num_kv_heads)
    return (MemoryRegion.from_tensor(kv.tensor, layer_written=kv.written_waiter, shared_fd=kv.shared_fd), layout,
            compat)


def rank_parts(engine: LLMEngine, args) -> list[tuple[MemoryRegion, KVLayout, CompatInfo]]:
    """(MemoryRegion, KVLayout, CompatInfo) of every rank's pool, in rank order, for the per-rank push (one
    CacheStore sender or receiver each: engine/tp/rank_pools.py); each compat names the rank's KV heads of the
    model's (a TP 1 server's one pool: every head, hashing as ``kv_parts``'). [] with --kv-push gather, or when the
    ranks' pools are not mapped here (CUDA)."""
    from pdserve.cachestore import CompatInfo, KVLayout, MemoryRegion

    if getattr(args, "kv_push", "gather") != "per-rank" or getattr(args, "engine", "builtin") != "builtin":
        return []
    kv, parts = engine.kv_cache, []
    for pool in engine.rank_pools:
        layout = KVLayout(num_layers=kv.num_layers, num_blocks=kv.num_blocks, block_nbytes=kv.block_nbytes)
        compat = CompatInfo(dtype=args.dtype, num_layers=kv.num_layers, num_kv_heads=len(pool.heads),
                            head_dim=kv.head_dim, block_size=kv.block_size, kv_dtype=kv.kv_dtype,
                            first_kv_head=pool.heads.start, model_kv_heads=engine.model_config.num_kv_heads)
        written = kv.written_waiter if pool.rank == 0 else None
        parts.append((MemoryRegion.from_tensor(pool.tensor, layer_written=written, shared_fd=pool.shared_fd), layout,
                      compat))
    return parts


def head_slice_parts(parts: ServerParts, rank: int, heads: range, shared: bool = False):
    """A staging pool for KV heads ``heads`` of rank ``rank``'s pool (engine/tp/pieces.py: a partial piece of the
    per-rank push), and its (MemoryRegion, KVLayout, CompatInfo): the compat of a rank holding exactly those heads,
    so it binds only to such a rank's pool (or slice). ``shared``: in a memfd (a decode's, offered to same-node
    senders). ValueError for heads that are not a part of the rank's."""
    from pdserve.cachestore import KVLayout, MemoryRegion
    from pdserve.engine.tp.pieces import HeadSlice

    pool = parts.rank_pools[rank]
    staged = HeadSlice(pool.tensor, pool.heads, heads, shared)
    compat = replace(parts.rank_parts[rank][2], num_kv_heads=len(heads), first_kv_head=heads.start)
    layout = KVLayout(num_layers=parts.layout.num_layers, num_blocks=parts.layout.num_blocks,
                      block_nbytes=compat.block_nbytes)
    return staged, MemoryRegion.from_tensor(staged.tensor, shared_fd=staged.shared_fd), layout, compat


def kv_push_version(rank_pools: list) -> int:
    """The per-rank push a server of these rank pools speaks (protos/version.py): KV_PUSH_VERSION where the pools
    are on the CPU (head slices packed and unpacked there: engine/tp/pieces.py), 1 (whole shards only) on a GPU,
    0 when it offers none (no pools: --kv-push gather, CUDA at N > 1)."""
    from pdserve.protos.version import KV_PUSH_VERSION

    if not rank_pools:
        return 0
    return KV_PUSH_VERSION if rank_pools[0].tensor.device.type == "cpu" else 1


def merged_stats(first, others) -> dict:
    """``first.stats()`` with the numeric counters of every other CacheStore end (not ``first`` itself) added: the
    entries a server holds, over all of its senders or receivers (what must come back to zero)."""
    out = dict(first.stats())
    for other in others:
        if other is first:
            continue
        for key, value in other.stats().items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(out.get(key, 0), int):
                out[key] = out.get(key, 0) + value
    return out


def compat_message(engine: LLMEngine, args, model_name: str, kv_push: int = 0):
    """The Compat a Session carries; ``kv_push``: the per-rank push this server offers (``kv_push_version``; 0:
    none)."""
    from pdserve.protos import session_pb2 as pb

    kv = engine.transfer_cache  # every KV head (the wire's blocks through rank 0, whatever the tensor-parallel size)
    return pb.Compat(dtype=args.dtype, num_layers=kv.num_layers, num_kv_heads=kv.num_kv_heads, head_dim=kv.head_dim,
                     block_size=kv.block_size, model=model_name, transport=args.transfer, kv_cache_dtype=kv.kv_dtype,
                     tensor_parallel_size=engine.config.tensor_parallel_size, kv_push=kv_push)


async def wait_for_stop_signal() -> str:
    """Return the name of the first SIGTERM/SIGINT received."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: fut.done() or fut.set_result(s.name))
    loop.add_signal_handler(signal.SIGUSR1, dump_tasks)
    return await fut


def dump_tasks() -> None:
    """`kill -USR1 <pid>`: log where every asyncio task of the server is waiting (for a request
    that seems stuck): each task's chain of awaits, innermost last."""
    tasks = asyncio.all_tasks()
    log.warning("SIGUSR1: %d asyncio task(s)", len(tasks))
    for task in tasks:
        log.warning("%s\n%s", task.get_name(), "\n".join(await_chain(task.get_coro())))


def await_chain(coro) -> list[str]:
    """'file:line in function' for a coroutine and everything it awaits, outermost first."""
    lines = []
    while coro is not None and len(lines) < 40:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        else:
            lines.append(f"  {type(coro).__name__} {coro!r:.120}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom", None)
    return lines


async def drain(count_fn, grace_s: float) -> int:
    """Wait until ``count_fn()`` is 0 or ``grace_s`` passes; return what is left."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while count_fn() > 0 and loop.time() < deadline:
        await asyncio.sleep(0.05)
    return count_fn()
