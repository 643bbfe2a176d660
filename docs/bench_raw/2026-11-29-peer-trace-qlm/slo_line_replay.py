"""The trace's arrivals through pdserve's SLO queue (pdserve.slo.GlobalQueue, the product's policy code)
in front of one simulated prefill engine: a discrete-event replay, not a benchmark.

    .venv/bin/python docs/bench_raw/2026-11-29-peer-trace-qlm/slo_line_replay.py

Each request's prefill takes the CPU seconds pdserve's engine took for it alone (x SCALE, + 5 ms), from
docs/bench_raw/2026-11-29-engine-trace/engine-trace.json (bench/tools/trace_engine_compute.py, its
prefix hits as they fell in arrival order); one prompt at a time; then 31 more tokens 12 ms apart.
Printed per policy, with the plan's backend as the decodes' KV blocks or the prefill's one engine
(``prefill_bound``): requests whose first token came within 2 s, and the TTFT p50 and p99.
"""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from bench.experiments.peer_trace import default_trace  # noqa: E402
from pdserve.slo import GlobalQueue, parse  # noqa: E402

SLO = parse({"ttftMs": 2000, "tbtMs": 100})
ENGINE = REPO / "docs/bench_raw/2026-11-29-engine-trace/engine-trace.json"


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def replay(arrivals, rows, policy: str, prefill_bound: bool, scale: float) -> list[float]:
    clock = Clock()
    q = GlobalQueue(SLO, policy, None, clock, kv_capacity=lambda: 256)  # 16,384 tokens of 64-token blocks
    q.prefill_bound = prefill_bound
    cost = [r["cpu"] * scale + 0.005 for r in rows]
    n, i, busy_until, ttft, decoding = len(arrivals), 0, 0.0, {}, []
    while len(ttft) < n:
        next_arrival = arrivals[i] if i < n else float("inf")
        clock.t = min(next_arrival, busy_until) if busy_until > clock.t else next_arrival
        for end, req in [x for x in decoding if x[0] <= clock.t]:
            decoding.remove((end, req))
            q.token(req, 31)
            q.finish(req, "ok")
        while i < n and arrivals[i] <= clock.t:
            prompt = rows[i]["prompt"]
            req = q.arrive(str(i), SLO.default, prompt, 32, -(-(prompt + 32) // 64), cached_tokens=rows[i]["hits"])
            q.wait(req)
            i += 1
        if clock.t >= busy_until and q.waiting:
            head = q.head()
            q.admitted(head)
            k = int(head.request_id)
            busy_until = clock.t + cost[k]
            ttft[k] = busy_until - arrivals[k]
            now, clock.t = clock.t, busy_until
            q.token(head, 1)
            clock.t = now
            decoding.append((busy_until + 31 * 0.012, head))
    return sorted(ttft.values())


def main() -> None:
    trace = default_trace()
    arrivals = list(trace.work.arrivals)
    rows = next(r["rows"] for r in json.loads(ENGINE.read_text())["runs"] if r["engine"] == "pdserve")
    for scale in (1.0, 1.1):
        for bound in (False, True):
            for policy in ("fifo", "edf", "qlm"):
                s = replay(arrivals, rows, policy, bound, scale)
                n = len(s)
                print(f"compute x{scale:.1f} plan {'one engine ' if bound else 'KV blocks  '} {policy:4s}: "
                      f"{sum(v <= 2.0 for v in s)}/{n} within 2 s, TTFT p50 {s[n // 2] * 1000:.0f} ms, "
                      f"p99 {s[int(n * 0.99)] * 1000:.0f} ms")


if __name__ == "__main__":
    main()
