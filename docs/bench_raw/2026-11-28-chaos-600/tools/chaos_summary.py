#!/usr/bin/env python3
"""Keep a `pdserve bench chaos` run's JSON small enough for docs/: everything but the per-request
list, plus the failed requests' errors grouped (the full file stays where the bench wrote it).

    .venv/bin/python bench/tools/chaos_summary.py FULL.json OUT.json
"""

from __future__ import annotations

import argparse
import collections
import json


def summary(run: dict, top: int = 15) -> dict:
    """``run`` without its ``requests``; ``requests_count`` and the ``top`` most common errors (first 120
    characters) of the requests that did not complete."""
    out = {k: v for k, v in run.items() if k != "requests"}
    requests = run["requests"]
    errors = collections.Counter((r.get("error") or "")[:120] for r in requests if r.get("outcome") != "completed")
    out["requests_failed_errors"] = errors.most_common(top)
    out["requests_count"] = len(requests)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("full", help="the JSON `pdserve bench chaos --out DIR` wrote")
    parser.add_argument("out", help="where to write the summary")
    args = parser.parse_args()
    with open(args.full) as f:
        run = json.load(f)
    with open(args.out, "w") as f:
        json.dump(summary(run), f, indent=1)


if __name__ == "__main__":
    main()
