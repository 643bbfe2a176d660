"""The load: the conversation trace's prompts (real lengths, token ids from their hash ids), open loop.

``trace_bodies`` builds each request's JSON body from per-hash-id fragments (512 token ids each, as
``bench/trace_replay.py`` maps a hash id to tokens), so thousands of 12k-token bodies cost little here.
``send_all`` posts them at their arrival times, round robin over ``urls`` (one router, every prefill
directly, or the two interleaved: ``serving.urls_of``), each with its index as ``X-Request-Id`` (the router
keeps it with its own time of the request: ``router/residence.py``), and records per request: status, time
to its first SSE event (TTFT) and to its end.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from pdserve.bench.trace_replay import TRACE_BLOCK_TOKENS, read_trace

POOL = range(1000, 33000)  # token ids the prompts are drawn from


@dataclass(slots=True)
class Result:
    start: float
    status: int = 0
    ttft: float | None = None
    end: float | None = None
    error: str = ""


def trace_bodies(path: Path, n: int, max_tokens: int, stream: bool = True, seed: int = 0) -> tuple[list[bytes], float]:
    """The first ``n`` requests of the trace as bodies (``max_tokens`` each) and the trace's mean rate (req/s)."""
    reqs = read_trace(path, "mooncake")
    rate = len(reqs) / max(1e-9, reqs[-1].time_s - reqs[0].time_s)
    frags: dict[int, list[str]] = {}
    bodies = []
    tail = json.dumps({"max_tokens": max_tokens, "stream": stream, "temperature": 0})[1:]
    for i in range(n):
        r = reqs[i % len(reqs)]
        parts: list[str] = []
        left = r.input_length
        for h in r.hash_ids:
            if left <= 0:
                break
            if h not in frags:
                rng = random.Random(f"{seed}:{h}")
                frags[h] = [str(POOL[rng.randrange(len(POOL))]) for _ in range(TRACE_BLOCK_TOKENS)]
            take = frags[h][:left]
            parts.append(",".join(take))
            left -= len(take)
        if left > 0:
            rng = random.Random(f"{seed}:request:{i}")
            parts.append(",".join(str(POOL[rng.randrange(len(POOL))]) for _ in range(left)))
        bodies.append(('{"prompt":[' + ",".join(parts) + "]," + tail).encode())
    return bodies, rate


async def _one(session: aiohttp.ClientSession, url: str, body: bytes, res: Result, request_id: str) -> None:
    try:
        async with session.post(url + "/v1/completions", data=body,
                                headers={"Content-Type": "application/json", "X-Request-Id": request_id}) as resp:
            res.status = resp.status
            async for chunk in resp.content.iter_any():
                if res.ttft is None and chunk:
                    res.ttft = time.perf_counter() - res.start
            res.end = time.perf_counter() - res.start
            if resp.status != 200:
                res.error = f"status {resp.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        res.error = type(exc).__name__


async def send_all(urls: list[str], bodies: list[bytes], arrivals: list[float],
                   timeout_s: float = 60.0) -> list[Result]:
    """Every body at its arrival offset (seconds from now), round robin over ``urls``."""
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    results: list[Result] = []
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        t0 = time.perf_counter()
        tasks = []
        for i, (body, at) in enumerate(zip(bodies, arrivals)):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            res = Result(time.perf_counter())
            results.append(res)
            tasks.append(asyncio.create_task(_one(session, urls[i % len(urls)], body, res, str(i))))
        await asyncio.gather(*tasks)
    return results


def poisson(n: int, rate: float, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def pct(xs: list[float], p: float) -> float | None:
    """The ``p``-th percentile of the sorted ``xs`` (the value at rank ``int(p/100 * n)``); None if empty."""
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else None


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def summary(results: list[Result], wall_s: float) -> dict:
    ok = [r for r in results if r.status == 200 and not r.error and r.ttft is not None]
    ttft = sorted(r.ttft for r in ok)

    return {"sent": len(results), "ok": len(ok), "errors": len(results) - len(ok),
            "error_kinds": sorted({r.error for r in results if r.error}),
            "completed_per_s": len(ok) / wall_s if wall_s > 0 else None,
            "ttft_p50_ms": ms(pct(ttft, 50)), "ttft_p90_ms": ms(pct(ttft, 90)),
            "ttft_p99_ms": ms(pct(ttft, 99)), "ttft_max_ms": ttft[-1] * 1e3 if ttft else None,
            "ttft_mean_ms": sum(ttft) / len(ttft) * 1e3 if ttft else None}
