"""The command: start a supervised local cluster, load it, inject faults, judge, report.

1. **start** ``pdserve up --prefill P --decode D --transfer T`` (its supervisor restarts
   killed servers on the same ports) and wait until every server is ready. With --netem
   this process already runs inside its own network namespace (netem.py) and reads the
   decodes' gRPC and KV ports for the netem fault.
2. **reference**: every prompt of the pool once, greedy, while nothing is faulty.
3. **chaos** for --duration seconds: streaming load (load.py) and the fault loop
   (faults.py) side by side; a progress bar shows time and outcomes so far.
4. **settle**: the load stops (requests in flight end or hit the hang deadline), paused
   servers are resumed, killed ones must be back; then every server's /metrics and
   /health are read until nothing is held or --leak-timeout passes (leaks.py).
5. **report**: a table, <out>/<name>.json (config, summary, every request, every fault,
   the final readings, the supervisor's restart lines) and <out>/<name>.png (timeline).
   ``pdserve up`` is stopped (drained) in every case.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pdserve.net import free_port

from ..provenance import write_json
from .faults import KINDS, FaultLoop, read_servers
from .leaks import held_from_health, held_from_metrics, leaks
from .load import prompt_pool, reference_texts, run_load
from .outcome import classify, counts
from .report import format_table, plot, summarize, verdict


class Cluster:
    """A `pdserve up` child process and its servers.json; ``close()`` drains and stops it."""

    def __init__(self, args, out: Path):
        self.log_dir = out / f"{args.name}-up-logs"
        self.port, grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pdserve", "up", "--model", args.model, "--prefill", str(args.prefill),
               "--decode", str(args.decode), "--transfer", args.transfer, "--port", str(self.port),
               "--grpc-port", str(grpc_port), "--log-dir", str(self.log_dir), "--threads", str(args.threads),
               "--num-blocks", str(args.num_blocks), "--extra", f"--session-timeout {args.session_timeout}"]
        self.log = out / f"{args.name}-up.log"
        # a servers.json left by an earlier run of the same --name says "ready" for servers that are gone:
        # the reference pass then ran before this cluster listened (every request refused)
        self.state_file.unlink(missing_ok=True)
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def state_file(self) -> Path:
        return self.log_dir / "servers.json"

    def wait_all_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdserve up exited with {self.proc.returncode}; its output "
                                   f"({self.log}) ends with:\n"
                                   + self.log.read_text(errors="replace")[-2000:])
            servers = read_servers(self.state_file)
            if servers and all(s["state"] == "ready" for s in servers.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"servers not all ready after {timeout:.0f}s: "
                                   f"{ {n: s['state'] for n, s in servers.items()} }; logs in {self.log_dir}")
            time.sleep(0.5)

    def readings(self) -> dict[str, dict[str, float]]:
        out = {}
        for name, s in read_servers(self.state_file).items():
            base = s["ready_url"].rsplit("/", 1)[0]
            try:
                with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
                    held = held_from_metrics(r.read().decode())
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    held.update(held_from_health(json.loads(r.read())))
            except OSError as e:
                held = {f"unreachable: {e}": 1.0}
            out[name] = held
        return out

    def restart_lines(self) -> list[str]:
        return [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.startswith("[supervisor]")]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


def make_shaper(args, cluster: Cluster):
    """With --netem (we are inside the namespace): the Shaper of the decodes' gRPC and KV ports."""
    if not args.netem:
        return None
    from .netem import Shaper, decode_ports, parse_spec, proc_argv

    ports = decode_ports(read_servers(cluster.state_file), proc_argv)
    shaper = Shaper(args.netns, ports, parse_spec(args.netem_spec))
    print(f"netem faults: {shaper.describe()}", flush=True)
    return shaper


async def chaos_phase(args, cluster: Cluster, pool, t0: float, shaper=None):
    from tqdm import tqdm

    faults = FaultLoop(cluster.state_file, random.Random(args.seed + 1), args.fault_interval,
                       (args.pause_min, args.pause_max), tuple(args.faults.split(",")), t0, say=tqdm.write,
                       shaper=shaper, netem_s=(args.netem_min, args.netem_max))
    done: list = []
    bar = tqdm(total=int(args.duration), desc="chaos", unit="s", disable=not args.progress)

    def on_done(rec) -> None:
        done.append(rec)

    async def ticker() -> None:
        while time.perf_counter() - t0 < args.duration:
            await asyncio.sleep(1.0)
            bar.n = min(int(args.duration), int(time.perf_counter() - t0))
            bar.set_postfix(requests=len(done), ok=sum(r.finished for r in done), faults=len(faults.faults))
    try:
        records, _, _ = await asyncio.gather(
            run_load(cluster.url, args.model, pool, args.concurrency, args.duration, args.hang_s, args.sampled_fraction,
                     random.Random(args.seed + 2), t0, on_done),
            faults.run(args.duration), ticker())
    finally:
        faults.restore()
        bar.close()
    return records, faults


