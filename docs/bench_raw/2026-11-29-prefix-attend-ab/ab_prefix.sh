#!/usr/bin/env bash
# A/B of the prefix-attention change on the peer-trace replay (pdserve only): before = /work/wt-before (9db9c8b), after = /work/main (30e8825)
out=/work/runs/ab-prefix; mkdir -p $out
for arm in before after after before; do
  [ $arm = before ] && dir=/work/wt-before || dir=/work/main
  n=$(ls $out | grep -c "^$arm")
  (cd $dir && .venv/bin/python bench/tools/peer_trace_alone.py --load --systems pdserve --json $out/$arm-$n.json > $out/$arm-$n.txt 2>&1)
  echo "$arm-$n $(date -u +%T) $(grep -E 'under load|engine timeline|prefill  CPU' $out/$arm-$n.txt | tr '\n' ' ')" >> $out/summary.txt
done
