"""What every experiment writes: <out>/<name>.json (the run's provenance, command, figures) and a PNG."""

from __future__ import annotations

import sys
from pathlib import Path

from ..provenance import save_figure, write_json



def command() -> str:
    return "pdserve " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("pdserve") else " ".join(sys.argv)


def save(out: Path, name: str, doc: dict) -> Path:
    return write_json(Path(out) / f"{name}.json", {"experiment": name, "command": command(), **doc})


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def cdf(ax, values: list[float], label: str, scale: float = 1000.0) -> None:
    xs = sorted(v * scale for v in values)
    if xs:
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def ttft_cdf_panel(ax, ttfts: dict[str, list[float]], of: str = "requests", title: str = "CDF of TTFT",
                   xlabel: str = "TTFT (ms)") -> None:
    """One TTFT CDF per name (seconds in, milliseconds on a log axis), labelled, with a grid."""
    for name, values in ttfts.items():
        cdf(ax, values, name)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"fraction of {of}")
    ax.set_title(title)
    ax.legend()
    ax.grid(True, alpha=0.3)


def bars_and_ttft_cdf(path: Path, title: str, bars: dict[str, float], bar_title: str, ttfts: dict[str, list[float]],
                      colors: list[str], bar_ylabel: str | None = None, ttft_label: str = "TTFT (ms)") -> Path:
    """The two-panel figure of several experiments: one bar per run (left), each run's TTFT CDF (right)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    axes[0].bar(list(bars), list(bars.values()), color=colors[:len(bars)])
    if bar_ylabel:
        axes[0].set_ylabel(bar_ylabel)
    axes[0].set_title(bar_title)
    ttft_cdf_panel(axes[1], ttfts, xlabel=ttft_label)
    fig.suptitle(title)
    return save_figure(fig, path)
