"""Where the peer-trace TTFT gap comes from: the trace's requests one at a time through each system.

    .venv/bin/python bench/tools/peer_trace_alone.py [--systems pdserve,vllm] [--repeats 1] [--requests N]
        [--json out.json]

``pdserve bench experiment peer --trace`` found pdserve's median TTFT 7.8x vLLM P/D's on the same
requests (docs/benchmarks.md, "pdserve P/D vs vLLM P/D on Mooncake's conversation trace"). Under load
a TTFT mixes three things: queueing, each prompt's prefill time, and the prefix cache's hits. This
tool removes the first: it starts each system as the experiment does (the ``small`` checkpoint, fp32,
prefill on CPU 0 and decode on CPU 1, 16,384 tokens of KV each; pdserve over tcp, vLLM over its
NixlConnector), warms it with 2 random requests, then sends the trace's requests in their order, one
at a time, each with one output token (a prefill alone). Before and after each request it reads the
prefill server's prefix-cache counter (pdserve: ``pdserve_prefix_cache_hit_tokens_total``; vLLM:
``vllm:prefix_cache_hits_total``), so every request has its own hit count.

Printed per system: prompt tokens sent, the share the prefix cache served, the sum and median of the
TTFTs, and a least-squares fit of TTFT against the tokens each request computed (prompt - hits):
milliseconds per 1,000 computed tokens and a fixed part. Systems alternate A B A B over ``--repeats``.

``--load`` puts the first term back, to see where it goes: the whole trace at its arrival times with
its output lengths (the experiment's replay, ``--requests`` ignored), then the client's TTFT sum and
median and, from each server's /metrics before and after, the sums of the histograms that split a
TTFT: pdserve's prefill ``pdserve_queue_wait_seconds`` (in line until a decode allocated the
request's blocks), ``pdserve_prefill_compute_seconds`` (allocated to the last layer computed, the
wait for the engine included) and ``pdserve_kv_transfer_seconds``; vLLM's ``request_queue_time``
and ``request_prefill_time`` on its prefill and its decode instance. With them, each side's CPU
seconds during the replay (its processes, from /proc) over the wall time: a prefill core well below
100% while requests wait in line is a scheduling gap, not a lack of compute. For pdserve also each
server's CPU seconds by thread over the replay (``GET /debug/threads`` before and after): the engine's
thread against the event loop and the CacheStore threads that share its core.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from pdserve import thread_cpu
from pdserve.bench.experiments import peer_trace
from pdserve.bench.experiments.client import send
from pdserve.bench.experiments.cluster import start_pd
from pdserve.bench.experiments.launcher import LOG_ROOT, Launcher, metric_sum, scrape
from pdserve.bench.experiments.peer import pdserve_engine_flags
from pdserve.bench.experiments.peer_model import kv_bytes_per_token
from pdserve.bench.experiments.peer_vllm import start_vllm_pd, vllm_python
from pdserve.bench.experiments.trace_routing import DEFAULT_TRACE
from pdserve.bench.loadgen_workload import RequestSpec, random_requests
from pdserve.bench.provenance import machine
from pdserve.cachestore.memory import DTYPE_BYTES

# Histograms (name without _sum / _count) whose sums say where a TTFT went under load (--load): pdserve's
# prefill server, and vLLM's prefill and decode instances.
BREAKDOWN = {
    "pdserve": ["pdserve_time_to_first_token_seconds", "pdserve_queue_wait_seconds", "pdserve_prefill_compute_seconds",
                "pdserve_kv_transfer_seconds", "pdserve_slo_queue_time_seconds"],
    "vllm": ["vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
             "vllm:request_prefill_time_seconds"],
}
HIT_COUNTER = {"pdserve": "pdserve_prefix_cache_hit_tokens_total", "vllm": "vllm:prefix_cache_hits_total"}
KV_TOKENS = 16384
DTYPE = "float32"


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a * x + b; (a, b)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return a, my - a * mx


def session_cpu_s(sid: int) -> float:
    """CPU seconds (user + system) of the live processes of session ``sid`` (a Launcher process and what it
    started: vLLM's engine core, pdserve's threads)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[3]) == sid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def start_system(launcher: Launcher, system: str, model: str, max_len: int,
           prefill_extra: tuple[str, ...] = ()) -> tuple[str, list[str], list[list[int]]]:
    """(OpenAI URL, the /metrics URLs: the prefill's first, the session ids of the prefill side and the decode
    side) of one system started as the peer experiment does (vLLM's proxy, pinned to the prefill's core, counts
    with the prefill)."""
    if system == "pdserve":
        flags = argparse.Namespace(transfer="tcp", dtype=DTYPE, pdserve_engine="builtin", kv_tokens=KV_TOKENS)
        extra, blocks = pdserve_engine_flags(flags)
        c = start_pd(launcher, model, 1, prefill_threads=1, decode_threads=1, prefill_cpus="0", decode_cpus="1",
                     num_blocks=blocks, max_model_len=max_len, prefill_extra=extra + list(prefill_extra),
                     decode_extra=extra)
        return (c.url, [c.prefill.metrics_url, c.decodes[0].metrics_url],
                [[c.prefill.proc.popen.pid], [c.decodes[0].proc.popen.pid]])
    kv_bytes = KV_TOKENS * kv_bytes_per_token("small", DTYPE_BYTES[DTYPE])
    v = start_vllm_pd(launcher, vllm_python(), model, kv_bytes=kv_bytes, max_len=max_len, dtype=DTYPE)
    return (v.url, [v.prefill_url + "/metrics", v.decode_url + "/metrics"],
            [[v.prefill.popen.pid, v.proxy.popen.pid], [v.decode.popen.pid]])


