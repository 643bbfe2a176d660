"""What the standard tools and pdserve bench report, read back for compare.py (each tool's own figures), the
server's own histograms around a run, and the tables of their ratios (per pair, and net of load)."""

from __future__ import annotations

import json
from pathlib import Path


def ms(x) -> float | None:
    return None if x is None else round(x * 1000, 3)


def read_pdserve(path: Path) -> dict:
    doc = json.loads(path.read_text())
    s, reqs = doc["summary"], [r for r in doc["requests"] if r["ok"]]
    return {"requests": s["requests"], "failed": s["failed"], "errors": s["errors"],
            "server_prompt_tokens_mean": s["prompt_tokens"] / max(1, s["succeeded"]),
            "server_output_tokens_mean": s["output_tokens"] / max(1, s["succeeded"]),
            "ttft_ms": {"mean": ms(s["ttft_s"]["mean"]), "p50": ms(s["ttft_s"]["p50"])},
            "tpot_ms": {"mean": ms(s["tpot_s"]["mean"]), "p50": ms(s["tpot_s"]["p50"])},
            "per_request": {"ttft_ms": [ms(r["ttft"]) for r in reqs]}}


def read_inference_perf(out: Path) -> dict:
    doc = json.loads((out / "summary_lifecycle_metrics.json").read_text())
    ok, lat = doc["successes"], doc["successes"]["latency"]
    return {"requests": doc["load_summary"]["count"], "failed": doc["failures"]["count"],
            "errors": doc["failures"].get("by_label", {}),
            "server_prompt_tokens_mean": ok["prompt_tokens"].get("mean"),
            "server_output_tokens_mean": ok["output_tokens"].get("mean"),
            "token_count_mismatches": ok.get("token_count_mismatches"),
            "ttft_ms": {"mean": ms(lat["time_to_first_token"]["mean"]),
                        "p50": ms(lat["time_to_first_token"]["median"])},
            "tpot_ms": {"mean": ms(lat["time_per_output_token"]["mean"]),
                        "p50": ms(lat["time_per_output_token"]["median"])},
            "summary": doc}


def read_aiperf(out: Path) -> dict:
    doc = json.loads((out / "profile_export_aiperf.json").read_text())
    count = doc["request_count"]["avg"]
    errors = doc.get("error_request_count", {}).get("avg", 0) if isinstance(doc.get("error_request_count"), dict) else 0
    keep = ("request_count", "error_request_count", "time_to_first_token", "inter_token_latency", "request_latency",
            "usage_prompt_tokens", "usage_completion_tokens", "input_sequence_length", "output_sequence_length",
            "request_throughput", "benchmark_duration", "error_summary", "aiperf_version", "was_cancelled")
    return {"requests": count + errors, "failed": errors, "errors": doc.get("error_summary"),
            "server_prompt_tokens_mean": doc["usage_prompt_tokens"]["avg"],
            "server_output_tokens_mean": doc["usage_completion_tokens"]["avg"],
            "ttft_ms": {"mean": doc["time_to_first_token"]["avg"], "p50": doc["time_to_first_token"]["p50"]},
            "tpot_ms": {"mean": doc["inter_token_latency"]["avg"], "p50": doc["inter_token_latency"]["p50"]},
            "summary": {k: doc[k] for k in keep if k in doc}}


def read_vllm_bench(path: Path) -> dict:
    """`vllm bench serve --save-result --save-detailed`'s JSON (TPOT: (e2e - TTFT) / (usage tokens - 1))."""
    doc = json.loads(path.read_text())
    done, failed = doc["completed"], doc["failed"]
    keep = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
            "mean_itl_ms", "median_itl_ms", "mean_e2el_ms", "median_e2el_ms")
    return {"requests": done + failed, "failed": failed, "errors": [e for e in doc.get("errors", []) if e][:5],
            "server_prompt_tokens_mean": doc["total_input_tokens"] / max(1, done),
            "server_output_tokens_mean": doc["total_output_tokens"] / max(1, done),
            "ttft_ms": {"mean": doc["mean_ttft_ms"], "p50": doc["median_ttft_ms"]},
            "tpot_ms": {"mean": doc["mean_tpot_ms"], "p50": doc["median_tpot_ms"]},
            "summary": {k: doc[k] for k in keep if k in doc}}


