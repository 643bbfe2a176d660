"""pdserve.engine: the model runtime both servers share. It imports nothing else of pdserve.

Reading path (read in this order):
  ``llm_engine.py``   LLMEngine: colocated ``add_request``/``step``; builds the parts below, holds ``pd``
  ``engine_core.py``  EngineCore: what LLMEngine shares with the simulated engine (admission, step, abort, reads);
                      ``engine_config.py`` EngineConfig; ``sampling_params.py`` SamplingParams (both torch-free)
  ``scheduler.py``    Scheduler: the request table, waiting/running queues, admission, chunked prefill (a
                      token budget per step), preemption: ONE scheduler for every kind of request
  ``block_manager.py``BlockManager: ref counts, chained block hashes, prefix-reuse LRU (pure Python)
  ``pd_hooks.py``     PDHooks (``engine.pd``): add_remote (prefill_only/prefill_many)/release, reserve/add_prefilled
  ``remote_prefill.py`` RemotePrefill: the P/D prefill side as a request kind (its KV handed on per chunk and layer)
  ``model_runner.py`` ModelRunner: sequences -> ForwardBatch (ids, positions, KV slots) -> tokens
  ``outputs.py``      OutputProcessor: EOS/stop ids, stop strings (``stop_strings.py``), RequestOutput
  ``sequence.py``     Sequence, RequestOutput, SequenceFactory (request validation)
  ``model.py``        DecoderModel: the decoder over a paged KV cache (layer callback); its attention by
                      the backend the runner chose once (``attention_backends.py``: torch, native (the
                      C++ decode kernel), triton); attention math (scale, soft-capping, windows) in ``attention.py``
  ``models/``         each family's decoder layer: llama.py (Llama, Mistral, Qwen2), qwen3.py,
                      qwen3_moe.py (experts), gemma.py (Gemma 2, Gemma 3 text)
  ``layer_ops.py``    the layers' ops (norms, rotary, act*mul, linears), chosen once per model by device and
                      switches: torch, cpu (packed linears, ``packed_linear.py``: MKL's packed GEMM for float32,
                      ``mkl_gemm.py``, oneDNN's for bf16), cuda, triton (``gpu_elementwise.py``)
  ``kv_cache.py``     KVCache: the whole pool as ONE tensor (layout contract with the CacheStore); its fp8
                      rows: ``kv_formats.py`` (the facts, torch-free), ``kv_quant.py`` (quantize/dequantize)
  ``swap.py``         Swapper: a running request's KV evicted to host memory and restored (LSO)
  ``kv_tiers.py``     KVTiers: evicted prefix-cache blocks in host memory, then disk; copied back on a hit
  ``sampling.py``     SamplingParams (validated) and the batched Sampler; ``token_logprobs``
  ``grammar.py``      constrained decoding (xgrammar): GrammarSpec, Grammars, a Matcher per sequence
  ``logprobs.py``     TokenLogprob (torch-free)
  ``server_engine.py`` ServerEngine: what the servers call on an engine (this one and vLLM's implement it)
  ``async_engine.py`` AsyncLLMEngine: the engine on a background thread, the built-in ServerEngine
  ``loader.py`` / ``config.py`` (+ ``config_families.py``) / ``checkpoint.py`` / ``tokenizer.py``: loading models
  ``quant_config.py`` / ``weight_source.py`` / ``fp8.py``: quantized checkpoints read (or refused), FP8
                      weights loaded, and their matmuls (C++ kernel ``csrc/fp8_linear.cpp`` on CPU)
  ``weight_memory.py`` the loaded weights' bytes; a model too large for its GPU refused at load, naming the sizes
  ``defaults.py``     BLOCK_SIZE, BUILTIN_MODEL (``pdserve.defaults`` re-exports them)
  ``cli.py``          ``pdserve generate``
  ``sim/``            the simulated engine (``--engine sim``): EngineCore over a profile's modelled step time, no
                      model, no torch (its __init__ has the request lifecycle)
  ``tp/``             tensor parallelism: each rank's shard of the weights (``shard.py``), the process group and
                      its collectives hooked on the projections (``group.py``), rank 0 starting the workers and
                      sending each step's ForwardBatch (``ranks.py``), a worker's loop (``worker.py``);
                      ``load_model(..., tensor_parallel_size=N)`` + ``EngineConfig(tensor_parallel_size=N)``

Its benchmark (``pdserve bench engine``) lives with the others: ``pdserve.bench.engine``.

TD-Pipe's pipeline-parallel engine (``pdserve batch``) is built from these parts (``model.py`` runs
a stage's range of layers) and lives with the Batch API: ``pdserve.batch.pipeline``.

The names below are loaded on first use, so ``pdserve.engine.defaults`` or
``pdserve.engine.stop_strings`` can be imported without loading torch.

API
---
::

    loaded = load_model("tiny" | "builtin:tiny" | "/path/to/hf_dir", dtype=torch.float32, device="cpu", seed=0)
    loaded.config       # ModelConfig: num_layers, hidden_size, num_heads, num_kv_heads, head_dim,
                        #   vocab_size, max_position_embeddings (= context_length), ...
    loaded.tokenizer    # encode(str, add_special_tokens=True) -> list[int]; decode(ids) -> str;
                        # eos_token_ids; apply_chat_template(messages, add_generation_prompt=True) -> str;
                        # detokenizer() -> IncrementalDetokenizer (.add(ids) -> text delta; never
                        #   splits a UTF-8 character)

    engine = LLMEngine(loaded, EngineConfig(num_blocks=None, block_size=64, max_num_seqs=64,
                                            max_model_len=None, enable_prefix_cache=True,
                                            kv_host_tier_bytes=0, kv_disk_tier_dir=None, kv_disk_tier_bytes=0,
                                            kv_cache_dtype="auto"))  # or "fp8": ~2x the tokens per byte
        # kv_*_tier_*: evicted prefix-cache blocks go to host memory then disk, a hit copies them
        # back (kv_tiers.py); engine.tier_stats() -> {"host"|"disk": TierStats}; engine.close()
    engine.kv_cache.tensor      # [num_layers, num_blocks, 2 (K,V), block_size, num_kv_heads, row]: row = head_dim
                                # values, or with EngineConfig(kv_cache_dtype="fp8") head_dim fp8 bytes + a
                                # bfloat16 scale (uint8; kv_formats.py, kv_quant.py); gather() dequantizes
    engine.kv_cache.block_nbytes, .num_blocks, .layer(i) (view), .block_offset(layer, block) (bytes)
    engine.num_free_blocks(); engine.num_requests()  # (both back to full / 0 when idle)
    blocks_needed(num_tokens, block_size)   # ceil division: blocks that hold num_tokens tokens
    reusable_blocks(num_tokens, block_size) # (n-1)//block_size: the prompt blocks a prefix cache may supply

Colocated::

    engine.add_request(request_id, prompt_token_ids, sampling)
    engine.step() -> list[RequestOutput]
        # RequestOutput(request_id, new_token_ids, finished, finish_reason "stop"|"length"|"abort"|None,
        #               text (delta), num_prompt_tokens, num_cached_tokens, error,
        #               logprobs: one TokenLogprob per new token when SamplingParams.logprobs is set)
    SamplingParams(..., logprobs=k, prompt_logprobs=k, grammar=GrammarSpec("json_schema", schema_text, feed=0))
        # logprobs: the raw log-softmax of each sampled token + its k most likely alternatives;
        # prompt_logprobs: the same for each prompt token given those before it, in the first
        #   RequestOutput's prompt_logprobs ([None, TokenLogprob, ...]); computes the whole prompt (no prefix hit);
        # grammar: the sampler picks only tokens the grammar allows (xgrammar); feed = trailing
        # prompt tokens already generated under it (a resumed request)
    engine.abort(request_id)    # frees its blocks; True if it knew the request

P/D: the primitives are ``engine.pd`` (PDHooks, pd_hooks.py), on the thread that steps the engine.

P/D, prefill side::

    engine.pd.add_remote(request_id, prompt_token_ids, sampling, on_layer=cb, on_done=done)
        # a remote prefill: scheduled (chunked, batched) with every other request by engine.step();
        # cb(layer_idx, block_ids, first) on the engine thread right after a chunk's layer is written:
        # the prompt blocks [first, first + len(block_ids)) whose KV for that layer is complete (each
        # block of each layer once, in order); done(first_token, None) once prefilled (then held), or
        # done(None, error). Synchronously, for tests and profiling:
    first = engine.pd.prefill_only(request_id, prompt_token_ids, sampling, on_layer=cb)  # -> int token id
        # blocks taken now (OutOfBlocksError if not free), the engine stepped until its first token
    firsts = engine.pd.prefill_many([(rid, ids, sampling), ...], on_layer=cb2)  # {rid: token}
        # cb2(layer_idx, rid, block_ids, first); all or nothing on errors
    engine.pd.prefill_logprob(request_id)  # the first token's TokenLogprob (None unless asked), before release
    engine.pd.prefill_prompt_logprobs(request_id)  # the prompt's logprobs (None unless asked), before release
    engine.pd.release(request_id)  # the caller frees the blocks once the KV is sent
    engine.pd.prefill_counters  # (remote prompt tokens computed, their share of the steps' seconds): throughput

P/D, decode side::

    block_ids = engine.pd.reserve(request_id, num_prompt_tokens, max_tokens)
        # blocks for prompt + max_tokens up front, so a P/D request is never preempted;
        # OutOfBlocksError(reason) if impossible; PromptTooLongError.
        # The prompt's KV must be written into block_ids[:blocks_needed(num_prompt_tokens, block_size)].
    block_ids, cached = engine.pd.reserve_prefix(request_id, prompt_token_ids, max_tokens)
        # reserve, reusing the longest cached prefix (<= (n-1)//block_size blocks): the first
        # cached // block_size blocks already hold that KV (shared, pinned by the reservation);
        # write only the rest, into block_ids[cached // block_size : blocks_needed(n, block_size)].
    engine.pd.add_prefilled(request_id, prompt_token_ids, first_token_id, sampling)
        # joins the running batch; outputs start AFTER first_token_id (prefill reported it).
        # If first_token_id already ends the request, the next step reports finished, no tokens.
    engine.pd.prefill_reserved(request_id, prompt_token_ids, sampling)
        # or: compute the prompt's missing KV here in the next step, then decode (every token is output)
    engine.abort(request_id)    # also frees a reservation that never got add_prefilled

Seeded sampling depends only on (seed, position), so P/D gives the colocated tokens.

asyncio (one background engine thread, thread-safe submission; see async_engine.py; the calls the
servers make, declared in server_engine.py)::

    aeng = AsyncLLMEngine(engine); await aeng.start()
    async for out in aeng.generate(req_id, ids, sampling): ...
    first = await aeng.prefill_only(req_id, ids, sampling, on_layer=cb); await aeng.release(req_id)
    block_ids = await aeng.reserve(req_id, n_prompt, max_tokens)
    block_ids, cached = await aeng.reserve_prefix(req_id, ids, max_tokens)
    async for out in aeng.add_prefilled(req_id, ids, first, sampling): ...
    async for out in aeng.prefill_reserved(req_id, ids, sampling): ...
    await aeng.abort(req_id); await aeng.stats(); await aeng.stop()
    # leaving a stream early aborts the request and frees its blocks.
    aeng.num_blocks; aeng.num_free_blocks(); aeng.num_requests(); aeng.prefill_counters()  # thread-safe reads
    aeng.busy_seconds()  # seconds in steps since start (one engine thread: never more than the wall time)

Errors: PromptTooLongError (ValueError, lengths in the message), OutOfBlocksError
(RuntimeError, ``.reason``), ModelLoadError / ConfigError (ValueError, naming the tensor or
architecture), ValueError from SamplingParams ("temperature must be >= 0, got -1").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the module that defines it
_EXPORTS = {
    "AsyncLLMEngine": ".async_engine",
    "BlockManager": ".block_manager",
    "block_hash": ".block_manager",
    "blocks_needed": ".block_manager",
    "chained_hashes": ".block_manager",
    "reusable_blocks": ".block_manager",
    "reusable_hashes": ".block_manager",
    "ConfigError": ".config",
    "ModelConfig": ".config",
    "ModelLoadError": ".errors",
    "OutOfBlocksError": ".errors",
    "PromptTooLongError": ".errors",
    "KVCache": ".kv_cache",
    "KVTiers": ".kv_tiers",
    "EngineConfig": ".engine_config",
    "LLMEngine": ".llm_engine",
    "LoadedModel": ".loader",
    "load_model": ".loader",
    "SamplingParams": ".sampling_params",
    "RequestOutput": ".sequence",
}

__all__ = sorted(_EXPORTS, key=lambda name: (name[0].islower(), name))


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from .async_engine import AsyncLLMEngine
    from .block_manager import BlockManager, block_hash, blocks_needed, chained_hashes, reusable_blocks, reusable_hashes
    from .config import ConfigError, ModelConfig
    from .errors import ModelLoadError, OutOfBlocksError, PromptTooLongError
    from .kv_cache import KVCache
    from .kv_tiers import KVTiers
    from .engine_config import EngineConfig
    from .llm_engine import LLMEngine
    from .loader import LoadedModel, load_model
    from .sampling_params import SamplingParams
    from .sequence import RequestOutput
