"""A local KV pool: one gManager and N decodes (``pdserve kvpool gmanager|node``) as child processes.

Used by the long-context experiment and the kvpool end-to-end tests. ``close()`` (or leaving
the ``with`` block) stops every process (SIGTERM, then SIGKILL), also on failure.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc

from pdserve.net import free_ports
from pdserve.protos import kvpool_pb2, kvpool_pb2_grpc

PDSERVE = str(Path(sys.executable).parent / "pdserve")


def _wait_port(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(proc.args)} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listened on port {port} within {timeout}s")


class KVPoolCluster:
    def __init__(self, num_nodes: int, num_blocks: int, reserve: int = 1, pooled: bool = True,
                 log_dir: Path | None = None, block_size: int | None = None, ttl_s: float = 2.0, model: str = "tiny"):
        self.num_nodes, self.num_blocks, self.reserve, self.pooled = num_nodes, num_blocks, reserve, pooled
        self.block_size, self.ttl_s, self.log_dir, self.model = block_size, ttl_s, log_dir, model
        self.procs: list[subprocess.Popen] = []
        self.nodes: dict[str, subprocess.Popen] = {}
        self.channels: list[grpc.Channel] = []

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        out = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "wb")
        proc = subprocess.Popen([PDSERVE, "kvpool", *args], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def start(self) -> "KVPoolCluster":
        ports = free_ports(self.num_nodes + 1)
        self.gmanager_port, node_ports = ports[0], ports[1:]
        if self.pooled:
            self._start_gmanager()
        self.ports: dict[str, int] = {}
        for i, port in enumerate(node_ports):
            name = f"decode-{i}"
            args = ["node", "--port", str(port), "--instance-id", name, "--num-blocks", str(self.num_blocks),
                    "--reserve", str(self.reserve), "--model", self.model]
            if self.pooled:
                args += ["--gmanager", f"127.0.0.1:{self.gmanager_port}"]
            if self.block_size:
                args += ["--block-size", str(self.block_size)]
            self.nodes[name] = self._spawn(name, args)
            self.ports[name] = port
        for name, port in self.ports.items():
            _wait_port(port, self.nodes[name], 120)
        if self.pooled:
            self.wait(lambda: len(self.ledger()) == self.num_nodes, "every decode reported to the gManager")
        return self

    def _start_gmanager(self) -> None:
        self.gmanager_proc = self._spawn("gmanager",
                                         ["gmanager", "--port", str(self.gmanager_port), "--ttl", str(self.ttl_s)])
        _wait_port(self.gmanager_port, self.gmanager_proc, 60)
        self.gmanager = kvpool_pb2_grpc.GManagerStub(self._channel(self.gmanager_port))

    def restart_gmanager(self) -> None:
        """SIGKILL the gManager and start a fresh one on the same port (its ledger starts empty)."""
        os.killpg(self.gmanager_proc.pid, signal.SIGKILL)
        self.gmanager_proc.wait(timeout=30)
        self._start_gmanager()

    def _channel(self, port: int) -> grpc.Channel:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)])
        self.channels.append(channel)
        return channel

    def node(self, name: str) -> kvpool_pb2_grpc.KVNodeStub:
        return kvpool_pb2_grpc.KVNodeStub(self._channel(self.ports[name]))

    def generate(self, name: str, request_id: str, prompt: list[int], max_tokens: int, pooled: bool,
                 return_logits: bool = False, max_local_blocks: int = 0,
                 timeout: float = 300) -> kvpool_pb2.GenerateReply:
        return self.node(name).Generate(kvpool_pb2.GenerateRequest(
            request_id=request_id, prompt_ids=prompt, max_tokens=max_tokens, pooled=pooled, ignore_eos=True,
            return_logits=return_logits, max_local_blocks=max_local_blocks), timeout=timeout)

    def stats(self, name: str) -> kvpool_pb2.StatsReply:
        return self.node(name).Stats(kvpool_pb2.StatsRequest(), timeout=10)

    def ledger(self) -> dict[str, dict[str, int]]:
        rows = self.gmanager.GetLedger(kvpool_pb2.LedgerRequest(), timeout=10).rows
        return {r.lender: {d.borrower: d.blocks for d in r.lent} for r in rows}

    def wait(self, cond, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.1)
        raise TimeoutError(f"not within {timeout}s: {what}")

    def kill(self, name: str) -> None:
        proc = self.nodes.pop(name)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        self.ports.pop(name)

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

    def __enter__(self) -> "KVPoolCluster":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()


def long_prompt(n: int, seed: int) -> list[int]:
    """A prompt of ``n`` printable byte ids, the same for the same seed (the long-context experiments')."""
    rnd = random.Random(seed)
    return [rnd.randrange(32, 127) for _ in range(n)]
