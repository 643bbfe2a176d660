"""Start and stop the pdserve processes of one experiment, and read their /metrics.

``Launcher`` starts ``pdserve prefill`` / ``decode`` / ``router`` (``spawn``: any other command,
such as the peer experiment's vLLM servers) as child processes in their own sessions,
optionally pinned to CPUs (``taskset``) and inside a network namespace (``ip netns exec``),
with logs in the experiment's output folder.
``close()`` (or leaving the ``with`` block) stops every process it started: SIGTERM, then
SIGKILL after a grace period, also when the experiment fails.

``bench_model(dir, size)`` writes a random-weight Llama checkpoint bigger than the built-in
``tiny`` one, so that prefill compute and KV sizes are large enough to measure; ``experiment_model(name)``
is an experiment's ``--model``: ``tiny``, a ``bench_model`` size, ``peer`` (the peer experiment's 122M
Llama, ``peer_model.py``) or a checkpoint directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families


# name -> (hidden, intermediate, layers, heads, kv heads, head dim). Byte-level vocabulary, no tokenizer file.
BENCH_MODELS = {
    "small": (256, 688, 8, 8, 4, 32),
    "medium": (512, 1376, 8, 8, 4, 64),
    # little compute per KV byte (8 KiB of KV per token and layer): for experiments about the wire
    "wire": (64, 128, 8, 16, 16, 64),
}
# Bench checkpoints are written once per machine, outside the repository.
MODEL_CACHE = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve")) / "bench-models"
# Server logs of this run (kept after the run; printed when a server fails).
LOG_ROOT = Path(tempfile.gettempdir()) / f"pdserve-experiment-logs-{os.getpid()}"
# Prompts are sent as token ids below this (plain bytes of the byte-level vocabulary, no BOS/EOS).
PROMPT_VOCAB = 256


def bench_model(directory: Path, size: str, max_len: int = 16384) -> str:
    """The model argument for the servers: 'tiny', or a random checkpoint of `size` written once."""
    if size == "tiny":
        return "tiny"
    if size not in BENCH_MODELS:
        raise ValueError(f"model size must be tiny or one of {sorted(BENCH_MODELS)}, got {size!r}")
    path = Path(directory) / f"bench-model-{size}"
    if (path / "config.json").exists():
        return str(path)
    from pdserve.engine.checkpoint import random_hf_weights, save_hf_checkpoint
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.loader import tiny_config

    hidden, inter, layers, heads, kv_heads, head_dim = BENCH_MODELS[size]
    tiny = tiny_config()
    cfg = ModelConfig(vocab_size=tiny.vocab_size, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, max_position_embeddings=max_len,
                      bos_token_id=tiny.bos_token_id, eos_token_ids=list(tiny.eos_token_ids))
    save_hf_checkpoint(random_hf_weights(cfg, seed=0), cfg, path)
    return str(path)


MODEL_HELP = (f"tiny | {' | '.join(BENCH_MODELS)} | peer (the peer experiment's 122M-parameter random Llama, "
              "written once under ~/.cache/pdserve/bench-models) | a checkpoint directory")


def experiment_model(name: str, max_len: int = 4096) -> str:
    """The servers' model for an experiment's ``--model`` (``MODEL_HELP``); a checkpoint is written once."""
    if name == "tiny" or name in BENCH_MODELS:
        return bench_model(MODEL_CACHE, name)
    if name == "peer":
        from .peer_model import peer_model

        return str(peer_model(MODEL_CACHE, "peer", max(4096, max_len)))  # the peer experiment's file for <= 4096
    if (Path(name) / "config.json").is_file():
        return name
    raise ValueError(f"--model {name!r}: neither tiny, {', '.join(BENCH_MODELS)}, peer nor a checkpoint directory "
                     "(no config.json there)")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path


class Launcher:
    """Processes of one experiment run. Use as a context manager."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []
        self.pdserve = str(Path(sys.executable).parent / "pdserve")

    def start(self, name: str, args: list[str], cpus: str | None = None, netns: str | None = None,
              threads: int | None = None) -> Proc:
        """Start `pdserve ARGS...`; cpus like '0' or '0,1' pins it; netns runs it in that namespace."""
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads is not None else None
        return self.spawn(name, [self.pdserve, *args], cpus=cpus, netns=netns, env=env)

    def spawn(self, name: str, cmd: list[str], cpus: str | None = None, netns: str | None = None,
              env: dict[str, str] | None = None, cwd: Path | None = None) -> Proc:
        """Start any command (pinned to cpus, in netns) with env added to ours; its log is <log_dir>/<name>.log."""
        if cpus is not None:
            if shutil.which("taskset") is None:
                raise RuntimeError("taskset (util-linux) is needed to pin processes to CPUs")
            cmd = ["taskset", "-c", cpus, *cmd]
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        full_env = {**os.environ, **(env or {})}
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
                                     cwd=cwd)
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def wait_ready(self, proc: Proc, url: str, timeout: float = 120.0, netns: str | None = None) -> None:
        """Wait until GET url answers 200 (url is reached from inside netns when given)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}; log {proc.log}:\n"
                                   + proc.log.read_text(errors="replace")[-3000:])
            if http_ok(url, netns):
                return
            time.sleep(0.3)
        raise TimeoutError(f"{proc.name} not ready at {url} within {timeout}s; log {proc.log}")

    def stop(self, proc: Proc, grace: float = 15.0) -> None:
        if proc.popen.poll() is None:
            try:
                os.killpg(proc.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                return
            try:
                proc.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.popen.wait(timeout=10)

    def close(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)
        self.procs.clear()

    def __enter__(self) -> "Launcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def http_ok(url: str, netns: str | None = None) -> bool:
    if netns is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False
    code = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c",
                           f"import urllib.request,sys; sys.exit(0 if urllib.request.urlopen({url!r}, "
                           f"timeout=2).status == 200 else 1)"],
                          capture_output=True).returncode
    return code == 0


def scrape(url: str, netns: str | None = None) -> dict[tuple[str, frozenset], float]:
    """Samples of a /metrics page: (name, frozenset(labels.items())) -> value."""
    if netns is None:
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    else:
        text = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c",
                               f"import urllib.request; print(urllib.request.urlopen({url!r}, "
                               f"timeout=10).read().decode())"],
                              capture_output=True, text=True, check=True).stdout
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def metric_sum(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)
