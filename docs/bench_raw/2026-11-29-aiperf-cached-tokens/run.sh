#!/usr/bin/env bash
# aiperf's prompt-cache figures against pdserve's own count of prefix-cache hits (issue 33 item 2).
# Needs `make bench-tools` (aiperf 0.13.0) and a compare.py run's Hub cache of the tiny tokenizer
# (HUB, e.g. <out>/hf-hub-cache of `tools/bench_tools/compare.py --out <out>`). Usage: run.sh HUB OUT
set -euo pipefail
hub=$1 out=$2 here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
# the trace's first 40 requests, a hash id = 64 tokens (one KV block of `tiny`), 20 blocks at most,
# 8 tokens out, time x4; every request shares hash id 0, so each later prompt finds one cached block
python3 - "$out/mc64.jsonl" <<'PY'
import json, sys
rows = []
with open("../shared/traces/mooncake_conversation_trace.jsonl") as f:
    for line in f:
        r = json.loads(line)
        h = r["hash_ids"][:20]
        n = min(len(h) * 64, max(65, r["input_length"] // 8))
        rows.append({"timestamp": r["timestamp"] * 4, "input_length": n, "output_length": 8, "hash_ids": h[: -(-n // 64)]})
        if len(rows) == 40:
            break
open(sys.argv[1], "w").write("".join(json.dumps(r) + "\n" for r in rows))
PY
cmp "$out/mc64.jsonl" "$here/mc64.jsonl"
.venv/bin/pdserve up --model tiny --port 18310 --grpc-port 18311 --log-dir "$out/logs" > "$out/up.log" 2>&1 &
up=$!
trap 'kill -INT $up; wait $up' EXIT
until curl -sf localhost:18310/v1/models > /dev/null; do sleep 2; done
hits() { curl -s localhost:18310/metrics | awk '/^pdserve_prefix_cache_hit_tokens_total/{print $2}'; }
before=$(hits)
HF_HUB_CACHE=$hub HF_HUB_OFFLINE=1 ~/.cache/pdserve/bench-tools/aiperf-0.13.0/venv/bin/aiperf profile \
  --model tiny --url http://127.0.0.1:18310 --endpoint-type completions --streaming --tokenizer pdserve/tiny \
  --use-server-token-count --extra-inputs ignore_eos:true --random-seed 3 --ui-type none --no-gpu-telemetry \
  --no-server-metrics --artifact-dir "$out/aiperf" --input-file "$out/mc64.jsonl" \
  --custom-dataset-type mooncake_trace --isl-block-size 64 --fixed-schedule --fixed-schedule-auto-offset \
  > "$out/aiperf.log" 2>&1
echo "server: pdserve_prefix_cache_hit_tokens_total $before -> $(hits)"
grep -E "Cache Read" "$out/aiperf/profile_export_console.txt"
