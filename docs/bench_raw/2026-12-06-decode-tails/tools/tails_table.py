"""Per repeat and cell, pdserve's and vLLM's TPOT (mean, P99), ITL P99 and output tok/s from a peer experiment's
JSON, with the ratios pdserve / vLLM per repeat (A B A B: each pdserve run against the vLLM run of the same
repeat) and of the medians over repeats; with --slo-ms, whether pdserve's TPOT is within it.

  .venv/bin/python docs/bench_raw/2026-12-06-decode-tails/tools/tails_table.py PEER.json [--slo-ms 55]
"""

from __future__ import annotations

import argparse
import json
import statistics

FIGS = ("tpot_mean", "tpot_p99", "itl_p99", "output_tok_s", "ttft_mean")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("json")
    p.add_argument("--slo-ms", type=float, default=None)
    a = p.parse_args()
    d = json.load(open(a.json))
    runs = d["runs"]
    cells = sorted({c for r in runs for c in r["cells"]})
    for cell in cells:
        print(f"== {cell}")
        by = {}
        for r in runs:
            if cell in r["cells"]:
                by.setdefault(r["system"], {})[r["repeat"]] = r["cells"][cell]
        for system, reps in by.items():
            for rep, f in sorted(reps.items()):
                print(f"  {system:<8} repeat {rep}: " + "  ".join(
                    f"{k} {f[k] * (1 if k == 'output_tok_s' else 1000):.1f}" for k in FIGS))
        if "pdserve" in by and "vllm" in by:
            for k in FIGS:
                pairs = [by["pdserve"][r][k] / by["vllm"][r][k] for r in sorted(by["pdserve"]) if r in by["vllm"]]
                med = statistics.median(by["pdserve"][r][k] for r in by["pdserve"]) / \
                    statistics.median(by["vllm"][r][k] for r in by["vllm"])
                print(f"  ratio {k:<13} median {med:.2f}  per repeat [{', '.join(f'{x:.2f}' for x in pairs)}]")
        if a.slo_ms and "pdserve" in by:
            for rep, f in sorted(by["pdserve"].items()):
                mean, p99 = f["tpot_mean"] * 1000, f["tpot_p99"] * 1000
                print(f"  pdserve repeat {rep}: TPOT mean {mean:.1f} ms, P99 {p99:.1f} ms against the {a.slo_ms:g} ms "
                      f"SLO: mean {'within' if mean <= a.slo_ms else 'OVER'}, "
                      f"P99 {'within' if p99 <= a.slo_ms else 'OVER'}")


if __name__ == "__main__":
    main()
