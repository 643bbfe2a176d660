"""``pdserve bench engine``: the engine's prefill and decode tokens/s against transformers (and
vLLM-CPU with ``--vllm-python``) on the same weights, in one run.

Reading path: tokens_per_s.py (the command: cases, clocks, table), then vllm_baseline.py (the
vLLM-CPU child process). It imports the engine; the engine never imports it.

Beside it, scripts run with ``python -m``: prefix_attention.py, fp8_decode.py, tensor_parallel.py (TP 2 against
TP 1 on the CPU: a 2k prefill and a batch-1 decode step).
"""
