"""Streaming load for the chaos bench: a pool of prompts, their reference texts, and workers.

1. ``prompt_pool``: n prompts of mixed lengths (log-normal prompt and output lengths, from
   bench/loadgen_workload), each with a fixed ``max_tokens`` and ``ignore_eos``.
2. ``reference_texts``: every prompt sent once, greedy, before any fault: the text a
   greedy request for that prompt must reproduce under chaos.
3. ``run_load``: ``concurrency`` workers, each sending one request after another until the
   end time; a fraction of them sampled (temperature 0.8, not checked), the rest greedy and
   checked. ``stream_one`` fills a RequestRecord with the time of every chunk of bytes and
   gives up after ``hang_s`` + 1 s without a byte (so a hang is recorded, never waited on).
"""

from __future__ import annotations

import asyncio
import json
import random
import time

from pdserve.bench.loadgen import LoadConfig
from pdserve.bench.loadgen_workload import LengthDistribution, RequestSpec, make_prompt

from .outcome import UNCLEAR_PREFIX, RequestRecord

SAMPLED_TEMPERATURE = 0.8


def prompt_pool(n: int, seed: int, prompt_words: int = 24, output_tokens: int = 48) -> list[RequestSpec]:
    """n prompts; words and output tokens log-normal around the medians (the tiny model's context is 2048 bytes)."""
    rng = random.Random(seed)
    words = LengthDistribution(prompt_words, 1.0, 1, 8 * prompt_words)
    outs = LengthDistribution(output_tokens, 0.8, 1, 6 * output_tokens)
    pool = []
    for i in range(n):
        w, o = words.sample(rng), outs.sample(rng)
        pool.append(RequestSpec(prompt_tokens=w, output_tokens=o, prompt=make_prompt(w, rng, tag=i)))
    return pool


async def stream_one(session, config: LoadConfig, spec: RequestSpec, rec: RequestRecord, hang_s: float,
                     t0: float) -> None:
    """Send one streaming completion; fill rec (never raises for what the server or network does)."""
    import aiohttp

    rec.start = time.perf_counter() - t0
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=hang_s + 1, sock_read=hang_s + 1)
    buf, saw_finish, saw_done = b"", False, False
    try:
        async with session.post(config.endpoint, json=config.payload(spec), timeout=timeout) as resp:
            if resp.status != 200:
                rec.byte_times.append(time.perf_counter() - t0)
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            async for chunk in resp.content.iter_any():
                rec.byte_times.append(time.perf_counter() - t0)
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for raw in lines:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        saw_done = True
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        err = event["error"]
                        rec.error = "error event: " + (err.get("message", str(err)) if isinstance(err, dict)
                                                       else str(err))
                        continue
                    for choice in event.get("choices") or []:
                        rec.text += choice.get("text") or ""
                        saw_finish = saw_finish or choice.get("finish_reason") is not None
        rec.finished = saw_finish and saw_done and not rec.error
        if not rec.finished and not rec.error:
            rec.error = f"{UNCLEAR_PREFIX} stream ended without [DONE] or an error event"
    except asyncio.TimeoutError:
        rec.error = f"no byte for {hang_s + 1:.0f}s"
    except Exception as e:  # noqa: BLE001 - aiohttp's connection errors: the server went away
        rec.error = f"connection: {type(e).__name__}: {e}"
    finally:
        rec.end = time.perf_counter() - t0


async def reference_texts(url: str, model: str, pool: list[RequestSpec], hang_s: float) -> dict[int, str]:
    """Greedy text of every prompt, sent before any fault; raises if one does not complete."""
    import aiohttp

    config = LoadConfig(url=url, model=model, temperature=0.0, ignore_eos=True, progress=False)
    t0 = time.perf_counter()
    recs = [RequestRecord(i, i, True, len(s.prompt), s.output_tokens) for i, s in enumerate(pool)]
    sem = asyncio.Semaphore(4)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i: int) -> None:
            async with sem:
                await stream_one(session, config, pool[i], recs[i], hang_s, t0)
        await asyncio.gather(*(one(i) for i in range(len(pool))))
    bad = [r for r in recs if not r.finished]
    if bad:
        raise RuntimeError(f"reference pass (no faults yet): {len(bad)} of {len(recs)} requests failed; "
                           f"first: {bad[0].error}")
    return {r.prompt_key: r.text for r in recs}


async def run_load(url: str, model: str, pool: list[RequestSpec], concurrency: int, until: float, hang_s: float,
                   sampled_fraction: float, rng: random.Random, t0: float,
                   on_done=lambda rec: None) -> list[RequestRecord]:
    """Workers send requests until `until` (seconds since t0); returns every record, ended."""
    import aiohttp

    greedy = LoadConfig(url=url, model=model, temperature=0.0, ignore_eos=True, progress=False)
    sampled = LoadConfig(url=url, model=model, temperature=SAMPLED_TEMPERATURE, ignore_eos=True, progress=False)
    records: list[RequestRecord] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        async def worker() -> None:
            while time.perf_counter() - t0 < until:
                key = rng.randrange(len(pool))
                checked = rng.random() >= sampled_fraction
                rec = RequestRecord(len(records), key, checked, len(pool[key].prompt), pool[key].output_tokens)
                records.append(rec)
                await stream_one(session, greedy if checked else sampled, pool[key], rec, hang_s, t0)
                on_done(rec)
                if not rec.finished:
                    await asyncio.sleep(0.5)  # the server may be restarting: do not spin on refused connections
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records