def served_model(url: str) -> str:
    """The model name the server at ``url`` answers to (its /v1/models)."""
    import urllib.request

    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=30) as resp:
        return json.loads(resp.read())["data"][0]["id"]


SERVER_SERIES = ("pdserve_time_to_first_token_seconds", "pdserve_time_between_tokens_seconds")


def server_histograms(url: str) -> dict[str, tuple[float, float]] | None:
    """The front door's own TTFT and gap-between-tokens histograms (sum, count) from its /metrics (None:
    not a pdserve, or no such series)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=30) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name in SERVER_SERIES:
            total = sum(x.value for x in family.samples if x.name == family.name + "_sum")
            count = sum(x.value for x in family.samples if x.name == family.name + "_count")
            out[family.name] = (total, count)
    return out if len(out) == len(SERVER_SERIES) else None


def server_means(before: dict | None, after: dict | None) -> dict | None:
    """The server's mean TTFT and mean gap between tokens (ms) over one run: what the load did, whichever
    client measured it (a client's figure over the server's takes the run's own arrivals out)."""
    if not before or not after:
        return None
    means = []
    for name in SERVER_SERIES:
        total, count = (b - a for a, b in zip(before[name], after[name]))
        means.append(round(total / count * 1000, 3) if count > 0 else None)
    return {"ttft_ms_mean": means[0], "gap_ms_mean": means[1]}


def summary_table(runs: list[dict]) -> str:
    rows = ["| workload | round | pdserve bench TTFT mean / p50 ms | tool TTFT mean / p50 ms | ratio mean / p50 | "
            "pdserve bench TPOT mean / p50 ms | tool TPOT mean / p50 ms | ratio mean / p50 | failed (bench / tool) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for a in (r for r in runs if r["side"] == "pdserve"):
        b = next((r for r in runs if r["side"] == "tool" and r["workload"] == a["workload"]
                  and r["round"] == a["round"]),
                 None)
        if b is None:
            continue
        cells = []
        for key in ("ttft_ms", "tpot_ms"):
            cells.append(f"{a[key]['mean']:.2f} / {a[key]['p50']:.2f}")
            cells.append(f"{b[key]['mean']:.2f} / {b[key]['p50']:.2f}")
            cells.append(f"{b[key]['mean'] / a[key]['mean']:.2f} / {b[key]['p50'] / a[key]['p50']:.2f}")
        rows.append(f"| {a['workload']} | {a['round']} | " + " | ".join(cells) + f" | {a['failed']} / {b['failed']} |")
    return "\n".join(rows) + "\n" + net_of_load_table(runs)


def net_of_load_table(runs: list[dict]) -> str:
    """Per workload, over the rounds: each side's mean over the server's own mean for the same runs, and the
    tool's such ratio over pdserve bench's: the two clients' agreement on one measure, net of their runs'
    different arrivals (one Poisson sample of ~30 requests queues a burst, the next does not)."""
    rows = ["", "Net of load (client mean / the server's own mean over the same runs; request-weighted):", "",
            "| workload | TTFT client/server: bench, tool | tool vs bench | TPOT / server gap: bench, tool | "
            "tool vs bench |", "|---|---|---|---|---|"]
    for workload in dict.fromkeys(r["workload"] for r in runs):
        acc = {}
        for r in runs:
            srv = r.get("server")
            if r["workload"] != workload or not srv or srv["ttft_ms_mean"] is None or srv["gap_ms_mean"] is None:
                continue
            n = r["requests"] - r["failed"]
            a = acc.setdefault(r["side"], [0.0, 0.0, 0.0, 0.0])
            a[0] += n * r["ttft_ms"]["mean"]
            a[1] += n * srv["ttft_ms_mean"]
            a[2] += n * r["tpot_ms"]["mean"]
            a[3] += n * srv["gap_ms_mean"]
        if "pdserve" not in acc or "tool" not in acc:
            continue
        a, b = acc["pdserve"], acc["tool"]
        ta, tb, ga, gb = a[0] / a[1], b[0] / b[1], a[2] / a[3], b[2] / b[3]
        rows.append(f"| {workload} | {ta:.3f}, {tb:.3f} | {tb / ta:.2f} | {ga:.3f}, {gb:.3f} | {gb / ga:.2f} |")
    return "\n".join(rows) + "\n" if len(rows) > 5 else ""
