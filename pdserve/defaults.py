"""Facts every part of pdserve agrees on: ports and default sizes.

The servers' command-line defaults, the operator's pod builders and the Helm chart's
values all come from here (the chart is checked against this module by a test). The
ports are defined here; the engine's facts (block size, built-in model name) are defined
in ``pdserve.engine.defaults`` (the engine imports nothing of ours) and re-exported here.
"""

from pdserve.engine.defaults import (BLOCK_SIZE, BUILTIN_MODEL, KV_CACHE_DTYPE_HELP, KV_CACHE_DTYPES,
                                     LONG_PREFILL_THRESHOLD, MAX_NUM_BATCHED_TOKENS, QUANTIZATION_HELP, QUANTIZATIONS)

__all__ = ["BLOCK_SIZE", "BUILTIN_MODEL", "MAX_NUM_BATCHED_TOKENS", "LONG_PREFILL_THRESHOLD", "QUANTIZATIONS",
           "QUANTIZATION_HELP", "KV_CACHE_DTYPES",
           "KV_CACHE_DTYPE_HELP", "DECODE_GRPC_PORT",
           "DECODE_HTTP_PORT", "HTTP_PORT",
           "KV_TRANSFER_PORT", "KV_POOL_PORT", "PREFILL_GRPC_PORT", "ENV_POOL", "ENV_INFERENCE_SERVICE",
           "REQUEST_TIMEOUT_S", "REQUEST_TIMEOUT_HEADER", "SESSION_TIMEOUT_S", "PREFILL_WAIT_S", "MAX_QUEUED_REQUESTS",
           "RESUME_WAIT_S", "TOKENIZER_WAIT_S", "KV_EVENTS_MAX_MESSAGE_BYTES", "DISAGGREGATION_MODES",
           "DISAGGREGATION", "ENV_SLO_CLASSES",
           "BATCH_DB", "BATCH_DATA_MOUNT", "BATCH_MAX_IN_FLIGHT", "BATCH_MAX_FILE_BYTES", "BATCH_SLO_CLASS",
           "API_KEYS_MOUNT", "API_KEYS_FILE", "API_KEYS_SECRET_KEY"]

# Prefill pods: the OpenAI-compatible HTTP API (also /health, /ready, /metrics).
HTTP_PORT = 8000
# Prefill pods: the client gRPC API (Generate).
PREFILL_GRPC_PORT = 50051
# Decode pods: the Session stream and load reports (gRPC).
DECODE_GRPC_PORT = 50052
# Decode pods: /health, /ready and /metrics over HTTP.
DECODE_HTTP_PORT = 8001
# Decode pods: where the CacheStore receives KV (tcp transport listener / nixl agent).
KV_TRANSFER_PORT = 50060  # a tensor-parallel decode's rank r receives its KV head shard on this + 1 + r (per-rank push)
# Decode pods: head slices' receivers of the per-rank push (decode_server/rank_ports.py), by default on the ports
# after the ranks' (a TP 1 decode's: KV_TRANSFER_PORT + 1 ...); more than this many take free ports
KV_SLICE_PORTS = 8
# Decode pods with --kv-pool: the KVLender (blocks lent to peers, micro-attention over them).
KV_POOL_PORT = 50070

# KV-event subscribers (the router of its prefills): the largest gRPC message they take. A stream's first
# message is the server's whole hash set (protos/kv_events.proto): ~10 bytes per block, so gRPC's 4 MiB
# default refused every prefill holding more than ~400k blocks (`pdserve bench router-scale`, issue 50);
# 256 MiB is ~25M blocks per prefill.
KV_EVENTS_MAX_MESSAGE_BYTES = 256 * 2**20

# Prefill: the end-to-end deadline of one request, in seconds (--request-timeout; clients
# may only shorten it, with X-Request-Timeout or a gRPC deadline).
REQUEST_TIMEOUT_S = 600.0
# The HTTP request header that shortens it (the router forwards it to the prefill).
REQUEST_TIMEOUT_HEADER = "X-Request-Timeout"
# Prefill and decode: the bound on each wait inside one P/D Session (--session-timeout): the KV
# push, the prefill's wait for the decode's next message, the decode's wait for the prefill (sent
# in Start) and the CacheStore link's stall bound.
SESSION_TIMEOUT_S = 30.0
# Router: how long a request waits for a prefill that can take it (none routable, or each one
# answered that it has no decode) before 503 (--prefill-wait). It bridges the few seconds of a
# rollout or restart in which no prefill is ready; the router's readiness probe needs 15 s of
# "no routable prefill" before Kubernetes stops sending it requests.
PREFILL_WAIT_S = 10.0
# Router with --tokenizer-from-prefill: how long it waits at start for a prefill that gives its
# tokenizer files before it exits with an error (--tokenizer-wait). As long as a prefill pod may
# take to load its model (its startup probe allows 120 x 5 s).
TOKENIZER_WAIT_S = 600.0

# Prefill: requests that may wait at once in the admission queue for a decode with free KV
# blocks (--max-queued-requests); one more gets 429.
MAX_QUEUED_REQUESTS = 1024
# Prefill: how long a request whose decode failed mid-generation waits (in the admission queue)
# for a decode that can take it, when none can right now (every other one full, or not reported
# yet: a decode that just started), before its stream ends with decode_failed (--resume-wait;
# the request's deadline ends the wait sooner). 0: end it at once.
RESUME_WAIT_S = 10.0
# Prefill: where prompts are computed (--disaggregation; prefill_server/cost_model.py): "always"
# here with the KV moved (P/D), "never" (on the decode), "auto" (per request, by measured cost).
DISAGGREGATION_MODES = ("auto", "always", "never")
DISAGGREGATION = "always"

# Environment variables the operator sets on every pod so its metrics carry the pod's labels.
ENV_POOL = "PDSERVE_POOL"
ENV_INFERENCE_SERVICE = "PDSERVE_INFERENCE_SERVICE"

# The SLO classes of an InferenceService (its spec.slo as JSON), set by the operator on prefill
# pods and read by pdserve.slo.classes.load (the flag --slo-classes wins over it).
ENV_SLO_CLASSES = "PDSERVE_SLO_CLASSES"

# Prefill: the OpenAI Batch API's SQLite database (--batch-db; "~" is the user's home). In a
# pod the operator mounts a volume (emptyDir, or the InferenceService's
# spec.prefill.batchStorage.pvcName) at BATCH_DATA_MOUNT and puts the database there.
BATCH_DB = "~/.local/share/pdserve/batch.sqlite"
BATCH_DATA_MOUNT = "/var/lib/pdserve"
# Prefill: batch lines in flight at once, over all batches (--batch-max-in-flight): the rest
# wait in the database, so online requests always find room in the admission queue.
BATCH_MAX_IN_FLIGHT = 4
# Prefill: the largest file POST /v1/files accepts, in bytes (--batch-max-file-bytes).
BATCH_MAX_FILE_BYTES = 100 * 1024 * 1024
# Prefill: the SLO class batch lines run in when the server declares it (--batch-slo-class).
BATCH_SLO_CLASS = "batch"

# Router and prefill pods of an InferenceService with spec.auth: the operator mounts the Secret's key
# (spec.auth.key, default API_KEYS_SECRET_KEY) read-only as the file API_KEYS_FILE in API_KEYS_MOUNT and
# passes that path as --api-key-file (pdserve/http_auth.py).
API_KEYS_MOUNT = "/etc/pdserve/api-keys"
API_KEYS_FILE = "keys"
API_KEYS_SECRET_KEY = "api-keys"
