"""The engine's own defaults: the one place for each of these facts.

The rest of pdserve (``pdserve.defaults``, the servers' flags, the operator, the Helm chart)
reads them from here; the engine imports nothing of pdserve, so these cannot live there.
Importing this module loads no torch (``pdserve.engine`` loads its modules lazily).
"""

# KV cache block size in tokens.
BLOCK_SIZE = 64

# Chunked prefill: tokens one engine step computes (prompt chunks and decode rows together), and the most of
# them a long prompt takes in a step while a short one waits (0: the whole budget), so the short one waits for
# at most one chunk of the long one.
MAX_NUM_BATCHED_TOKENS = 2048
LONG_PREFILL_THRESHOLD = 512
# On a CPU, prompts share an engine step only up to this many prompt tokens together (EngineConfig.solo_prompt_tokens;
# the servers' default on --device cpu, 0 on CUDA where a second prompt in a step costs little): a step's time there
# grows with its tokens past a floor (reading the weights), so a second prompt delays the first one's first token.
# Measured (the 122M peer checkpoint, fp32, one thread, thread CPU time per prefill): 8 / 16 / 32 / 64 / 128 / 256 /
# 512 tokens 77 / 89 / 112 / 164 / 248 / 453 / 930 ms: two prompts of 64 or fewer together cost the first little and
# save the second its own step's floor; past 128 in all a step's time grows with its tokens (docs/benchmarks.md).
SOLO_PROMPT_TOKENS_CPU = 128

# The name the built-in model (random weights, byte-level tokenizer, no download) is served under.
BUILTIN_MODEL = "tiny"

# What --quantization accepts (quant_config.py reads checkpoints' own quantization_config either way).
QUANTIZATIONS = ("fp8",)
QUANTIZATION_HELP = ("fp8: quantize the checkpoint's linear projections to FP8 (e4m3, one scale per output row) "
                     "at load: half the weight bytes of bf16 (default: none; a checkpoint's own quantization_config "
                     "is read either way: FP8 checkpoints load, other methods are refused at start)")

# What --kv-cache-dtype accepts (kv_formats.py says what each is), and its help (servers, up, generate).
KV_CACHE_DTYPES = ("auto", "fp8")
KV_CACHE_DTYPE_HELP = ("auto: K/V in --dtype; fp8: K/V in float8_e4m3fn with a bfloat16 scale per token per KV head, "
                       "computed as each token is written (dynamic), stored inside each block: about twice the tokens "
                       "in the same bytes (1.94x at head dim 64), moved by the CacheStore, checksums, tiers and KV "
                       "pool like any block. A prefill and a decode must use the same (the Session refuses a "
                       "mismatch, naming both); --engine vllm refuses fp8")
