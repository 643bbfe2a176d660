"""Where a decode's slow steps come from: the causes of the slowest steps of a step trace.

Reads the JSON lines a decode writes with ``--step-trace FILE`` (engine/step_trace.py) and looks at its
pure decode steps (no prompt chunk). A step's *interval* is its wall time plus the gap before it
(the calls run between steps, the outputs' delivery): what a client sees between two tokens. Each
interval is compared with the median interval of steps of the same number of rows (a batch of three
is slower than one of one: that is batching, not a tail; the gap counts only when a request of the step
before is in this one), and the slowest ``--top`` fraction (1 %)
of steps by that ratio is split by cause, each counted also over all steps (its base rate), so a
cause shows as over-represented among the slow ones or not:

- ``gc2`` / ``gc1`` / ``gc0``: a Python collection of that generation started in or just before it;
- ``join``: a request joined the batch in this step (its admission call ran just before);
- ``new_rows``: the first step at this many rows (a batch shape not seen before);
- ``faults``: the engine thread took more than 256 page faults in it (first touches of memory);
- ``kv_in``: KV bytes landed in the CacheStore during the step; ``transfer``: a reservation was
  open (a prompt being computed by the prefill, its KV on its way), none landing;
- ``calls``: the calls before the step took more than ``--share`` of the median interval;
- ``loop``: the event loop's thread (gRPC streams, sessions) used more than ``--share`` of it;
- ``other``: the process's other threads (CacheStore) did;
- ``wait``: none of the process's threads ran for more than ``--share`` of it (another process had
  the core: a loaded box);
- ``none``: none of these.

With ``--by cpu`` the steps are ranked by the CPU time the decode's own threads spent in them instead
(engine + event loop + others): on a box whose other processes take the core, wall times are mostly
their doing (``wait``), CPU times are pdserve's.

  .venv/bin/python bench/tools/step_causes.py decode-steps.jsonl [--top 0.01] [--by cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

CAUSES = ("gc2", "gc1", "gc0", "join", "new_rows", "faults", "kv_in", "transfer", "calls", "loop", "other", "wait",
          "none")
FAULTS = 256  # page faults in a step above which they count as a cause (a MiB of first touches)


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def interval(step: dict) -> float:
    """The time between tokens the step gave a request of the step before: the gap before it counts when one
    of its requests was in the step before (else the gap was idle time or another request's wait to join)."""
    continued = step["rows"] + (1 if step["chunk_tokens"] else 0) > step["joined"]
    return step["seconds"] + (step["gap_s"] if continued else 0.0)


def own_cpu(step: dict) -> float:
    """The CPU time the decode's process spent in the step, all its threads: what a loaded box does not inflate
    (another process taking the core adds wall time, ``wait_s``, not CPU time)."""
    return step["engine_cpu_s"] + step["loop_cpu_s"] + step["other_cpu_s"]


MEASURES = {"interval": interval, "cpu": own_cpu}


def causes(step: dict, median: float, share: float, wait: bool = True) -> list[str]:
    """The causes a step shows (module docstring), in CAUSES order (``wait`` False: not that one)."""
    found = []
    gens = {g for g, _ in step.get("gc", [])}
    found += [f"gc{g}" for g in (2, 1, 0) if g in gens]
    if step["joined"]:
        found.append("join")
    if step["new_rows"]:
        found.append("new_rows")
    if step.get("faults", 0) > FAULTS:
        found.append("faults")
    if step.get("kv_bytes", 0) > 0:
        found.append("kv_in")
    elif step["pending"]:
        found.append("transfer")
    limit = share * median
    for name, key in (("calls", "calls_s"), ("loop", "loop_cpu_s"), ("other", "other_cpu_s"), ("wait", "wait_s")):
        if step[key] > limit and (wait or name != "wait"):
            found.append(name)
    return found or ["none"]


def analyse(steps: list[dict], top: float = 0.01, share: float = 0.1, by: str = "interval") -> dict:
    measure = MEASURES[by]
    decode = [s for s in steps if s["rows"] > 0 and not s["chunk_tokens"]]
    if not decode:
        raise ValueError("no pure decode step in the trace")
    by_rows: dict[int, list[float]] = defaultdict(list)
    for s in decode:
        by_rows[s["rows"]].append(measure(s))
    medians = {rows: statistics.median(v) for rows, v in by_rows.items()}
    rated = []
    for s in decode:
        median = medians[s["rows"]]
        rated.append((measure(s) / median, s, causes(s, median, share, wait=by == "interval")))
    rated.sort(key=lambda r: -r[0])
    n_slow = max(1, round(top * len(rated)))
    slow, base = Counter(), Counter()
    for i, (_, _, found) in enumerate(rated):
        base.update(found)
        if i < n_slow:
            slow.update(found)
    return {
        "steps": len(steps), "decode_steps": len(decode), "slow_steps": n_slow, "top": top, "share": share, "by": by,
        "median_interval_s_by_rows": {str(k): round(v, 6) for k, v in sorted(medians.items())},
        "steps_by_rows": {str(k): len(v) for k, v in sorted(by_rows.items())},
        "causes": {c: {"slow": slow[c], "slow_frac": round(slow[c] / n_slow, 3), "all": base[c],
                       "all_frac": round(base[c] / len(rated), 3)} for c in CAUSES},
        "slowest": [{"ratio": round(r, 2), "causes": found,
                     **{k: s[k] for k in ("t", "rows", "seconds", "gap_s", "calls_s", "engine_cpu_s", "loop_cpu_s",
                                          "other_cpu_s", "wait_s", "gc", "joined", "pending", "kv_bytes", "faults")
                        if k in s}}
                    for r, s, found in rated[:n_slow]],
    }


def format_report(out: dict) -> str:
    what = "interval" if out.get("by", "interval") == "interval" else "own CPU"
    lines = [f"{out['decode_steps']} pure decode steps of {out['steps']}; slowest {out['slow_steps']} "
             f"({out['top']:.0%}) by {what} / median {what} of their batch size "
             f"(medians ms by rows: " + ", ".join(f"{k}: {1000 * v:.1f}" for k, v in
                                                   out["median_interval_s_by_rows"].items()) + ")",
             f"{'cause':<10}{'slow':>6}{'of slow':>9}{'all':>8}{'of all':>8}"]
    for c, row in out["causes"].items():
        lines.append(f"{c:<10}{row['slow']:>6}{row['slow_frac']:>9.0%}{row['all']:>8}{row['all_frac']:>8.1%}")
    lines.append("slowest steps: ratio, rows, ms (step + gap), causes")
    for s in out["slowest"][:20]:
        lines.append(f"  {s['ratio']:>5.2f}x  rows {s['rows']}  {1000 * s['seconds']:.1f} + {1000 * s['gap_s']:.1f} ms"
                     f"  {' '.join(s['causes'])}  gc {s['gc']}  loop {1000 * s['loop_cpu_s']:.1f} other "
                     f"{1000 * s['other_cpu_s']:.1f} wait {1000 * s['wait_s']:.1f} calls {1000 * s['calls_s']:.1f} ms"
                     f"  faults {s.get('faults', 0)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace", type=Path, nargs="+", help="--step-trace files (JSON lines); several are pooled")
    p.add_argument("--top", type=float, default=0.01, help="the slowest fraction of steps looked at (default 0.01)")
    p.add_argument("--share", type=float, default=0.1,
                   help="a thread's CPU (or the calls, or the wait) counts as a cause above this share of the "
                        "median interval (default 0.1)")
    p.add_argument("--by", choices=sorted(MEASURES), default="interval",
                   help="rank steps by their interval (wall time: what a client sees) or by the CPU time the decode's "
                        "own threads spent in them (cpu: what pdserve itself costs, not inflated by other processes "
                        "taking the core)")
    p.add_argument("--json", type=Path, default=None, help="also write the analysis here")
    a = p.parse_args(argv)
    steps = [s for path in a.trace for s in load(path)]
    try:
        out = analyse(steps, a.top, a.share, a.by)
    except ValueError as exc:
        print(f"step_causes: {exc}", file=sys.stderr)
        return 2
    print(format_report(out))
    if a.json is not None:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
