"""Facts every part of pdserve agrees on: ports and default sizes.

This is the one place for them. The servers' command-line defaults, the operator's
pod builders and the Helm chart's values all come from here (the chart is checked
against this module by a test).
"""

# Prefill pods: the OpenAI-compatible HTTP API (also /health, /ready, /metrics).
HTTP_PORT = 8000
# Prefill pods: the client gRPC API (Generate).
PREFILL_GRPC_PORT = 50051
# Decode pods: the Session stream and load reports (gRPC).
DECODE_GRPC_PORT = 50052
# Decode pods: /health, /ready and /metrics over HTTP.
DECODE_HTTP_PORT = 8001
# Decode pods: where the CacheStore receives KV (tcp transport listener / nixl agent).
KV_TRANSFER_PORT = 50060

# KV cache block size in tokens.
BLOCK_SIZE = 64

# The name the built-in model is served under.
BUILTIN_MODEL = "tiny"

# Environment variables the operator sets on every pod so its metrics carry the pod's labels.
ENV_POOL = "PDSERVE_POOL"
ENV_INFERENCE_SERVICE = "PDSERVE_INFERENCE_SERVICE"
