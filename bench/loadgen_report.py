"""What the load generator reports: per-request results, the summary and the plots.

Definitions (all times in seconds in the JSON, milliseconds in the printed table):

- TTFT: request sent to first streamed token received.
- TBT, also called ITL (inter-token latency): gap between consecutive streamed chunks of one
  request; the percentiles pool the gaps of all successful requests (``tbt_s`` in the JSON).
- TPOT (time per output token): per request, (e2e - TTFT) / (output tokens - 1), over the
  successful requests with more than one output token (as vLLM's benchmark defines it).
- e2e: request sent to the stream's end.
- throughput: output tokens of successful requests / wall time of the measured run.
- goodput: successful requests per second whose TTFT <= slo_ttft and whose mean TBT
  <= slo_tbt (the SLO is met per request, as in DistServe).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .provenance import save_figure

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestResult:
    """The outcome of one request as the client saw it. Times are offsets from the run start."""

    index: int
    prompt_tokens: int        # as requested
    output_tokens: int        # as requested (max_tokens)
    sent_at: float = 0.0
    ok: bool = False
    error: str = ""
    status: int = 0
    ttft: float | None = None
    e2e: float | None = None
    gaps: list[float] = field(default_factory=list)  # time between tokens
    chunks: int = 0
    usage_prompt_tokens: int | None = None      # the server's count, when it reports usage
    usage_completion_tokens: int | None = None

    @property
    def tokens_out(self) -> int:
        return self.usage_completion_tokens if self.usage_completion_tokens is not None else self.chunks

    @property
    def tpot(self) -> float | None:
        """(e2e - TTFT) / (tokens - 1); None for one token or an unfinished request."""
        if self.ttft is None or self.e2e is None or self.tokens_out < 2:
            return None
        return (self.e2e - self.ttft) / (self.tokens_out - 1)

    @property
    def mean_tbt(self) -> float:
        return sum(self.gaps) / len(self.gaps) if self.gaps else 0.0

    def to_json(self) -> dict:
        return asdict(self)


def percentile(values: list[float], p: float) -> float | None:
    """Linear-interpolated percentile (like numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _dist(values: list[float]) -> dict:
    out = {f"p{p}": percentile(values, p) for p in PERCENTILES}
    out["mean"] = sum(values) / len(values) if values else None
    out["max"] = max(values) if values else None
    out["count"] = len(values)
    return out


def summarize(results: list[RequestResult], duration: float, slo_ttft: float | None = None,
              slo_tbt: float | None = None) -> dict:
    """The run's summary (JSON-ready). duration is the measured run's wall time in seconds."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    good = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = r.error.split(":", 1)[0][:80] or "unknown"
            errors[key] = errors.get(key, 0) + 1
    met = [r for r in good if (slo_ttft is None or (r.ttft is not None and r.ttft <= slo_ttft))
           and (slo_tbt is None or r.mean_tbt <= slo_tbt)]
    out_tokens = sum(r.tokens_out for r in good)
    in_tokens = sum(r.usage_prompt_tokens if r.usage_prompt_tokens is not None else r.prompt_tokens for r in good)
    return {
        "requests": len(results),
        "succeeded": len(good),
        "failed": len(results) - len(good),
        "errors": errors,
        "duration_s": duration,
        "request_throughput": len(good) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + in_tokens) / duration,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "ttft_s": _dist([r.ttft for r in good if r.ttft is not None]),
        "tpot_s": _dist([r.tpot for r in good if r.tpot is not None]),
        "tbt_s": _dist([g for r in good for g in r.gaps]),
        "e2e_s": _dist([r.e2e for r in good if r.e2e is not None]),
        "slo": {"ttft_s": slo_ttft, "tbt_s": slo_tbt},
        "slo_attained": len(met) / len(results) if results else 0.0,
        "goodput": len(met) / duration,
    }


def format_summary(s: dict) -> str:
    """A short human-readable table of a summary."""
    def ms(v):
        return "-" if v is None else f"{v * 1000:.1f}"
    lines = [
        f"requests: {s['succeeded']}/{s['requests']} ok in {s['duration_s']:.2f}s"
        + (f"  errors: {s['errors']}" if s["errors"] else ""),
        f"throughput: {s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} output tok/s, "
        f"{s['total_token_throughput']:.1f} total tok/s",
        f"goodput: {s['goodput']:.2f} req/s ({s['slo_attained'] * 100:.0f}% of requests met the SLO)",
        f"{'ms':<6}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}",
    ]
    for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "tbt_s"), ("e2e", "e2e_s")):
        d = s[key]
        lines.append(f"{name:<6}{ms(d['p50']):>10}{ms(d['p90']):>10}{ms(d['p99']):>10}{ms(d['mean']):>10}")
    return "\n".join(lines)


def plot(results: list[RequestResult], path: Path, title: str = "pdserve bench serving") -> Path:
    """One PNG: CDF of TTFT, CDF of TBT, and a timeline of requests (sent -> first token -> end)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, values, name in ((axes[0], [r.ttft for r in good if r.ttft is not None], "TTFT"),
                             (axes[1], [g for r in good for g in r.gaps], "time between tokens")):
        xs = sorted(v * 1000 for v in values)
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))])
            ax.set_xscale("log" if xs[-1] > 20 * max(xs[0], 1e-3) else "linear")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of " + ("requests" if name == "TTFT" else "gaps"))
        ax.set_title(f"CDF of {name}")
        ax.grid(True, alpha=0.3)
    ax = axes[2]
    for r in results:
        if r.ok and r.ttft is not None and r.e2e is not None:
            ax.plot([r.sent_at, r.sent_at + r.ttft], [r.index, r.index], color="tab:orange", lw=1.5)
            ax.plot([r.sent_at + r.ttft, r.sent_at + r.e2e], [r.index, r.index], color="tab:blue", lw=1.5)
        else:
            ax.plot([r.sent_at], [r.index], "x", color="tab:red")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("request")
    ax.set_title("timeline: waiting for first token (orange), decoding (blue), failed (x)")
    ax.title.set_fontsize(9)
    fig.suptitle(title)
    return save_figure(fig, path)
