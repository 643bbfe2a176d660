"""The design's dependency arrows (docs/design.md, "The parts"), checked on every import.

Each source file is parsed (not imported); every `import`/`from ... import` naming a pdserve
part (absolute `pdserve.X` or relative) is mapped to the part it reaches, and must be allowed
by ALLOWED below. Third-party libraries a part must not pull in are in FORBIDDEN_LIBRARIES.
A new role gets its row here when it lands.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# folder -> import name of the part (pdserve/ itself is the servers' shared runtime).
PARTS = {
    "engine": "engine", "cachestore": "cachestore", "protos": "protos", "prefill_server": "prefill_server",
    "decode_server": "decode_server", "operator": "operator", "pdserve": "runtime", "bench": "bench",
    "localcluster": "localcluster", "router": "router", "planner": "planner", "kvpool": "kvpool",
    "vllm_backend": "vllm_backend", "batch": "batch",
}
SERVERS_MAY_USE = {"engine", "cachestore", "protos", "runtime"}

# part -> the other parts it may import ("may import" arrows; a part may always import itself).
ALLOWED: dict[str, set[str]] = {
    "engine": set(),
    "protos": set(),
    "cachestore": {"protos"},
    # prefill: its start-up mounts the Batch API's routes on its HTTP port (wiring.py -> batch/api.py only)
    "prefill_server": SERVERS_MAY_USE | {"batch"},
    # decode: --kv-pool makes its block manager an rManager of the KV pool (kvpool/decode_pool.py)
    "decode_server": SERVERS_MAY_USE | {"kvpool"},
    # The runtime (defaults, metrics, discovery, server_setup, cli) builds servers' common parts
    # from the engine, cachestore and protos; it never imports a server or a tool (the CLI
    # reaches commands by module name, lazily).
    "runtime": {"engine", "cachestore", "protos"},
    # The operator manages pods; it does not run models or serve metrics. It runs the planner.
    "operator": {"protos", "runtime", "planner"},
    "localcluster": {"runtime", "cachestore", "planner"},  # cachestore: only its TRANSPORTS list
    # vllm_backend: only env.py, where vLLM-CPU's environment is (it imports no vLLM)
    # batch: experiment 9 (throughput) runs TD-Pipe's PipelineEngine in-process
    # router, prefill_server: the scale experiment's virtual clock (bench/experiments/virtual_*.py) drives the router's
    # decision and the prefill's decode picker in one process (ONLY_MODULES: those, never a server)
    "bench": {"engine", "cachestore", "protos", "runtime", "planner", "kvpool", "vllm_backend", "batch", "router",
              "prefill_server"},
    # The router hashes prompts with the engine's tokenizer and chained block hashes; it never
    # loads a model (ONLY_MODULES) and reaches the servers only over the network.
    "router": {"protos", "runtime", "engine"},
    # The planner is pure decisions: of ours only the runtime's facts (defaults). The metric names it
    # reads are checked against pdserve.metrics by its tests (importing that would load
    # prometheus_client into the operator).
    "planner": {"runtime"},
    # The KV pool (DistKV-LLM): each decode's rManager lends blocks of its engine's pool and
    # computes micro-attention over them (the engine's model and KVCache); the gManager and the
    # wire are gRPC (protos); defaults and free ports from the runtime.
    "kvpool": {"engine", "protos", "runtime"},
    # vLLM as the servers' engine (--engine vllm): the engine's request types and errors, the
    # CacheStore's region/layout, the Compat message, the runtime's ServerParts. The runtime
    # reaches it only by module name, lazily (server_setup.VLLM_SERVER_MODULE).
    "vllm_backend": {"engine", "cachestore", "protos", "runtime"},
    # The Batch API and TD-Pipe: a line answers what the prefill's online endpoint would, so it
    # uses the prefill's OpenAI code (ONLY_MODULES); the pipeline engine is built from the
    # engine's parts; defaults and server set-up from the runtime. Never the decode or P/D.
    "batch": {"engine", "prefill_server", "runtime"},
}
# vLLM is imported by the vllm_backend only (it lives in its own environment, never pdserve's).
VLLM_ONLY_IN = "vllm_backend"
# (part, part it imports) -> the only modules of that part it may import.
ONLY_MODULES = {
    ("router", "engine"): {"tokenizer", "block_manager", "defaults"}, ("planner", "runtime"): {"defaults"},
    # the prefill and the Batch API import each other's modules, never a cycle of modules: the
    # prefill's start-up imports the routes; the Batch API imports the prefill's OpenAI code
    ("prefill_server", "batch"): {"api"},
    ("batch", "prefill_server"): {"openai_api", "openai_serving", "http_api", "closing"},
    ("bench", "router"): {"router"}, ("bench", "prefill_server"): {"picker", "session_protocol"},
}
# part -> runtime modules it must not import even though it may import the runtime.
FORBIDDEN_RUNTIME_MODULES = {"operator": {"metrics", "server_setup", "discovery"}}
FORBIDDEN_LIBRARIES = {
    "operator": {"prometheus_client", "torch", "grpc"},
    "engine": {"grpc", "aiohttp", "prometheus_client", "kopf", "kubernetes"},
    "cachestore": {"aiohttp", "prometheus_client", "kopf", "kubernetes"},
    "router": {"torch"},
    "planner": {"prometheus_client", "torch", "grpc", "aiohttp", "kopf", "kubernetes"},
    "kvpool": {"aiohttp", "kopf", "kubernetes"},
}


def _imports(path: Path, package: str) -> list[tuple[str, int]]:
    """Absolute dotted names imported by one file, relative imports resolved against `package`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((name, node.lineno))
            found += [(f"{name}.{alias.name}", node.lineno) for alias in node.names]
    return found


