"""engine/server_engine.py declares what the servers call on an engine; both engines implement every
member with the same parameters (names, kinds, defaults) and the same kind of call: the built-in
AsyncLLMEngine and vLLM's VllmAsyncEngine (whose module imports vllm only inside functions, so the
class is inspected here without vLLM installed). A member that drifts in either fails here."""

import ast
import inspect
import textwrap

import pytest

from pdserve.engine.async_engine import AsyncLLMEngine
from pdserve.engine.server_engine import ServerEngine
from pdserve.vllm_backend.engine import VllmAsyncEngine

IMPLEMENTATIONS = [AsyncLLMEngine, VllmAsyncEngine]


def _kind(fn) -> str:
    """How a caller uses it: await it, iterate it with ``async for``, or call it."""
    if inspect.iscoroutinefunction(fn):
        return "coroutine"
    if inspect.isasyncgenfunction(fn):
        return "stream"
    return "call"


def _declared_kind(fn) -> str:
    """The protocol writes a stream as a plain ``def`` returning an AsyncGenerator (it has no body to yield)."""
    kind = _kind(fn)
    return "stream" if kind == "call" and "AsyncGenerator" in str(inspect.signature(fn).return_annotation) else kind


def _params(fn) -> list[tuple[str, object, object]]:
    """(name, kind, default) of each parameter; annotations may differ (vLLM's take its own types)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _methods() -> dict:
    return {name: fn for name, fn in vars(ServerEngine).items() if inspect.isfunction(fn) and not name.startswith("_")}


def _assigned_in_init(cls) -> set[str]:
    """The attributes ``cls.__init__`` (or a base's) assigns on self."""
    out = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or not inspect.isfunction(init):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        out |= {t.attr for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in node.targets
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return out


def test_the_declaration_lists_what_the_servers_call():
    declared = set(_methods()) | set(ServerEngine.__annotations__)
    assert declared == {
        "num_blocks", "start", "stop", "generate",
        "prefill_only", "grant", "prefill_logprob", "prefill_prompt_logprobs", "prefill_cached_tokens", "release",
        "reserve", "reserve_prefix", "add_prefilled", "prefill_reserved", "abort",
        "num_free_blocks", "num_requests", "prefill_counters", "prefix_hit_tokens", "swapped", "tier_stats", "stats",
        "busy_seconds",
    }


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_each_engine_has_every_method_with_the_declared_signature(cls):
    for name, declared in _methods().items():
        got = getattr(cls, name, None)
        assert got is not None and inspect.isfunction(got), f"{cls.__name__} lacks ServerEngine.{name}"
        assert _params(got) == _params(declared), \
            f"{cls.__name__}.{name}{inspect.signature(got)} != {inspect.signature(declared)}"
        assert _kind(got) == _declared_kind(declared), \
            f"{cls.__name__}.{name} is a {_kind(got)}, declared a {_declared_kind(declared)}"


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_each_engine_has_the_declared_attributes(cls):
    for name in ServerEngine.__annotations__:
        assert hasattr(cls, name) or name in _assigned_in_init(cls), f"{cls.__name__} lacks ServerEngine.{name}"


def test_a_drifted_signature_is_caught():
    class Drifted(AsyncLLMEngine):
        async def reserve(self, request_id: str, num_tokens: int, max_tokens: int) -> list[int]:  # renamed parameter
            return []

        def release(self, request_id: str) -> None:  # no longer a coroutine
            return None

    declared = _methods()
    assert _params(Drifted.reserve) != _params(declared["reserve"])
    assert _kind(Drifted.release) != _declared_kind(declared["release"])
