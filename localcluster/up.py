"""Start a local prefill + decode cluster and serve the OpenAI API (Ctrl-C stops it).

Starts --decode decode processes and --prefill prefill processes on 127.0.0.1 (each
prefill knows every decode through a static list), waits until all are ready (a progress
bar), prints the endpoint with a curl and an openai-client example, and keeps running.
With --autoscale the planner (autoscale.py) starts and drains servers within the
--min/--max bounds: prefills then find decodes in <log-dir>/decodes.txt and the router
(the front door whenever --max-prefill > 1) finds prefills in <log-dir>/prefills.txt;
a server is listed once it is ready and unlisted once it has drained and exited.
A server that dies is restarted on the same ports with capped exponential backoff while
the others keep serving (a line per restart; see supervisor.py), unless --restart never.
`up` ends on Ctrl-C (or SIGTERM): the prefills drain their in-flight requests first, then
the decodes drain theirs, then everything stops; or when a server cannot start at all
(it died before becoming ready --max-failed-starts times in a row: the error names it and
shows the end of its log). Logs go to --log-dir, with servers.json (pid, state, restarts
of every server) for tools, and <server>.pid (e.g. decode-0.pid) holding the pid of each
server process while it runs (for a shell: `kill -9 $(cat DIR/decode-0.pid)`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from functools import partial
from pathlib import Path

from pdserve import api_keys, defaults, tls
from pdserve.net import free_ports
from pdserve.test_hooks import PLANNER_GATE_ENV, gate_closed, gate_dir

from . import autoscale
from .supervisor import RestartBackoff, ServerCannotStart, ServerExited, ServerProcess, Supervisor
from .up_args import add_arguments  # noqa: F401 - `pdserve up`'s flags (pdserve/cli.py finds them here)

ROLES_STOP_ORDER = ("router", "prefill", "decode")  # the front door drains first, decodes last
RUNNING_STATES = ("starting", "ready", "draining")  # a server whose process runs (supervisor.py)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200
    except Exception:  # noqa: BLE001 - not up yet
        return False


class LocalCluster:
    """The processes of one local cluster, kept running by a Supervisor; ``stop()`` drains prefills, then decodes."""

    def __init__(self, args: argparse.Namespace, say=print):
        if args.prefill < 1 or args.decode < 0:
            raise SystemExit("pdserve up: need --prefill >= 1 and --decode >= 0")
        if args.decode == 0 and not args.local_fallback:
            raise SystemExit("pdserve up: --decode 0 needs --local-fallback (nothing could decode)")
        tp = getattr(args, "tensor_parallel_size", 1)
        if tp < 1:
            raise SystemExit(f"pdserve up: --tensor-parallel-size must be >= 1, got {tp}")
        if getattr(args, "api_key_file", None):  # a bad file: one line now, not a server that cannot start
            try:
                api_keys.load(args.api_key_file)
            except api_keys.KeyFileError as exc:
                raise SystemExit(f"pdserve up: {exc}") from None
        self.args = args
        self.scaling = autoscale.planner_config(args) if getattr(args, "autoscale", False) else None
        self.log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.tls = self._tls_files(args)
        self.discovery_files = {"decode": self.log_dir / "decodes.txt", "prefill": self.log_dir / "prefills.txt"}
        self.routed = (self.scaling.prefill.max_replicas if self.scaling else args.prefill) > 1
        self.endpoints: list[str] = []
        self._count = {"prefill": 0, "decode": 0}
        self._listed: dict[str, list[str] | None] = {"prefill": None, "decode": None}
        self._pid_names: set[str] = set()  # servers that may have a <name>.pid file
        self.supervisor = Supervisor([], self._spawn, _ready, policy=args.restart, say=say, on_change=self._write_state)
        self._plan()
        self.autoscaler = None
        if self.scaling:
            self.autoscaler = autoscale.LocalAutoscaler(self, self.scaling, args.plan_interval, args.plan_window,
                                                        events=self.log_dir / "autoscale.jsonl", say=say,
                                                        paused=partial(gate_closed, gate_dir(PLANNER_GATE_ENV)))

    def servers(self, role: str) -> list[ServerProcess]:
        return [s for s in self.supervisor.servers if s.role == role]

    @property
    def decodes(self) -> list[ServerProcess]:
        return self.servers("decode")

    @property
    def prefills(self) -> list[ServerProcess]:
        return self.servers("prefill")

    @property
    def routers(self) -> list[ServerProcess]:
        return self.servers("router")

    def _server(self, name: str, argv: list[str], ready_url: str, role: str, address: str,
                metrics_url: str) -> ServerProcess:
        a = self.args
        backoff = RestartBackoff(initial=a.backoff_initial, cap=a.backoff_cap, reset_after=a.backoff_reset,
                                 max_failed_starts=a.max_failed_starts)
        return ServerProcess(name, argv, ready_url, self.log_dir / f"{name}.log", backoff, role=role, address=address,
                             metrics_url=metrics_url)

    def _common(self) -> list[str]:
        a = self.args
        common = ["--model", a.model, "--transfer", a.transfer, "--num-blocks", str(a.num_blocks), "--threads",
                  str(a.threads), "--kv-cache-dtype", getattr(a, "kv_cache_dtype", "auto"),
                  "--max-num-batched-tokens",
                  str(getattr(a, "max_num_batched_tokens", defaults.MAX_NUM_BATCHED_TOKENS)),
                  "--long-prefill-threshold",
                  str(getattr(a, "long_prefill_threshold", defaults.LONG_PREFILL_THRESHOLD)),
                  "--tensor-parallel-size", str(getattr(a, "tensor_parallel_size", 1))]
        if getattr(a, "engine", "builtin") == "sim":
            profile = Path(a.sim_profile)  # a file: by its absolute path; else a shipped profile's name
            common += ["--engine", "sim", "--sim-profile",
                       str(profile.resolve()) if profile.is_file() else a.sim_profile]
        if getattr(a, "quantization", None):
            common += ["--quantization", a.quantization]
        if self.scaling:  # a drained server finishes its longest request before it stops
            common += ["--drain-timeout", f"{defaults.REQUEST_TIMEOUT_S:g}"]
        common += tls.flags(self.tls)
        return common + (a.extra.split() if a.extra else [])

    def _tls_files(self, args: argparse.Namespace) -> tls.TlsFiles | None:
        """--tls-cert/--tls-key/--tls-ca as given (checked now), or with --tls a throwaway CA and one
        certificate for every server, made in <log-dir>/tls (``tls_certs.throwaway``); None: plain."""
        files = tls.from_args(args, "pdserve up")
        if files is None and getattr(args, "tls", False):
            from pdserve import tls_certs  # the cryptography package: only when a CA is made

            files = tls_certs.throwaway(str(self.log_dir))
        return files

    def _door(self) -> list[str]:
        """--api-key-file for the OpenAI doors (router, prefills), as an absolute path (checked by ``__init__``)."""
        path = getattr(self.args, "api_key_file", None)
        return ["--api-key-file", str(Path(path).resolve())] if path else []

    def _new_decode(self) -> ServerProcess:
        i, self._count["decode"] = self._count["decode"], self._count["decode"] + 1
        grpc_port, http_port, kv_port = free_ports(3)
        argv = ["decode", "--port", str(grpc_port), "--http-port", str(http_port), "--kv-port", str(kv_port),
                *self._common()]
        return self._server(f"decode-{i}", argv, f"http://127.0.0.1:{http_port}/ready", "decode",
                            f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}/metrics")

    def _new_prefill(self, decodes: list[str]) -> ServerProcess:
        a = self.args
        i, self._count["prefill"] = self._count["prefill"], self._count["prefill"] + 1
        port, grpc_port = free_ports(2) if self.routed else (a.port, a.grpc_port)
        if self.scaling:
            discovery = ["--discovery", "file", "--decode-file", str(self.discovery_files["decode"])]
        else:
            discovery = ["--decode", ",".join(decodes)]
        argv = ["prefill", "--port", str(port), "--grpc-port", str(grpc_port), *discovery, "--policy", a.policy,
                "--disaggregation", a.disaggregation, "--decode-reuse" if a.decode_reuse else "--no-decode-reuse",
                *self._common(), *self._door(), *a.prefill_extra.split()]
        if a.local_fallback:
            argv.append("--local-fallback")
        return self._server(f"prefill-{i}", argv, f"http://127.0.0.1:{port}/ready", "prefill",
                            f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{port}/metrics")

    def _plan(self) -> None:
        """Every server's command line, ports included, fixed once: a restart reuses them."""
        a = self.args
        if self.scaling:
            self._write_state()  # empty discovery files: servers are listed as they become ready
        decodes = [self._new_decode() for _ in range(a.decode)]
        prefills = [self._new_prefill([d.address for d in decodes]) for _ in range(a.prefill)]
        self.supervisor.servers += decodes + prefills
        self.endpoints = [p.metrics_url.removesuffix("/metrics") for p in prefills]
        if self.routed:  # the router is the front door: prefix- and load-aware choice of prefill
            prefills_arg = (["--discovery", "file", "--prefill-file", str(self.discovery_files["prefill"])]
                            if self.scaling
                            else ["--prefill", ",".join(p.address for p in prefills)])
            argv = ["router", "--port", str(a.port), "--grpc-port", str(a.grpc_port), "--model", a.model, *prefills_arg,
                    *self._door(), *tls.flags(self.tls)]
            self.supervisor.servers.append(self._server("router", argv, f"http://127.0.0.1:{a.port}/ready", "router",
                                                        "", ""))
            self.endpoints.insert(0, f"http://127.0.0.1:{a.port}")

    def add_server(self, role: str, now: float) -> ServerProcess:
        """Start one more prefill or decode (the autoscaler's scale-up)."""
        server = self._new_decode() if role == "decode" else self._new_prefill([])
        self.supervisor.add(server, now)
        return server

    def drain_server(self, server: ServerProcess) -> None:
        """Drain one server and let it go (the autoscaler's scale-down)."""
        self.supervisor.drain(server)

    def _spawn(self, server: ServerProcess) -> subprocess.Popen:
        log = open(server.log, "ab")  # a restart appends to the same log
        if server.backoff.restarts:
            log.write(f"\n--- pdserve up: restart {server.backoff.restarts} of {server.name} ---\n".encode())
            log.flush()
        cmd = [sys.executable, "-m", "pdserve", *server.argv]
        try:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=_terminate_with_parent)
        finally:
            log.close()  # the child has its own copy

    def _write_state(self) -> None:
        """<log-dir>/servers.json: pid, state and restarts of every server (for tools such as bench chaos);
        <log-dir>/<server>.pid: the pid of each server process that runs now (for a shell: `kill -9 $(cat
        DIR/decode-0.pid)`, as bench conformance's --kill-cmd); with --autoscale also the discovery files:
        the servers that became ready and have not gone."""
        snapshot = self.supervisor.snapshot()
        _write_atomically(self.log_dir / "servers.json", json.dumps(snapshot, indent=1))
        for name, server in snapshot.items():
            pid_file = self.log_dir / f"{name}.pid"
            if server["pid"] is not None and server["state"] in RUNNING_STATES:
                _write_atomically(pid_file, f"{server['pid']}\n")
            else:  # exited (waiting for its restart) or gone: no pid that a kill could hit by mistake
                pid_file.unlink(missing_ok=True)
        for gone in self._pid_names - set(snapshot):
            (self.log_dir / f"{gone}.pid").unlink(missing_ok=True)
        self._pid_names = set(snapshot)
        if not self.scaling:
            return
        for role, path in self.discovery_files.items():
            listed = sorted(s.address for s in self.servers(role) if s.was_ready)
            if listed != self._listed[role]:
                _write_atomically(path, "".join(f"{address}\n" for address in listed))
                self._listed[role] = listed

    def start(self) -> None:
        self.supervisor.start_all(time.monotonic())

    def wait_ready(self) -> None:
        from tqdm import tqdm

        sup = self.supervisor
        deadline = time.monotonic() + self.args.ready_timeout
        with tqdm(total=len(sup.servers), desc="starting processes", unit="proc") as bar:
            while not sup.all_ready():
                try:
                    sup.step(time.monotonic())
                except (ServerExited, ServerCannotStart) as e:
                    raise SystemExit(f"pdserve up: {e}") from None
                ready = sum(s.state == "ready" for s in sup.servers)
                if ready != bar.n:
                    bar.update(ready - bar.n)
                if time.monotonic() > deadline:
                    late = [s.name for s in sup.servers if s.state != "ready"]
                    raise SystemExit(f"pdserve up: {', '.join(late)} not ready after {self.args.ready_timeout:.0f}s; "
                                     f"see {self.log_dir}")
                time.sleep(0.2)

    def serve(self, stopping) -> int:
        """Supervise (and autoscale) until stopping() is true (0) or a server ends everything (1)."""
        while not stopping():
            try:
                self.supervisor.step(time.monotonic())
            except (ServerExited, ServerCannotStart) as e:
                print(f"pdserve up: {e}\nstopping (logs in {self.log_dir})", flush=True)
                return 1
            if self.autoscaler is not None:
                try:
                    self.autoscaler.step(time.monotonic())
                except Exception as e:  # noqa: BLE001 - a failed round must not stop the cluster; the next one retries
                    print(f"[autoscale] round failed: {type(e).__name__}: {e}", flush=True)
            time.sleep(0.2)
        return 0

    def stop(self, timeout: float = 60.0) -> None:
        if self.autoscaler is not None:
            self.autoscaler.close()
        for role in ROLES_STOP_ORDER:  # the front door drains first, decodes last
            procs = [s.popen for s in self.servers(role) if s.popen is not None]
            for proc in procs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + timeout
            for proc in procs:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait()
        for name in self._pid_names:  # every server has stopped: no pid file may outlive its process
            (self.log_dir / f"{name}.pid").unlink(missing_ok=True)

    def banner(self) -> str:
        a, url = self.args, self.endpoints[0]
        scaling = ""
        if self.scaling:
            p, d = self.scaling.prefill, self.scaling.decode
            scaling = (f"\n  autoscaling: prefill {p.min_replicas}..{p.max_replicas}, decode "
                       f"{d.min_replicas}..{d.max_replicas} (SLO TTFT {a.slo_ttft_ms:g} ms, TBT "
                       f"{a.slo_tbt_ms:g} ms; decisions in {self.log_dir / 'autoscale.jsonl'})")
        api_key, curl_auth, keys = ", api_key='none'", "", ""
        if getattr(a, "api_key_file", None):  # never a key itself: the banner goes to logs
            api_key, curl_auth = "", " -H \"Authorization: Bearer $OPENAI_API_KEY\""  # the client reads the variable
            keys = f"\n  API keys: {Path(a.api_key_file).resolve()} (export OPENAI_API_KEY=<one of them>)"
        if self.tls is not None:  # gRPC clients need a certificate of this CA (never the key in a banner)
            keys += f"\n  mutual TLS on every internal connection: CA {self.tls.ca}, certificate {self.tls.cert}"
        return f"""
pdserve is up: {a.prefill} prefill, {a.decode} decode{', 1 router' if self.routers else ''}, model {a.model!r}, KV transfer {a.transfer}{scaling}
  OpenAI API: {url}/v1    ({'the router; prefills at ' + ', '.join(self.endpoints[1:]) if self.routers else 'the prefill'})
  gRPC Generate: 127.0.0.1:{a.grpc_port}    logs: {self.log_dir}{keys}

  curl {url}/v1/completions -H 'Content-Type: application/json'{curl_auth} \\
       -d '{{"model": "{a.model}", "prompt": "Hello", "max_tokens": 16, "stream": true}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{url}/v1'{api_key}); \\
for ch in c.chat.completions.create(model='{a.model}', messages=[{{'role': 'user', 'content': 'Hi'}}], max_tokens=16, stream=True): \\
print(ch.choices[0].delta.content or '', end='', flush=True)"

Ctrl-C drains in-flight requests and stops everything.
"""  # noqa: E501


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _terminate_with_parent() -> None:
    """In a child, before exec: get SIGTERM (and so drain and exit) if `pdserve up` dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _say(line: str) -> None:
    print(line, flush=True)


def run(args: argparse.Namespace) -> int:
    cluster = LocalCluster(args, say=_say)
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
        code = cluster.serve(lambda: stop["now"])
        print("draining and stopping...", flush=True)
        return code
    except KeyboardInterrupt:
        print("\nstopping...", flush=True)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        cluster.stop()
