"""Every request of every round pooled per side: the TTFT and TPOT each tool reports, per request, from
the reports `tools/bench_tools/compare.py` left in a run folder (A: pdserve bench serving; B: the tool).

    .venv/bin/python docs/bench_raw/2026-11-29-tools-small/pooled.py RUN_FOLDER [METRICS_SAMPLES DATE]

Also writes RUN_FOLDER/per_request_extract.json: the per-request figures pooled (committed beside this
script; the run folders themselves, ~10 MB, are not). One pair's mean moves with its own Poisson
arrivals (a run of 31 requests at 23% utilisation queues a burst or does not); pooling the rounds
compares ~90-180 requests a side. Per request:
- pdserve bench: TTFT; TPOT (e2e - TTFT) / (server output tokens - 1), of outputs of 2 tokens or more;
- inference-perf: TTFT first output token - start; TPOT (last - first output token) / (tokens - 1);
- aiperf: its per-record time_to_first_token and inter_token_latency (profile_export.jsonl).

With METRICS_SAMPLES (lines "unix_time ttft_sum ttft_count tbt_sum tbt_count": the prefill's
pdserve_time_to_first_token_seconds and pdserve_time_between_tokens_seconds, sampled each second
beside the run) and the run's DATE (YYYY-MM-DD, for runs.json's started_utc), also the server's own
view of each side: its mean TTFT and mean gap between tokens over the windows of that side's runs
(first sample at or before a run's start to the first at or after its end; a run whose window the
samples do not cover is left out and the count says so). Each client's figure over the server's for
the same runs takes out what the load did (a burst raises both); the tool's such ratio over pdserve
bench's is their agreement on the same measure, net of the two sides' different arrival samples.
(The server's gap is token-weighted, a client's TPOT request-weighted: equal with equal outputs.)
"""

import bisect
import calendar
import json
import statistics
import sys
import time
from pathlib import Path


def pdserve(folder: Path) -> list[tuple[float, float]]:
    out = []
    for r in json.loads((folder / "bench.json").read_text())["requests"]:
        if r["ok"]:
            n = r["usage_completion_tokens"] or r["output_tokens"]
            out.append((r["ttft"] * 1000, (r["e2e"] - r["ttft"]) * 1000 / (n - 1) if n > 1 else None))
    return out


def inference_perf(folder: Path) -> list[tuple[float, float]]:
    out = []
    for r in json.loads((folder / "per_request_lifecycle_metrics.json").read_text()):
        if r.get("error"):
            continue
        m = r["info"]["response_metrics"]
        times, n = m["output_token_times"], m["server_usage"]["completion_tokens"]
        out.append(((times[0] - r["start_time"]) * 1000, (times[-1] - times[0]) * 1000 / (n - 1) if n > 1 else None))
    return out


def aiperf(folder: Path) -> list[tuple[float, float]]:
    out = []
    for line in (folder / "profile_export.jsonl").read_text().splitlines():
        m = json.loads(line)["metrics"]
        if "time_to_first_token" in m:  # no inter_token_latency for a one-token output
            out.append((m["time_to_first_token"]["value"], m.get("inter_token_latency", {}).get("value")))
    return out


def server_view(runs: list[dict], samples: Path, date: str) -> dict[tuple[str, str], tuple]:
    """(workload, side) -> (server TTFT mean ms, server gap mean ms, runs covered, the client's own TTFT
    and TPOT means over those runs, request-weighted, from runs.json)."""
    rows = [[float(x) for x in line.split()] for line in samples.read_text().splitlines()
            if line and not line.startswith("#")]
    times = [r[0] for r in rows]
    acc: dict[tuple[str, str], list[float]] = {}
    for r in runs:
        start = calendar.timegm(time.strptime(f"{date} {r['started_utc']}", "%Y-%m-%d %H:%M:%S"))
        end = start + 1 + r["wall_s"]  # started_utc is whole seconds
        i, j = bisect.bisect_right(times, start) - 1, bisect.bisect_left(times, end)
        if i < 0 or j >= len(rows):
            continue
        d = [b - a for a, b in zip(rows[i][1:], rows[j][1:])]
        a = acc.setdefault((r["workload"], r["side"]), [0.0, 0.0, 0.0, 0.0, 0, 0.0, 0.0, 0.0])
        for k in range(4):
            a[k] += d[k]
        n = r["requests"] - r["failed"]
        a[4], a[5], a[6], a[7] = a[4] + 1, a[5] + n, a[6] + n * r["ttft_ms"]["mean"], a[7] + n * r["tpot_ms"]["mean"]
    return {key: (a[0] / a[1] * 1000, a[2] / a[3] * 1000, a[4], a[6] / a[5], a[7] / a[5])
            for key, a in acc.items() if a[1] and a[3] and a[5]}


def main(run: Path, samples: Path | None = None, date: str | None = None) -> None:
    runs = json.loads((run / "runs.json").read_text())
    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    print("| workload | requests A / B | TTFT mean A / B ms | ratio | TTFT p50 A / B ms | ratio | "
          "TPOT mean A / B ms | ratio | TPOT p50 A / B ms | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    extract = {}
    for w in workloads:
        a, b = [], []
        for r in runs:
            if r["workload"] != w:
                continue
            folder = run / f"{w}-{r['round']}-{r['side']}"
            if r["side"] == "pdserve":
                a += pdserve(folder)
            else:
                b += inference_perf(folder) if w.startswith("ip-") else aiperf(folder)
        extract[w] = {"pdserve bench": a, "tool": b}
        if not a or not b:
            continue
        cells = []
        for k in (0, 1):
            for f in (statistics.fmean, statistics.median):  # TPOT: requests of 2 tokens or more
                x, y = f(v[k] for v in a if v[k] is not None), f(v[k] for v in b if v[k] is not None)
                cells += [f"{x:.1f} / {y:.1f}", f"{y / x:.2f}"]
        print(f"| {w} | {len(a)} / {len(b)} | " + " | ".join(cells) + " |")
    # the per-request figures this table pooled (ms; TPOT null for a one-token output), small enough to commit
    (run / "per_request_extract.json").write_text(json.dumps(
        {w: {side: [[round(t, 3), None if p is None else round(p, 4)] for t, p in v] for side, v in sides.items()}
         for w, sides in extract.items()}))
    if samples is None:
        return
    view = server_view(runs, samples, date)
    print("\nThe server's view of the same runs (pdserve's own histograms):\n")
    print("| workload | runs A / B | server TTFT mean A / B ms | client / server TTFT A / B | tool vs pdserve bench, "
          "net of load | server gap mean A / B ms | client TPOT / server gap A / B | tool vs pdserve bench, net |")
    print("|---|---|---|---|---|---|---|---|")
    for w in workloads:
        a, b = view.get((w, "pdserve")), view.get((w, "tool"))
        if a and b:
            ta, tb, ga, gb = a[3] / a[0], b[3] / b[0], a[4] / a[1], b[4] / b[1]
            print(f"| {w} | {a[2]} / {b[2]} | {a[0]:.1f} / {b[0]:.1f} | {ta:.3f} / {tb:.3f} | {tb / ta:.2f} | "
                  f"{a[1]:.2f} / {b[1]:.2f} | {ga:.3f} / {gb:.3f} | {gb / ga:.2f} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]), *(Path(sys.argv[2]), sys.argv[3]) if len(sys.argv) > 3 else ())
