"""engine/server_engine.py declares what the servers call on an engine; both engines implement every
member with the same parameters: the built-in AsyncLLMEngine (inspected) and vLLM's VllmAsyncEngine
(read from its source, so the test needs no vLLM installed)."""

import ast
import inspect
from pathlib import Path

from pdserve.engine.async_engine import AsyncLLMEngine
from pdserve.engine.server_engine import ServerEngine

ROOT = Path(__file__).resolve().parents[2]


def _declared() -> dict[str, list[str] | None]:
    """member -> parameter names (None for a data attribute)."""
    out: dict[str, list[str] | None] = {name: None for name in ServerEngine.__annotations__}
    for name, fn in vars(ServerEngine).items():
        if inspect.isfunction(fn) and not name.startswith("_"):
            out[name] = list(inspect.signature(fn).parameters)
    return out


def _vllm_engine() -> tuple[dict[str, list[str]], set[str]]:
    """VllmAsyncEngine's methods -> parameter names, and the attributes its methods assign on self."""
    tree = ast.parse((ROOT / "vllm_backend" / "engine.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "VllmAsyncEngine")
    methods = {f.name: [a.arg for a in f.args.args + f.args.kwonlyargs]
               for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assigned = {t.attr for node in ast.walk(cls) if isinstance(node, ast.Assign) for t in node.targets
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return methods, assigned


def test_the_declaration_lists_what_the_servers_need():
    declared = _declared()
    assert {"generate", "prefill_only", "prefill_many", "release", "reserve", "reserve_prefix", "add_prefilled",
            "prefill_reserved", "abort", "num_free_blocks", "num_blocks"} <= set(declared)


def test_the_built_in_engine_implements_it():
    for name, params in _declared().items():
        assert hasattr(AsyncLLMEngine, name), f"AsyncLLMEngine lacks ServerEngine.{name}"
        if params is not None:
            assert list(inspect.signature(getattr(AsyncLLMEngine, name)).parameters) == params, name


def test_the_vllm_engine_implements_it():
    methods, assigned = _vllm_engine()
    for name, params in _declared().items():
        if params is None:
            assert name in assigned or name in methods, f"VllmAsyncEngine lacks ServerEngine.{name}"
        else:
            assert name in methods, f"VllmAsyncEngine lacks ServerEngine.{name}"
            assert methods[name] == params, f"VllmAsyncEngine.{name}: {methods[name]} != {params}"