def warm_up(url: str, specs: list[RequestSpec], pool: list[int], output_tokens: int) -> None:
    """2 random requests of the specs' median prompt length (sharing no prefix with the trace), one at a time."""
    warm = round(statistics.median(s.prompt_tokens for s in specs))
    send(url, random_requests(2, warm, output_tokens, random.Random(-warm), pool), concurrency=1)


def one_system(system: str, model: str, max_len: int, specs: list[RequestSpec], pool: list[int]) -> list[dict]:
    """Each request alone: prompt tokens, prefix hits, TTFT (seconds)."""
    rows = []
    with Launcher(LOG_ROOT / f"peer-trace-alone-{system}") as launcher:
        url, urls, _ = start_system(launcher, system, model, max_len)
        metrics = urls[0]
        warm_up(url, specs, pool, output_tokens=1)
        for i, spec in enumerate(specs):
            before = metric_sum(scrape(metrics), HIT_COUNTER[system])
            results, _ = send(url, [RequestSpec(spec.prompt_tokens, 1, spec.prompt, spec.prompt_ids)], concurrency=1)
            hits = metric_sum(scrape(metrics), HIT_COUNTER[system]) - before
            r = results[0]
            if not r.ok:
                raise RuntimeError(f"{system}: request {i} failed: {r.error}")
            rows.append({"prompt": spec.prompt_tokens, "hits": hits, "ttft": r.ttft})
            if (i + 1) % 25 == 0:
                print(f"  {system}: {i + 1}/{len(specs)}", file=sys.stderr, flush=True)
    return rows