def settle(args, cluster: Cluster) -> tuple[dict, dict]:
    """Final readings of every server once all are back, polled until nothing is held or the timeout."""
    cluster.wait_all_ready(args.leak_timeout + 120)
    deadline = time.monotonic() + args.leak_timeout
    while True:
        readings = cluster.readings()
        leaked = leaks(readings)
        if not leaked or time.monotonic() > deadline:
            return readings, leaked
        time.sleep(1.0)


def run_chaos(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(args, out)
    shaper = None
    try:
        print(f"starting pdserve up (--prefill {args.prefill} --decode {args.decode} --transfer {args.transfer}); "
              f"logs in {cluster.log_dir}", flush=True)
        cluster.wait_all_ready(args.ready_timeout)
        shaper = make_shaper(args, cluster)
        pool = prompt_pool(args.pool, args.seed)
        reference = asyncio.run(reference_texts(cluster.url, args.model, pool, args.hang_s))
        print(f"reference texts of {len(pool)} prompts computed before any fault; chaos for {args.duration:.0f}s",
              flush=True)
        t0 = time.perf_counter()
        records, faults = asyncio.run(chaos_phase(args, cluster, pool, t0, shaper))
        horizon = time.perf_counter() - t0
        for r in records:
            r.outcome = classify(r, args.hang_s, reference[r.prompt_key] if r.checked else None)
        print(f"load done: {counts(records)}; waiting for servers to settle (up to {args.leak_timeout:.0f}s)",
              flush=True)
        readings, leaked = settle(args, cluster)
    finally:
        if shaper is not None:
            shaper.clear()
        cluster.close()
    summary = summarize(records, faults.faults, leaked, horizon)
    doc = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "summary": summary, "requests": [r.to_json() for r in records],
           "faults": [f.to_json() for f in faults.faults], "final_readings": readings, "leaks": leaked,
           "restarts": cluster.restart_lines(), "up_log": str(cluster.log), "server_logs": str(cluster.log_dir),
           "netem": shaper.describe() if shaper is not None else None}
    json_path = write_json(out / f"{args.name}.json", doc)
    png = plot(records, faults.faults, out / f"{args.name}.png",
               title=f"pdserve bench chaos: --transfer {args.transfer}, {args.prefill} prefill + {args.decode} decode, "
                     f"{args.duration:.0f}s")
    print(format_table(summary, args.transfer))
    if leaked:
        print(f"leaked: {leaked}")
    print(f"wrote {json_path} and {png}")
    ok, line = verdict(summary, args.prefill, bool(leaked))
    print(line)
    return 0 if ok else 1


def validate(args) -> None:
    for name in ("duration", "hang_s", "fault_interval", "leak_timeout", "session_timeout"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    for name in ("concurrency", "pool", "prefill"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1")
    if args.decode < 2:
        raise ValueError("--decode must be >= 2 (decode faults always leave one decode serving)")
    if not 0 <= args.sampled_fraction <= 1:
        raise ValueError("--sampled-fraction must be in [0, 1]")
    if not 0 < args.pause_min <= args.pause_max:
        raise ValueError("need 0 < --pause-min <= --pause-max")
    if args.netem and not 0 < args.netem_min <= args.netem_max:
        raise ValueError("need 0 < --netem-min <= --netem-max")
    if args.netem:
        from .netem import parse_spec

        parse_spec(args.netem_spec)
    if args.pause_max >= args.hang_s:
        raise ValueError("--pause-max must be below --hang-s (a pause would read as a hang)")
    bad = set(args.faults.split(",")) - set(KINDS)
    if bad:
        raise ValueError(f"--faults: unknown {sorted(bad)}; choose from {','.join(KINDS)}")
    if "netem" in args.faults.split(",") and not args.netem:
        raise ValueError("--faults netem needs --netem (the run inside a network namespace)")
