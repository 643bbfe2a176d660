"""Layer-wise KV transfer between two processes vs raw socket and raw NIXL throughput.

Moves a synthetic KV set (default: 32 layers x 4096 tokens x 8 KV heads x 128 dims x
2 bytes x K,V = 512 MiB, blocks of 64 tokens) from this process to a receiver process on
loopback, and prints side by side, measured in the same run:

  raw socket   one sendall of the whole pool, recv_into the peer's pool (baseline for tcp)
  ours tcp     CacheStoreSender -> CacheStoreReceiver, layer by layer (store() per layer)
  raw NIXL     one NIXL WRITE of the whole pool with a notification (baseline for nixl)
  ours nixl    the CacheStore over NIXL, layer by layer
  raw NIXL, chunked   WRITEs of --chunk-mib with a notification each, no CacheStore code
                      (a reference: how much of the nixl gap is NIXL's per-WRITE cost)

With ``--checksum both`` (the default) "ours" runs twice per repeat, checksums on then off
(CRC32C per slice, ``cachestore/checksum.py``), so the two alternate A B A B under the same load, and
the checksum's cost is printed as the median over repeats of on / off (paired within a repeat).

Throughput is the pool size over the time from the first byte offered to the sender to the
delivery confirmation (tcp: the receiver's ACK/reply; NIXL: WRITE reported DONE). Each
figure is the median of --repeats runs; the ratio is the median, over runs, of ours divided by
the baseline run just before it (so both saw the same machine load). Extra peak memory is each process's peak RSS
increase during the transfer (after start-up: pools allocated and touched, agents and
receivers created), as a fraction of the KV bytes moved.
Targets (issue 16): tcp >= 90% of raw socket, nixl >= 95% of one raw NIXL WRITE, extra peak memory <= 10%.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import socket
import statistics
import subprocess
import sys
import time

from pdserve.cachestore.memory import DTYPE_BYTES, CompatInfo, KVLayout, MemoryRegion

from ..provenance import write_json
from .peak_rss import PeakRSS

DTYPE_BY_BYTES = {2: "float16", 4: "float32", 1: "uint8"}
BENCH_TRANSPORTS = ("tcp", "nixl", "samenode")  # samenode: no raw baseline; compared with ours tcp / nixl per request


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=32, help="layers (default 32)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of KV moved (default 4096)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    parser.add_argument("--head-dim", type=int, default=128, help="head size (default 128)")
    parser.add_argument("--dtype-bytes", type=int, choices=sorted(DTYPE_BY_BYTES), default=2,
                        help="bytes per element (default 2)")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per KV block (default 64)")
    parser.add_argument("--chunk-mib", type=float, default=4.0, help="sender chunk size in MiB (default 4)")
    parser.add_argument("--transports", default="tcp,nixl",
                        help="comma-separated: tcp,nixl,samenode (default tcp,nixl; samenode: the receiver's pool "
                             "mapped here, cachestore/samenode.py)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per figure; the median is reported (default 5)")
    parser.add_argument("--quick", action="store_true", help="small set: 8 layers x 1024 tokens (32 MiB), 2 repeats")
    parser.add_argument("--mixed", action="store_true",
                        help="also compare schedulers: short requests stored right behind a "
                             "long one (fifo vs priority)")
    parser.add_argument("--checksum", choices=["on", "off", "both"], default="both",
                        help="KV checksums (CRC32C per slice) in 'ours': on, off, or both alternating in one run "
                             "to compare (default both)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.layers, args.tokens, args.repeats = 8, 1024, 2
    if args.tokens % args.block_size:
        raise SystemExit(f"--tokens ({args.tokens}) must be a multiple of --block-size ({args.block_size})")
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    for t in transports:
        if t not in BENCH_TRANSPORTS:
            raise SystemExit(f"unknown transport {t!r} in --transports ({', '.join(BENCH_TRANSPORTS)})")
    if args.repeats <= 0:
        raise SystemExit("--repeats must be positive")
    compat = CompatInfo(DTYPE_BY_BYTES[args.dtype_bytes], args.layers, args.kv_heads, args.head_dim, args.block_size)
    layout = KVLayout(args.layers, args.tokens // args.block_size, compat.block_nbytes)
    results = asyncio.run(_bench(args, compat, layout, transports))
    _print(args, compat, layout, results)
    if args.json:
        write_json(args.json, results)
    return 0


async def _bench(args, compat: CompatInfo, layout: KVLayout, transports: list[str]) -> dict:
    import torch
    from tqdm import tqdm

    torch.set_num_threads(1)
    pool = torch.empty(layout.nbytes, dtype=torch.uint8)
    pool.random_(0, 256, generator=torch.Generator().manual_seed(0))
    region = MemoryRegion.from_tensor(pool)
    server = await asyncio.start_server(lambda r, w: conn.set_result((r, w)), "127.0.0.1", 0)
    conn: asyncio.Future = asyncio.get_running_loop().create_future()
    geometry = {"compat": {"dtype": compat.dtype, "num_layers": compat.num_layers, "num_kv_heads": compat.num_kv_heads,
                           "head_dim": compat.head_dim, "block_size": compat.block_size},
                "layout": {"num_layers": layout.num_layers, "num_blocks": layout.num_blocks,
                           "block_nbytes": layout.block_nbytes}}
    child = subprocess.Popen([sys.executable, "-m", "pdserve.bench.cachestore.receiver_process",
                              json.dumps(geometry), str(server.sockets[0].getsockname()[1])])
    try:
        async with asyncio.timeout(120):
            reader, writer = await conn

        async def ask(doc: dict) -> dict:
            writer.write((json.dumps(doc) + "\n").encode())
            await writer.drain()
            async with asyncio.timeout(600):
                line = await reader.readline()
            if not line:
                raise RuntimeError(f"benchmark receiver process exited ({child.poll()})")
            return json.loads(line)

        kinds = []
        modes = ["on", "off"] if args.checksum == "both" else [args.checksum]
        for t in transports:
            kinds += ([f"raw_{t}"] if t != "samenode" else []) + [f"ours_{t}:{m}" for m in modes]
            kinds += ["rawchunks_nixl"] if t == "nixl" else []
        runs: dict[str, list[dict]] = {k: [] for k in kinds}
        senders: dict[str, object] = {}
        raw_nixl = None
        peak = PeakRSS()
        # repeat -1 warms up (connections, agents, first-touch) and is not recorded;
        # the rest interleave baseline and ours so both see the same machine load
        steps = [(r, k) for r in range(-1, args.repeats) for k in kinds]
        for repeat, kind in tqdm(steps, desc="cachestore bench", unit="run", file=sys.stderr):
            if kind == "raw_tcp":
                port = (await ask({"cmd": "raw_tcp"}))["port"]
                peak.start()
                secs = await asyncio.to_thread(_raw_tcp_send, region, layout.nbytes, port)
                tx_rss = peak.stop()
                rx_doc = await _read(reader)
            elif kind in ("raw_nixl", "rawchunks_nixl"):
                from pdserve.cachestore.nixl_backend import NixlMemory

                if raw_nixl is None:
                    raw_nixl = NixlMemory("bench-raw-tx", region)
                chunk = layout.nbytes if kind == "raw_nixl" else min(layout.nbytes, int(args.chunk_mib * (1 << 20)))
                info = await ask({"cmd": "raw_nixl", "notifs": -(-layout.nbytes // chunk)})
                peak.start()
                secs = await asyncio.to_thread(_raw_nixl_write, raw_nixl, region, layout.nbytes, info, chunk)
                tx_rss = peak.stop()
                rx_doc = await _read(reader)
            else:
                transport, mode = kind.split("_", 1)[1].split(":")
                if kind not in senders:
                    from pdserve.cachestore.sender import CacheStoreSender

                    senders[kind] = CacheStoreSender(region, layout, compat,
                                                     transport="tcp" if transport == "samenode" else transport,
                                                     chunk_bytes=int(args.chunk_mib * (1 << 20)), checksum=mode == "on",
                                                     same_node="on" if transport == "samenode" else "off")
                    await senders[kind].start()
                tx = senders[kind]
                rid = f"{kind}-{repeat}"
                info = await ask({"cmd": "ours", "transport": transport, "rid": rid})
                peak.start()
                t0 = time.perf_counter()
                tx.bind(rid, base64.b64decode(info["endpoint"]), info["dst"], bytes.fromhex(info["token"]))
                blocks = list(range(layout.num_blocks))
                for layer in range(layout.num_layers):
                    tx.store(rid, layer, blocks)
                await tx.wait_sent(rid, 600)
                secs = time.perf_counter() - t0
                tx_rss = peak.stop()
                tx.delete(rid)
                rx_doc = await _read(reader)
            if repeat < 0:
                continue
            runs[kind].append({"seconds": secs, "gib_s": layout.nbytes / secs / (1 << 30),
                               "sender_rss": tx_rss, "receiver_rss": rx_doc["rss"],
                               "cpu_s_per_gib": (peak.cpu_s + rx_doc["cpu"]) / (layout.nbytes / (1 << 30)),
                               "sender_cpu_s": peak.cpu_s, "receiver_cpu_s": rx_doc["cpu"]})
        for tx in senders.values():
            await tx.stop()
        mixed = {}
        if args.mixed:
            from .scheduler_mix import run_mixed

            for transport in transports:
                for sched in ("fifo", "priority"):
                    mixed[f"{transport}_{sched}"] = await run_mixed(
                        ask, lambda: _read(reader), region, layout, compat, transport, sched,
                        int(args.chunk_mib * (1 << 20)), f"mixed-{transport}-{sched}")
        await ask_quit(writer)
        if raw_nixl is not None:
            raw_nixl.close()
    finally:
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
        server.close()
    summary = {k: {"gib_s": statistics.median(r["gib_s"] for r in v),
                   "sender_rss": max(r["sender_rss"] for r in v),
                   "receiver_rss": max(r["receiver_rss"] for r in v),
                   "cpu_s_per_gib": statistics.median(r["cpu_s_per_gib"] for r in v),
                   "sender_cpu_s": statistics.median(r["sender_cpu_s"] for r in v),
                   "receiver_cpu_s": statistics.median(r["receiver_cpu_s"] for r in v),
                   "runs_gib_s": [round(r["gib_s"], 3) for r in v]} for k, v in runs.items()}
    for kind in summary:  # each run against the baseline run just before it (same machine load)
        if kind.startswith("raw_") or "raw_" + kind.split("_", 1)[1].split(":")[0] not in runs:
            continue
        pairs = [o["gib_s"] / r["gib_s"]
                 for o, r in zip(runs[kind], runs["raw_" + kind.split("_", 1)[1].split(":")[0]])]
        summary[kind]["paired_ratios"] = [round(x, 3) for x in pairs]
        summary[kind]["ratio_vs_raw"] = statistics.median(pairs)
    checksum_cost = {}
    for t in transports:  # checksums on / off, the two runs of one repeat (same machine load)
        on, off = runs.get(f"ours_{t}:on"), runs.get(f"ours_{t}:off")
        if on and off:
            pairs = [a["gib_s"] / b["gib_s"] for a, b in zip(on, off)]
            checksum_cost[t] = {"paired_ratios": [round(x, 3) for x in pairs], "ratio_on_off": statistics.median(pairs),
                                "cpu_s_per_gib_on": summary[f"ours_{t}:on"]["cpu_s_per_gib"],
                                "cpu_s_per_gib_off": summary[f"ours_{t}:off"]["cpu_s_per_gib"]}
    return {"kv_bytes": layout.nbytes, "repeats": args.repeats, "results": summary, "mixed": mixed,
            "checksum": args.checksum, "checksum_cost": checksum_cost, "per_request": _per_request(runs, modes)}


def _per_request(runs: dict[str, list[dict]], modes: list[str]) -> dict:
    """Per checksum mode: each transport's time for the request (median ms) and samenode / tcp, samenode / nixl
    paired within a repeat (the runs of one repeat follow each other: the same machine load)."""
    out: dict = {}
    for mode in modes:
        ms = {t: statistics.median(r["seconds"] * 1e3 for r in runs[f"ours_{t}:{mode}"])
              for t in BENCH_TRANSPORTS if f"ours_{t}:{mode}" in runs}
        doc: dict = {"ms": ms}
        same = runs.get(f"ours_samenode:{mode}")
        for other in ("tcp", "nixl"):
            base = runs.get(f"ours_{other}:{mode}")
            if same and base:
                pairs = [a["seconds"] / b["seconds"] for a, b in zip(same, base)]
                doc[f"samenode_vs_{other}"] = {"paired_ratios": [round(x, 3) for x in pairs],
                                               "ratio": statistics.median(pairs)}
        out[mode] = doc
    return out


async def _read(reader: asyncio.StreamReader) -> dict:
    async with asyncio.timeout(600):
        line = await reader.readline()
    if not line:
        raise RuntimeError("benchmark receiver process exited")
    return json.loads(line)


async def ask_quit(writer: asyncio.StreamWriter) -> None:
    writer.write(b'{"cmd": "quit"}\n')
    await writer.drain()


def _raw_tcp_send(region: MemoryRegion, nbytes: int, port: int) -> float:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = region.host_view()
    t0 = time.perf_counter()
    sock.sendall(view[:nbytes])
    if sock.recv(1) != b"k":
        raise RuntimeError("raw tcp receiver did not confirm")
    secs = time.perf_counter() - t0
    sock.close()
    return secs


def _raw_nixl_write(nixl, region: MemoryRegion, nbytes: int, info: dict, chunk: int) -> float:
    """WRITEs of `chunk` bytes (each with a notification, at most 4 in flight), busy-polled."""
    agent = nixl.agent
    remote = agent.add_remote_agent(base64.b64decode(info["md"]))
    t0 = time.perf_counter()
    inflight: list = []
    off, state = 0, "DONE"
    while off < nbytes or inflight:
        while off < nbytes and len(inflight) < 4:
            n = min(chunk, nbytes - off)
            handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs([(region.ptr + off, n, 0)], "DRAM"),
                                           agent.get_xfer_descs([(info["addr"] + off, n, 0)], "DRAM"), remote, b"raw")
            agent.transfer(handle)
            inflight.append(handle)
            off += n
        state = agent.check_xfer_state(inflight[0])
        if state == "DONE":
            inflight.pop(0).release()
        elif state != "PROC":
            break
    secs = time.perf_counter() - t0
    agent.remove_remote_agent(remote)
    if state != "DONE":
        raise RuntimeError(f"raw NIXL WRITE ended in state {state}")
    return secs


def _print(args, compat: CompatInfo, layout: KVLayout, results: dict) -> None:
    mib = layout.nbytes / (1 << 20)
    res = results["results"]
    print(f"\nCacheStore benchmark: {layout.num_layers} layers x {args.tokens} tokens x "
          f"{compat.num_kv_heads} KV heads x {compat.head_dim} dims x {DTYPE_BYTES[compat.dtype]} bytes x K,V = "
          f"{mib:.1f} MiB; blocks of {compat.block_size} tokens ({layout.block_nbytes // 1024} KiB); chunks "
          f"of {args.chunk_mib:g} MiB; median of {results['repeats']} runs")
    print(f"{'':26}{'GiB/s':>8}  {'ratio':>18}  {'sender +peak':>16}  {'receiver +peak':>16}  {'CPU s/GiB':>9}")
    targets = {"tcp": 0.90, "nixl": 0.95}  # issue 16
    for t in ("tcp", "nixl"):
        if f"raw_{t}" not in res:
            continue
        raw = res[f"raw_{t}"]
        label = "raw socket (one send)" if t == "tcp" else "raw NIXL WRITE"
        rows = [(label, raw, "baseline")]
        for kind in (k for k in res if k.startswith(f"ours_{t}:")):
            ours, mode = res[kind], kind.split(":")[1]
            rows.append((f"ours {t} (crc {mode})", ours, f"{ours['ratio_vs_raw']:6.1%} (target {targets[t]:.0%})"))
        for name, r, rtext in rows:
            print(f"{name:26}{r['gib_s']:8.2f}  {rtext:>18}  {_mem(r['sender_rss'], layout):>16}  "
                  f"{_mem(r['receiver_rss'], layout):>16}  {r['cpu_s_per_gib']:9.2f}")
            if r is not raw:
                print(f"{'':26}{'':8}  paired ratios {', '.join(f'{x:.0%}' for x in r['paired_ratios'])}")
        cost = results.get("checksum_cost", {}).get(t)
        if cost:
            print(f"{'checksum on / off':26}{'':8}  {cost['ratio_on_off']:6.1%} of the throughput (paired: "
                  f"{', '.join(f'{x:.0%}' for x in cost['paired_ratios'])}); CPU s/GiB "
                  f"{cost['cpu_s_per_gib_on']:.2f} vs {cost['cpu_s_per_gib_off']:.2f}")
        if t == "nixl" and "rawchunks_nixl" in res:
            rc = res["rawchunks_nixl"]
            print(f"{f'raw NIXL, {args.chunk_mib:g} MiB WRITEs':26}{rc['gib_s']:8.2f}  "
                  f"{rc['ratio_vs_raw']:6.1%} (reference)  {_mem(rc['sender_rss'], layout):>16}  "
                  f"{_mem(rc['receiver_rss'], layout):>16}  {rc['cpu_s_per_gib']:9.2f}")
            print(f"{'':26}{'':8}  (the same chunking with no CacheStore code, vs one WRITE: "
                  f"{', '.join(f'{x:.0%}' for x in rc['paired_ratios'])})")
    if "ours_samenode:" + (["on", "off"] if args.checksum == "both" else [args.checksum])[0] in res:
        print(f"{'ours samenode':26}(a tcp control channel; each layer copied into the receiver's mapped pool)")
        for kind in (k for k in res if k.startswith("ours_samenode:")):
            r = res[kind]
            print(f"{'ours samenode (crc ' + kind.split(':')[1] + ')':26}{r['gib_s']:8.2f}  {'':>18}  "
                  f"{_mem(r['sender_rss'], layout):>16}  {_mem(r['receiver_rss'], layout):>16}  "
                  f"{r['cpu_s_per_gib']:9.2f}")
    for mode, doc in results.get("per_request", {}).items():
        times = ", ".join(f"{t} {v:.1f} ms" for t, v in doc["ms"].items())
        print(f"\nKV transfer time of the request ({mib:.0f} MiB), crc {mode}: {times} (median)")
        for other in ("tcp", "nixl"):
            r = doc.get(f"samenode_vs_{other}")
            if r:
                print(f"  samenode / {other}: {r['ratio']:.3f} of the time (paired: "
                      f"{', '.join(f'{x:.3f}' for x in r['paired_ratios'])})")
    print("GiB/s: median of runs; ratio: median over runs of ours / the baseline run just before it")
    print("peak = peak RSS increase during the transfer, MiB (% of KV bytes); target <= 10%")
    print("CPU s/GiB = CPU time of both processes (all threads) per GiB moved, median; load-independent")
    if results["mixed"]:
        print(f"\nscheduler comparison: 4 short requests (1 block x {layout.num_layers} layers) stored right behind "
              f"a long one ({layout.num_blocks - 4} blocks x {layout.num_layers} layers), one link")
        print(f"{'':18}{'short median s':>15}{'short max s':>13}{'long s':>9}")
        for name, m in results["mixed"].items():
            print(f"{name:18}{m['short_median_s']:15.3f}{m['short_max_s']:13.3f}{m['long_s']:9.3f}")


def _mem(nbytes: int, layout: KVLayout) -> str:
    return f"{nbytes / (1 << 20):.1f} ({nbytes / layout.nbytes:.1%})"
