#!/usr/bin/env bash
# chain.sh COMMIT KIND...  (KIND: fresh | busy). Each run: a fresh clone of /work/main at COMMIT, bash .ci/run.
# busy: two `while :; do :; done` loops run beside the whole CI run. Stops at the first failure.
commit=$1; shift
n=0
for kind in "$@"; do
  n=$((n+1))
  d=/work/chain$n
  rm -rf "$d"; git clone -q /work/main "$d" && git -C "$d" checkout -q "$commit"
  loops=()
  if [ "$kind" = busy ]; then
    for i in 1 2; do ( while :; do :; done ) & loops+=($!); done
  fi
  s=$(date +%s)
  ( cd "$d" && bash .ci/run ) > /work/runs/chain-$n-$kind.txt 2>&1
  rc=$?
  for p in "${loops[@]}"; do kill "$p"; done
  summary=$(grep -E '^=+ .*(passed|failed).* in ' /work/runs/chain-$n-$kind.txt | tail -1)
  echo "$(date -u +%H:%M) run $n $kind commit $commit rc=$rc wall=$(( $(date +%s) - s ))s | $summary | $(grep '^CI (make test' /work/runs/chain-$n-$kind.txt)" >> /work/runs/chain.txt
  rm -rf "$d"
  [ "$rc" -eq 0 ] || { echo "stopped at run $n" >> /work/runs/chain.txt; exit 1; }
done
echo "all $n green" >> /work/runs/chain.txt
