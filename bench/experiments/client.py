"""Send an experiment's requests from here, or from inside a network namespace.

``send(url, specs, arrivals=..., concurrency=..., netns=None)`` returns the loadgen
RequestResults. With ``netns`` it runs ``ip netns exec NS python -m
pdserve.bench.experiments.client IN OUT`` (the same code, in the namespace where the prefill's
HTTP port is), passing the requests and results through JSON files.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from pdserve.bench.loadgen import LoadConfig, send_requests
from pdserve.bench.loadgen_report import RequestResult
from pdserve.bench.loadgen_workload import RequestSpec

from .cluster import SERVED_MODEL


def send(url: str, specs: list[RequestSpec], arrivals: list[float] | None = None, concurrency: int | None = None,
         netns: str | None = None, timeout: float = 900.0,
         model: str = SERVED_MODEL) -> tuple[list[RequestResult], float]:
    if netns is None:
        config = LoadConfig(url=url, model=model, progress=False, request_timeout=timeout)
        return asyncio.run(send_requests(config, specs, arrivals=arrivals, concurrency=concurrency))
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.json", Path(tmp) / "out.json"
        src.write_text(json.dumps({"url": url, "model": model, "timeout": timeout, "arrivals": arrivals,
                                   "concurrency": concurrency, "specs": [_spec_json(s) for s in specs]}))
        proc = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-m", "pdserve.bench.experiments.client",
                               str(src), str(dst)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"client in namespace {netns} failed: {proc.stderr[-2000:]}")
        doc = json.loads(dst.read_text())
    return [RequestResult(**r) for r in doc["results"]], doc["wall"]


def _spec_json(s: RequestSpec) -> dict:
    d = asdict(s)
    d["prompt_ids"] = list(s.prompt_ids) if s.prompt_ids is not None else None
    return d


def main(argv: list[str]) -> int:
    src, dst = Path(argv[0]), Path(argv[1])
    doc = json.loads(src.read_text())
    specs = [RequestSpec(d["prompt_tokens"], d["output_tokens"], d["prompt"],
                         tuple(d["prompt_ids"]) if d["prompt_ids"] is not None else None) for d in doc["specs"]]
    results, wall = send(doc["url"], specs, doc["arrivals"], doc["concurrency"], timeout=doc["timeout"],
                         model=doc["model"])
    dst.write_text(json.dumps({"wall": wall, "results": [r.to_json() for r in results]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
