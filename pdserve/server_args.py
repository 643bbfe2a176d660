"""The flags every pdserve server takes (``pdserve prefill``, ``pdserve decode``): --host, --drain-timeout,
the TLS flags (``tls.py``) and the model/engine/transfer group, and ``byte_size`` (their byte-size type).
``server_setup.py`` turns the parsed flags into an engine and its KV pool."""

from __future__ import annotations

import argparse

from pdserve import defaults, kv_sizing, tls
from pdserve.cachestore import SAME_NODE_MODES, TRANSPORTS

KV_PUSH_MODES = ("per-rank", "gather")  # --kv-push
ENGINES = ("builtin", "vllm", "sim")

def add_server_arguments(parser: argparse.ArgumentParser, *, drains: str) -> None:
    """--host, --drain-timeout (``drains`` names what it waits for), the TLS flags (``tls.py``) and the
    engine flags."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a pod)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help=f"seconds to let {drains} finish on shutdown")
    tls.add_arguments(parser)
    add_engine_arguments(parser)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and engine")
    g.add_argument("--engine", choices=ENGINES, default="builtin",
                   help="builtin: pdserve's engine; vllm: vLLM's engine with pdserve's CacheStore as its KV connector "
                        "(vllm_backend/; runs in the environment tools/install_vllm_cpu.sh builds; --model must be a "
                        "Hugging Face directory; logprobs and response_format/tools supported; no KV tiers or decode "
                        "prefix cache); sim: no model, each step sleeps the time a profile models (engine/sim/: the "
                        "real scheduler, prefix cache and KV moves; tokens a hash of the context; needs --sim-profile)")
    g.add_argument("--sim-profile", default=None, metavar="PATH",
                   help="--engine sim: the profile JSON (model shape and step time, engine/sim/profile.py), or a "
                        "shipped one by name: cpu-small, h200-llama3-8b")
    g.add_argument("--sim-kv-scale", type=int, default=1, metavar="N",
                   help="--engine sim: the CacheStore's blocks carry 1/N of the profile's KV bytes (N divides "
                        "kv_heads x head_dim), so many servers of a large shape fit a box (default 1: real bytes)")
    g.add_argument("--sim-link-gbps", type=float, default=None, metavar="GBPS",
                   help="--engine sim, prefill: the KV link modelled at this bandwidth, for the real bytes "
                        "(cachestore/link_model.py; default: none, the bytes move at the wire's speed)")
    g.add_argument("--sim-link-latency-us", type=float, default=0.0, metavar="US",
                   help="--engine sim with --sim-link-gbps: the modelled link's one-way latency (default 0)")
    g.add_argument("--model", default=defaults.BUILTIN_MODEL,
                   help=f"'{defaults.BUILTIN_MODEL}' (built-in, offline) or a directory with config.json + safetensors")
    g.add_argument("--served-model-name", default=None,
                   help="name clients use in 'model' (default: --model without a 'builtin:' prefix)")
    g.add_argument("--dtype", default=None, choices=kv_sizing.DTYPES,
                   help=f"weights and KV cache dtype (default: {kv_sizing.GPU_DTYPE} on --device cuda, "
                        f"{kv_sizing.CPU_DTYPE} on cpu)")
    g.add_argument("--quantization", choices=defaults.QUANTIZATIONS, default=None, help=defaults.QUANTIZATION_HELP)
    g.add_argument("--kv-cache-dtype", default="auto", choices=defaults.KV_CACHE_DTYPES,
                   help=defaults.KV_CACHE_DTYPE_HELP)
    g.add_argument("--device", type=kv_sizing.device_flag, default="cpu",
                   help="cpu, cuda or cuda:N; a CUDA device this process cannot see (no driver or GPU) stops the "
                        "server at start with a message")
    g.add_argument("--block-size", type=int, default=defaults.BLOCK_SIZE, help="KV cache block size in tokens")
    g.add_argument("--num-blocks", type=int, default=None, metavar="N",
                   help="KV cache blocks in the pool: an exact count, over --kv-cache-memory and "
                        "--gpu-memory-utilization (default: sized by those; on cpu without them, "
                        f"{kv_sizing.CPU_DEFAULT_BLOCKS} blocks)")
    g.add_argument("--kv-cache-memory", type=byte_size, default=None, metavar="BYTES",
                   help="the KV pool's size in bytes, on the CPU or the GPU (e.g. 4GiB): as many blocks as it holds, "
                        "a block being --block-size tokens of K and V in every layer in --dtype; over "
                        "--gpu-memory-utilization")
    g.add_argument("--gpu-memory-utilization", type=kv_sizing.utilization_flag, default=None, metavar="F",
                   help="CUDA only, 0 < F <= 1 (default "
                        f"{kv_sizing.DEFAULT_GPU_MEMORY_UTILIZATION}, as vLLM): the fraction of the GPU's total "
                        "memory this server may use for weights, activations and KV together; the KV pool gets "
                        "F x total - what is in use after loading the weights - the activation peak of one "
                        "profiling forward of the engine's largest step (pdserve/kv_sizing.py)")
    g.add_argument("--max-num-seqs", type=int, default=32, help="most requests in one running batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=defaults.MAX_NUM_BATCHED_TOKENS, metavar="N",
                   help="tokens one engine step computes, prompt chunks and decode rows together (chunked prefill: a "
                        "longer prompt takes several steps; default %(default)s)")
    g.add_argument("--long-prefill-threshold", type=int, default=defaults.LONG_PREFILL_THRESHOLD, metavar="N",
                   help="while a short prompt waits, the most tokens of a long prompt a step computes, so the short "
                        "one shares the next step and passes it (0: the whole --max-num-batched-tokens; default "
                        "%(default)s)")
    g.add_argument("--solo-prompt-tokens", type=int, default=None, metavar="N",
                   help="prompts share an engine step only up to N prompt tokens together, and a short prompt passes "
                        "a long one part-way in a step of its own (0: prompts share a step up to "
                        "--max-num-batched-tokens; default: "
                        f"{defaults.SOLO_PROMPT_TOKENS_CPU} on --device cpu, where a step's time grows with its tokens "
                        "and a second prompt delays the first one's first token; 0 on cuda)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="on --device cuda: run decode steps eagerly instead of from CUDA graphs (captured at start, "
                        "one per batch-size bucket up to --max-num-seqs; engine/decode_graphs.py)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; with --tensor-parallel-size, each rank's)")
    g.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N ranks, one process each, started by this server (engine/tp/: heads, "
                        "MLP rows and the vocabulary split; gloo on CPU, NCCL on cuda:I..I+N-1); P/D KV goes through "
                        "each rank's KV head shard on its own CacheStore link where the peer pairs so "
                        "(--kv-push), else through rank 0's transfer pool (engine/tp/transfer.py) (default: 1)")
    g.add_argument("--kv-push", choices=KV_PUSH_MODES, default="per-rank",
                   help="P/D KV of a tensor-parallel server, or of a TP 1 server paired with one. per-rank: each "
                        "prefill rank sends each decode rank exactly the KV heads it needs, one CacheStore sender and "
                        "receiver per rank (its whole shard, or a slice packed contiguous, or into a staging pool "
                        "unpacked on arrival: engine/tp/heads.py rank_pieces, engine/tp/pieces.py; CPU; the peer "
                        "must speak it too); gather: never (every KV head through rank 0's transfer pool, "
                        "engine/tp/transfer.py, as with a peer that does not) (default: per-rank)")
    g.add_argument("--transfer", choices=TRANSPORTS, default="tcp", help="CacheStore transport for KV")
    g.add_argument("--kv-same-node", choices=SAME_NODE_MODES, default="auto",
                   help="KV between a prefill and a decode of one machine: the decode shares its KV pool (CPU: in a "
                        "memfd, mode 0600; cuda: a CUDA IPC handle) and the prefill copies each layer straight into "
                        "it (cachestore/samenode.py). auto: when the decode offers it and the prefill can map it, "
                        "else --transfer (logged once a decode); on (prefill): only that, a decode it cannot map "
                        "fails the request; off: never (decode: its pool is not shared)")
    g.add_argument("--kv-checksum", action=argparse.BooleanOptionalAction, default=None,
                   help="KV integrity: prefill sends a CRC32C with every slice of KV, decode checks it before the "
                        "request joins the batch and requires it from every prefill (a mismatch fails the request "
                        "with kv_checksum_mismatch; prefill moves it to another decode). Default: on, except with "
                        "--transfer nixl on a cuda device (summing there copies each slice to the host); its cost "
                        "on a P/D pair is in docs/benchmarks.md, \"KV checksums\"; with --tensor-parallel-size "
                        "each rank's KV shard is summed across rank 0's hop too: engine/tp/transfer.py")
    g.add_argument("--session-timeout", type=float, default=defaults.SESSION_TIMEOUT_S,
                   help="seconds one end of a Session waits on the other (KV, first token, each next message, "
                        "a write the peer does not take) before it frees the request")
    g.add_argument("--kv-host-tier-bytes", type=byte_size, default=0,
                   help="prefix-cache blocks evicted from the KV pool are kept in host memory up to this many "
                        "bytes (e.g. 512MiB; 0 = off) and copied back on a prefix hit instead of recomputed "
                        "(engine/kv_tiers.py)")
    g.add_argument("--kv-disk-tier-dir", default=None,
                   help="below the host tier: a directory for evicted blocks (a fresh pdserve-kv-tier-* folder "
                        "in it, deleted at exit); needs --kv-disk-tier-bytes")
    g.add_argument("--kv-disk-tier-bytes", type=byte_size, default=0,
                   help="the disk tier's byte budget (e.g. 4GiB); blocks are CRC32C-checked on the way back")
    g.add_argument("--log-level", default="INFO", help="logging level")
    s = parser.add_argument_group("engine switches (each on by default; off for A/B runs and debugging)")
    s.add_argument("--native-kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="CPU: decode attention by the C++ kernel over the paged KV cache (engine/native.py; without "
                        "g++ the torch path runs either way)")
    s.add_argument("--packed-linear", action=argparse.BooleanOptionalAction, default=True,
                   help="CPU: packed copies of the large linear weights, made once at load (MKL's for float32, "
                        "oneDNN's for bfloat16): faster decode batches and float32 prefills, for about twice those "
                        "weights' memory (engine/packed_linear.py)")
    s.add_argument("--fused-elementwise", action=argparse.BooleanOptionalAction, default=True,
                   help="CUDA: RMSNorm, rotary and silu*mul as one Triton kernel each (engine/gpu_elementwise.py)")
    s.add_argument("--merged-projections", action=argparse.BooleanOptionalAction, default=True,
                   help="CUDA: q|k|v and gate|up as one matmul each (engine/models/llama.py)")


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30,
          "ti": 1 << 40}


def byte_size(text: str) -> int:
    """'4096', '512MiB', '2G', '1.5GB' -> bytes (argparse type)."""
    raw = text.strip().lower().removesuffix("b")
    number = raw.rstrip("kmgti")
    unit = raw[len(number):]
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 4096, 512MiB, 2GB)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a byte size must be >= 0, got {text!r}")
    return int(value)