def under_load(system: str, model: str, max_len: int, work, pool: list[int],
               prefill_extra: tuple[str, ...] = ()) -> dict:
    """The trace at its arrival times (the experiment's replay): client TTFTs and each server's histogram sums."""
    with Launcher(LOG_ROOT / f"peer-trace-load-{system}") as launcher:
        url, urls, sessions = start_system(launcher, system, model, max_len, prefill_extra)
        warm_up(url, work.specs, pool, output_tokens=8)
        threads0 = [debug_threads(u) for u in urls] if system == "pdserve" else [None, None]
        before, cpu0 = [scrape(u) for u in urls], [sum(map(session_cpu_s, side)) for side in sessions]
        results, wall = send(url, work.specs, arrivals=work.arrivals)
        after, cpu1 = [scrape(u) for u in urls], [sum(map(session_cpu_s, side)) for side in sessions]
        threads1 = [debug_threads(u) for u in urls] if system == "pdserve" else [None, None]
        recent = (json.loads(urllib.request.urlopen(urls[0].removesuffix("/metrics") + "/debug/requests",
                                                    timeout=10).read())["requests"] if system == "pdserve" else [])
    ttfts = sorted(r.ttft for r in results if r.ok)
    out = {"ok": len(ttfts), "failed": len(results) - len(ttfts), "wall_s": wall,
           "errors": [r.error for r in results if not r.ok][:3],
           "ttft_sum_s": sum(ttfts), "ttft_p50_ms": statistics.median(ttfts) * 1000, "servers": [],
           "timeline": timeline(recent[-len(work.specs):])}
    for role, b, a, c0, c1, t0, t1 in zip(("prefill", "decode"), before, after, cpu0, cpu1, threads0, threads1):
        hist = {}
        for name in BREAKDOWN[system]:
            n = metric_sum(a, name + "_count") - metric_sum(b, name + "_count")
            if n:
                hist[name] = {"count": n, "sum_s": metric_sum(a, name + "_sum") - metric_sum(b, name + "_sum")}
        threads = thread_cpu.by_name_delta(t0, t1) if t0 and t1 else {}
        out["servers"].append({"role": role, "histograms": hist, "cpu_s": c1 - c0,
                               "threads_cpu_s": dict(sorted(threads.items(), key=lambda kv: -kv[1]))})
    return out


def debug_threads(metrics_url: str) -> dict:
    """A pdserve server's GET /debug/threads (each thread's CPU seconds so far)."""
    return json.loads(urllib.request.urlopen(metrics_url.removesuffix("/metrics") + "/debug/threads",
                                             timeout=10).read())


def timeline(requests: list[dict], step_s: float = 0.001) -> dict:
    """pdserve's prefill over the replay, from its /debug/requests: seconds the engine computed (the union of
    each request's forward pass: its first layer stored, less one layer's time, to its last), and seconds it did
    not while some request waited for it: in line (arrived, no decode allocated yet) or allocated (its forward
    pass not begun). On a 1 ms grid."""
    spans = []
    for r in requests:
        stored = r["layer_stored"]
        if not stored or not r["prefill_done"] or not r["arrived"]:
            continue
        layer = (stored[-1] - stored[0]) / (len(stored) - 1) if len(stored) > 1 else 0.0
        spans.append((r["arrived"], r["allocated"] or stored[0], stored[0] - layer, r["prefill_done"]))
    if not spans:
        return {}
    t0, t1 = min(s[0] for s in spans), max(s[3] for s in spans)
    n = int((t1 - t0) / step_s) + 1

    def mark(pairs) -> bytearray:
        grid = bytearray(n)
        for a, b in pairs:
            i, j = int((a - t0) / step_s), int((b - t0) / step_s)
            if j > i:
                grid[i:j] = b"\x01" * (j - i)
        return grid

    busy = mark((c, d) for _, _, c, d in spans)
    in_line = mark((a, b) for a, b, _, _ in spans)
    allocated = mark((b, c) for _, b, c, _ in spans)
    idle_line = sum(1 for k in range(n) if in_line[k] and not busy[k] and not allocated[k])
    idle_alloc = sum(1 for k in range(n) if allocated[k] and not busy[k])
    return {"requests": len(spans), "span_s": n * step_s, "computing_s": sum(busy) * step_s,
            "idle_while_allocated_waits_s": idle_alloc * step_s,
            "idle_while_only_in_line_waits_s": idle_line * step_s}