def _part_of(dotted: str) -> tuple[str | None, str | None]:
    """(part, its module) reached by an absolute import name, or (None, None) if not ours.
    The module is None when the import names the part's package itself."""
    bits = dotted.split(".")
    if bits[0] != "pdserve":
        return None, None
    if len(bits) == 1:
        return "runtime", None
    if bits[1] in PARTS and bits[1] != "pdserve":
        return PARTS[bits[1]], bits[2] if len(bits) > 2 else None
    return "runtime", bits[1]


def _sources():
    for folder, part in PARTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            rel = path.relative_to(REPO / folder).with_suffix("")
            package = ".".join(["pdserve"] + ([] if folder == "pdserve" else [folder]) + list(rel.parts[:-1]))
            yield part, path, package


def violations() -> list[str]:
    bad, seen = [], set()
    for part, path, package in _sources():
        for name, line in _imports(path, package):
            if (path, line) in seen:
                continue  # one report per import statement
            before = len(bad)
            where = f"{path.relative_to(REPO)}:{line} imports {name}"
            top = name.split(".")[0]
            if top in FORBIDDEN_LIBRARIES.get(part, ()) or (top == "vllm" and part != VLLM_ONLY_IN):
                bad.append(f"{where} (the {part} must not use {top})")
            target, module = _part_of(name)
            if target is None or target == part:
                continue
            if target not in ALLOWED[part]:
                bad.append(f"{where} (the {part} may import only {sorted(ALLOWED[part]) or 'nothing of ours'})")
            elif target == "runtime" and module in FORBIDDEN_RUNTIME_MODULES.get(part, ()):
                bad.append(f"{where} (the {part} must not import pdserve.{module})")
            elif (part, target) in ONLY_MODULES and module not in ONLY_MODULES[(part, target)]:
                bad.append(f"{where} (the {part} may import only "
                           f"{sorted(ONLY_MODULES[(part, target)])} of the {target})")
            if len(bad) > before:
                seen.add((path, line))
    return sorted(bad)


def test_every_import_follows_the_design_arrows():
    bad = violations()
    assert not bad, "imports against the design's arrows:\n" + "\n".join(bad)


@pytest.mark.parametrize("source, package, expected", [
    ("from pdserve.prefill_server import node\n", "pdserve.decode_server", "decode_server may import only"),
    ("from .. import defaults\n", "pdserve.engine", "engine may import only nothing of ours"),
    ("from pdserve.metrics import ServerMetrics\n", "pdserve.operator", "must not import pdserve.metrics"),
    ("import prometheus_client\n", "pdserve.operator", "must not use prometheus_client"),
    ("from pdserve.engine.model import DecoderModel\n", "pdserve.router", "of the engine"),
    ("from pdserve.prefill_server import openai_api\n", "pdserve.router", "router may import only"),
    ("from pdserve.metrics import METRICS\n", "pdserve.planner", "of the runtime"),
    ("import aiohttp\n", "pdserve.planner", "must not use aiohttp"),
    ("from vllm import SamplingParams\n", "pdserve.prefill_server", "must not use vllm"),
    ("from pdserve.prefill_server import node\n", "pdserve.vllm_backend", "vllm_backend may import only"),
    ("from pdserve.prefill_server.node import PrefillNode\n", "pdserve.batch", "of the prefill_server"),
    ("from pdserve.batch.runner import BatchRunner\n", "pdserve.prefill_server", "of the batch"),
    ("from pdserve.decode_server import cli\n", "pdserve.batch", "batch may import only"),
    ("from pdserve.prefill_server.node import PrefillNode\n", "pdserve.bench", "of the prefill_server"),
])
def test_the_checker_catches_a_breach(tmp_path, monkeypatch, source, package, expected):
    folder = package.split(".")[1]
    fake_repo = tmp_path
    (fake_repo / folder).mkdir()
    (fake_repo / folder / "breach.py").write_text(source)
    monkeypatch.setitem(globals(), "REPO", fake_repo)
    for other in PARTS:
        (fake_repo / other).mkdir(exist_ok=True)
    assert any(expected in v for v in violations())
