#!/bin/bash
# quiet, pinned vllm-mooncake rerun (issue 33 item 2): server on CPU 1, clients on CPU 0
set -u
cd /work/main
OUT=/work/runs/vbq; mkdir -p $OUT
taskset -c 1 .venv/bin/pdserve up --model /work/runs/bt/wm/model --prefill 1 --decode 1 --threads 1 --port 18431 > $OUT/up.log 2>&1 &
UP=$!
for i in $(seq 1 180); do curl -sf http://127.0.0.1:18431/v1/models >/dev/null && break; sleep 1; done
uptime > $OUT/load-before.txt
taskset -c 0 .venv/bin/python tools/bench_tools/compare.py --url http://127.0.0.1:18431 --model-dir /work/runs/bt/wm/model \
  --workloads vllm-mooncake --rounds 3 --seed 900 --out $OUT/run > $OUT/printed.txt 2>&1
echo "rc=$?" >> $OUT/printed.txt
uptime > $OUT/load-after.txt
kill -INT $UP; wait $UP