def print_load(system: str, repeat: int, r: dict) -> None:
    print(f"{system} #{repeat + 1} under load: {r['ok']} ok, {r['failed']} failed in {r['wall_s']:.0f} s; client TTFT "
          f"sum {r['ttft_sum_s']:.1f} s, p50 {r['ttft_p50_ms']:.0f} ms"
          + "".join(f"\n  failed: {e}" for e in r.get("errors", [])), flush=True)
    t = r.get("timeline")
    if t:
        print(f"  prefill  engine timeline ({t['requests']} requests, {t['span_s']:.0f} s): computing "
              f"{t['computing_s']:.1f} s; not computing while an allocated request waited "
              f"{t['idle_while_allocated_waits_s']:.1f} s, while requests waited only in line "
              f"{t['idle_while_only_in_line_waits_s']:.1f} s", flush=True)
    for server in r["servers"]:
        print(f"  {server['role']:8s} CPU {server['cpu_s']:.1f} s in {r['wall_s']:.0f} s "
              f"({server['cpu_s'] / r['wall_s']:.0%} of its core)", flush=True)
        if server.get("threads_cpu_s"):
            print(f"  {server['role']:8s} CPU by thread: " + ", ".join(
                f"{name} {cpu:.1f} s" for name, cpu in server["threads_cpu_s"].items() if cpu >= 0.05), flush=True)
        for name, h in server["histograms"].items():
            print(f"  {server['role']:8s} {name}: {h['count']:.0f} observations, sum {h['sum_s']:.1f} s, "
                  f"mean {h['sum_s'] / h['count'] * 1000:.0f} ms", flush=True)


def summary(rows: list[dict]) -> dict:
    prompt, hits = sum(r["prompt"] for r in rows), sum(r["hits"] for r in rows)
    computed = [r["prompt"] - r["hits"] for r in rows]
    a, b = fit([c / 1000 for c in computed], [r["ttft"] * 1000 for r in rows])
    big = [r["ttft"] * 1000 / ((r["prompt"] - r["hits"]) / 1000) for r in rows if r["prompt"] - r["hits"] >= 1024]
    return {"requests": len(rows), "prompt_tokens": prompt, "hit_share": hits / prompt if prompt else 0.0,
            "ttft_sum_s": sum(r["ttft"] for r in rows),
            "ttft_p50_ms": statistics.median(r["ttft"] for r in rows) * 1000,
            "ms_per_1k_computed": a, "fixed_ms": b,
            "ms_per_1k_computed_p50_of_big": statistics.median(big) if big else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--systems", default="pdserve,vllm", help="comma-separated, in the order of each repeat")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--requests", type=int, default=None, help="only the first N of the trace's requests")
    p.add_argument("--load", action="store_true",
                   help="replay at the trace's arrival times instead (as the experiment does) and print where the "
                        "servers' TTFT went (their histograms' sums)")
    p.add_argument("--pdserve-prefill-extra", default="", help="more flags for pdserve's prefill (one string)")
    p.add_argument("--json", type=Path, default=None, help="write every request's row and the summaries here")
    a = p.parse_args()
    t = peer_trace.default_trace(a.trace)
    trace_args, max_len, model, pool, work = t.args, t.max_len, t.model, t.pool, t.work
    specs = work.specs[: a.requests]
    how = "at their arrival times" if a.load else "one at a time, 1 output token"
    print(f"{peer_trace.describe(trace_args, work)}; sent {how}; {len(specs)} requests", flush=True)
    doc = {"machine": machine(), "command": " ".join(sys.argv), "runs": []}
    for repeat in range(a.repeats):
        for system in a.systems.split(","):
            t0 = time.monotonic()
            if a.load:
                extra = tuple(shlex.split(a.pdserve_prefill_extra)) if system == "pdserve" else ()
                r = under_load(system, model, max_len, work, pool, extra)
                doc["runs"].append({"system": system, "repeat": repeat, "load": r})
                print_load(system, repeat, r)
                continue
            rows = one_system(system, model, max_len, specs, pool)
            s = summary(rows)
            doc["runs"].append({"system": system, "repeat": repeat, "summary": s, "rows": rows})
            print(f"{system} #{repeat + 1} ({time.monotonic() - t0:.0f} s): {s['requests']} requests, "
                  f"{s['prompt_tokens']} prompt tokens, prefix hits {s['hit_share']:.1%}; TTFT sum "
                  f"{s['ttft_sum_s']:.1f} s, p50 {s['ttft_p50_ms']:.0f} ms; fit {s['ms_per_1k_computed']:.0f} ms "
                  f"per 1K computed tokens + {s['fixed_ms']:.0f} ms; requests computing >= 1K tokens: median "
                  f"{s['ms_per_1k_computed_p50_of_big'] or 0:.0f} ms per 1K", flush=True)
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
