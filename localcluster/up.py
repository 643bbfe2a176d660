"""Start a local prefill + decode cluster and serve the OpenAI API (Ctrl-C stops it).

Starts --decode decode processes and --prefill prefill processes on 127.0.0.1 (each
prefill knows every decode through a static list), waits until all are ready (a progress
bar), prints the endpoint with a curl and an openai-client example, and keeps running.
Ctrl-C (or SIGTERM): the prefills drain their in-flight requests first, then the decodes
drain theirs, then everything stops. Logs go to --log-dir.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from pdserve import defaults
from pdserve.cachestore import TRANSPORTS
from pdserve.net import free_port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=defaults.BUILTIN_MODEL, help="'tiny' (built-in) or a model directory")
    parser.add_argument("--prefill", type=int, default=1, help="number of prefill processes")
    parser.add_argument("--decode", type=int, default=2, help="number of decode processes")
    parser.add_argument("--transfer", choices=TRANSPORTS, default="tcp", help="KV transport between them")
    parser.add_argument("--port", type=int, default=defaults.HTTP_PORT, help="HTTP port of the first prefill (next ones +1, ...)")
    parser.add_argument("--grpc-port", type=int, default=defaults.PREFILL_GRPC_PORT, help="gRPC port of the first prefill")
    parser.add_argument("--policy", choices=["wrr", "rr"], default="wrr", help="decode selection policy")
    parser.add_argument("--local-fallback", action="store_true", help="prefills decode locally when no decode can take a request")
    parser.add_argument("--num-blocks", type=int, default=256, help="KV blocks per process")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    parser.add_argument("--log-dir", default=None, help="where process logs go (default: a new temporary folder)")
    parser.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for all processes to be ready")
    parser.add_argument("--extra", default="", help="extra flags passed to every server process (one string)")


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200
    except Exception:  # noqa: BLE001 - not up yet
        return False


class LocalCluster:
    """The processes of one local cluster; ``stop()`` drains prefills, then decodes."""

    def __init__(self, args: argparse.Namespace):
        if args.prefill < 1 or args.decode < 0:
            raise SystemExit("pdserve up: need --prefill >= 1 and --decode >= 0")
        if args.decode == 0 and not args.local_fallback:
            raise SystemExit("pdserve up: --decode 0 needs --local-fallback (nothing could decode)")
        self.args = args
        self.log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.decodes: list[tuple[subprocess.Popen, str]] = []  # (process, ready url)
        self.prefills: list[tuple[subprocess.Popen, str]] = []
        self.endpoints: list[str] = []

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")
        cmd = [sys.executable, "-m", "pdserve", *argv]
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_terminate_with_parent)

    def start(self) -> None:
        a = self.args
        common = ["--model", a.model, "--transfer", a.transfer, "--num-blocks", str(a.num_blocks), "--threads", str(a.threads)]
        common += a.extra.split() if a.extra else []
        grpc_addrs = []
        for i in range(a.decode):
            grpc_port, http_port, kv_port = free_port(), free_port(), free_port()
            proc = self._spawn(f"decode-{i}", ["decode", "--port", str(grpc_port), "--http-port", str(http_port),
                                                "--kv-port", str(kv_port), *common])
            self.decodes.append((proc, f"http://127.0.0.1:{http_port}/ready"))
            grpc_addrs.append(f"127.0.0.1:{grpc_port}")
        for i in range(a.prefill):
            port, grpc_port = a.port + i, a.grpc_port + i
            argv = ["prefill", "--port", str(port), "--grpc-port", str(grpc_port), "--decode", ",".join(grpc_addrs),
                    "--policy", a.policy, *common]
            if a.local_fallback:
                argv.append("--local-fallback")
            self.prefills.append((self._spawn(f"prefill-{i}", argv), f"http://127.0.0.1:{port}/ready"))
            self.endpoints.append(f"http://127.0.0.1:{port}")

    def wait_ready(self) -> None:
        from tqdm import tqdm

        pending = dict(enumerate(self.decodes + self.prefills))
        deadline = time.monotonic() + self.args.ready_timeout
        with tqdm(total=len(pending), desc="starting processes", unit="proc") as bar:
            while pending:
                for key, (proc, url) in list(pending.items()):
                    if proc.poll() is not None:
                        raise SystemExit(f"pdserve up: a server exited with {proc.returncode}; see the logs in {self.log_dir}")
                    if _ready(url):
                        del pending[key]
                        bar.update(1)
                if time.monotonic() > deadline:
                    raise SystemExit(f"pdserve up: not ready after {self.args.ready_timeout:.0f}s; see {self.log_dir}")
                time.sleep(0.2)

    def stop(self, timeout: float = 60.0) -> None:
        for group in (self.prefills, self.decodes):  # prefills drain first, decodes finish what they hold
            for proc, _ in group:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + timeout
            for proc, _ in group:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()

    def banner(self) -> str:
        a, url = self.args, self.endpoints[0]
        return f"""
pdserve is up: {a.prefill} prefill, {a.decode} decode, model {a.model!r}, KV transfer {a.transfer}
  OpenAI API: {url}/v1    (also: {', '.join(self.endpoints[1:]) or 'one prefill'})
  gRPC Generate: 127.0.0.1:{a.grpc_port}    logs: {self.log_dir}

  curl {url}/v1/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "{a.model}", "prompt": "Hello", "max_tokens": 16, "stream": true}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='none'); \\
for ch in c.chat.completions.create(model='{a.model}', messages=[{{'role': 'user', 'content': 'Hi'}}], max_tokens=16, stream=True): \\
print(ch.choices[0].delta.content or '', end='', flush=True)"

Ctrl-C drains in-flight requests and stops everything.
"""


def _terminate_with_parent() -> None:
    """In a child, before exec: get SIGTERM (and so drain and exit) if `pdserve up` dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def run(args: argparse.Namespace) -> int:
    cluster = LocalCluster(args)
    stop = {"now": False, "serving": False}

    def on_signal(signum, frame):
        stop["now"] = True
        if not stop["serving"]:  # still starting: stop at once (the finally below stops what started)
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        cluster.start()
        cluster.wait_ready()
        print(cluster.banner(), flush=True)
        stop["serving"] = True
        signal.signal(signal.SIGINT, on_signal)
        while not stop["now"]:
            for proc, _ in cluster.decodes + cluster.prefills:
                if proc.poll() is not None:
                    print(f"a server exited with {proc.returncode}; stopping (logs in {cluster.log_dir})", flush=True)
                    stop["now"] = True
            time.sleep(0.2)
        print("draining and stopping...", flush=True)
        return 0
    except KeyboardInterrupt:
        print("\nstopping...", flush=True)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        cluster.stop()
