"""SLO classes: what an InferenceService's ``spec.slo`` declares, parsed in one place.

The format is the CRD's ``spec.slo`` object itself (camelCase, as the operator writes it into
``PDSERVE_SLO_CLASSES`` and as ``--slo-classes`` takes it, inline JSON or a JSON file)::

    {"ttftMs": 1000, "tbtMs": 100,                       # the class named "default" (the old form)
     "e2eMs": 60000, "earlyReject": false,               # optional, also for "default"
     "defaultClass": "interactive",                      # what requests that choose nothing get
     "classes": [
       {"name": "interactive", "ttftMs": 2000, "e2eMs": 20000, "earlyReject": true, "priority": 0},
       {"name": "batch", "e2eMs": 3600000, "priority": 1}]}

Every target is optional (a class without targets is best effort: it is never late). The
old two-field form ``{"ttftMs": ..., "tbtMs": ...}`` is the class ``default`` alone.

A request picks its class (``SloClasses.select``):

- the header ``X-SLO-Class: <name>``;
- or vLLM's body field ``priority: <int>``: the class that declares that ``priority``; ``0``
  (vLLM's default priority) is the default class unless a class declares 0 itself;
- neither: ``defaultClass``. Both, naming different classes: 400.

An unknown name or priority is a ``ValueError`` whose message names the known classes (the
servers answer 400 with it).

What "met" means, per request that finished: TTFT <= ttftMs; its mean time between tokens
((e2e - TTFT) / (tokens - 1)) <= tbtMs; end to end <= e2eMs (``SloClass.verdict``).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from pdserve.defaults import ENV_SLO_CLASSES

DEFAULT_CLASS = "default"
HEADER = "X-SLO-Class"
TARGETS = ("ttft", "tbt", "e2e")
_TARGET_KEYS = {"ttftMs": "ttft_ms", "tbtMs": "tbt_ms", "e2eMs": "e2e_ms"}
_CLASS_KEYS = {"name", "earlyReject", "priority", *_TARGET_KEYS}
_TOP_KEYS = {"earlyReject", "defaultClass", "classes", *_TARGET_KEYS}
MAX_TARGET_MS = 86_400_000  # a day
MAX_CLASSES = 16
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # a class name (also a metric label value), at most 63


@dataclass(frozen=True, slots=True)
class SloClass:
    name: str
    ttft_ms: int | None = None
    tbt_ms: int | None = None
    e2e_ms: int | None = None
    early_reject: bool = False  # 429 at once when even the next free slot would miss the SLO
    priority: int | None = None  # the vLLM ``priority`` value that selects it

    @property
    def targets(self) -> tuple[str, ...]:
        """The targets this class sets, of ttft, tbt, e2e."""
        return tuple(t for t, v in zip(TARGETS, (self.ttft_ms, self.tbt_ms, self.e2e_ms)) if v is not None)

    @property
    def evictable(self) -> bool:
        """Batch / best effort (neither a TTFT nor a TBT target): a decode may evict its KV to host
        memory while interactive requests need the time (LSO, ``decode_server/lso.py``)."""
        return self.ttft_ms is None and self.tbt_ms is None

    def deadline(self, arrival: float) -> float:
        """EDF's deadline: arrival + the first target that applies (TTFT, else e2e); inf without one."""
        first = self.ttft_ms if self.ttft_ms is not None else self.e2e_ms
        return math.inf if first is None else arrival + first / 1000.0

    def verdict(self, ttft_s: float | None, e2e_s: float, tokens: int) -> dict[str, bool]:
        """target -> met, for the targets this class sets, of a request that finished."""
        out = {}
        if self.ttft_ms is not None:
            out["ttft"] = ttft_s is not None and ttft_s * 1000.0 <= self.ttft_ms
        if self.tbt_ms is not None:
            mean_tbt = (e2e_s - ttft_s) / (tokens - 1) if ttft_s is not None and tokens > 1 else 0.0
            out["tbt"] = mean_tbt * 1000.0 <= self.tbt_ms
        if self.e2e_ms is not None:
            out["e2e"] = e2e_s * 1000.0 <= self.e2e_ms
        return out

    def describe(self) -> str:
        targets = [f"{t} {v} ms" for t, v in zip(TARGETS, (self.ttft_ms, self.tbt_ms, self.e2e_ms)) if v is not None]
        return f"{self.name} ({', '.join(targets) or 'best effort'})"


class SloClasses:
    """The classes a server knows, and how a request selects one."""

    def __init__(self, classes: list[SloClass], default: str = DEFAULT_CLASS):
        self.by_name: dict[str, SloClass] = {}
        for c in classes:
            if c.name in self.by_name:
                raise ValueError(f"SLO class {c.name!r} is declared twice")
            self.by_name[c.name] = c
        if default not in self.by_name:
            raise ValueError(f"defaultClass {default!r} is not a declared class; known: {', '.join(self.by_name)}")
        self.default = self.by_name[default]
        self.by_priority: dict[int, SloClass] = {}
        for c in classes:
            if c.priority is not None:
                if c.priority in self.by_priority:
                    raise ValueError(f"SLO classes {self.by_priority[c.priority].name!r} and {c.name!r} both declare "
                                     f"priority {c.priority}")
                self.by_priority[c.priority] = c
        self.by_priority.setdefault(0, self.default)

    def __iter__(self):
        return iter(self.by_name.values())

    def names(self) -> list[str]:
        return list(self.by_name)

    def known(self) -> str:
        """The known classes and the priorities that select them, for error messages."""
        prio: dict[str, list[str]] = {}
        for p, c in sorted(self.by_priority.items()):
            prio.setdefault(c.name, []).append(str(p))
        return ", ".join(n + (f" (priority {', '.join(prio[n])})" if n in prio else "") for n in self.by_name)

    def select(self, header: str | None = None, priority=None) -> SloClass:
        """The class of a request from its X-SLO-Class header and/or body ``priority``."""
        by_header = by_priority = None
        if header is not None:
            by_header = self.by_name.get(header.strip())
            if by_header is None:
                raise ValueError(f"unknown SLO class {header.strip()[:64]!r} in header {HEADER}; known classes: "
                                 f"{self.known()}")
        if priority is not None:
            if isinstance(priority, bool) or not isinstance(priority, int):
                raise ValueError(f"priority must be an integer, got {priority!r:.40}; known classes: {self.known()}")
            by_priority = self.by_priority.get(priority)
            if by_priority is None:
                raise ValueError(f"no SLO class answers priority {priority}; known classes: {self.known()}")
        if by_header and by_priority and by_header is not by_priority:
            raise ValueError(f"header {HEADER} says {by_header.name!r} but priority {priority} selects "
                             f"{by_priority.name!r}; known classes: {self.known()}")
        return by_header or by_priority or self.default


def _target(where: str, key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TARGET_MS:
        raise ValueError(f"{where}.{key} must be an integer number of milliseconds in [1, {MAX_TARGET_MS}], "
                         f"got {value!r:.40}")
    return value


def _class(where: str, name: str, obj: Mapping, allowed: set[str]) -> SloClass:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(allowed)}")
    targets = {attr: _target(where, key, obj[key]) for key, attr in _TARGET_KEYS.items() if obj.get(key) is not None}
    early = obj.get("earlyReject", False)
    if not isinstance(early, bool):
        raise ValueError(f"{where}.earlyReject must be true or false, got {early!r:.40}")
    priority = obj.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise ValueError(f"{where}.priority must be an integer, got {priority!r:.40}")
    return SloClass(name, early_reject=early, priority=priority, **targets)


def parse(obj) -> SloClasses:
    """SloClasses from the ``spec.slo`` object (see the module docstring); ValueError naming the field."""
    if obj is None:
        return SloClasses([SloClass(DEFAULT_CLASS)])
    if not isinstance(obj, Mapping):
        raise ValueError(f"the SLO configuration must be a JSON object like spec.slo, got {type(obj).__name__}")
    default = _class("slo", DEFAULT_CLASS, obj, _TOP_KEYS)
    listed = obj.get("classes") or []
    if not isinstance(listed, list):
        raise ValueError("slo.classes must be a list of {name, ttftMs, tbtMs, e2eMs, earlyReject, priority}")
    if len(listed) > MAX_CLASSES:
        raise ValueError(f"slo.classes: at most {MAX_CLASSES} classes, got {len(listed)}")
    classes = [default]
    for i, item in enumerate(listed):
        where = f"slo.classes[{i}]"
        if not isinstance(item, Mapping):
            raise ValueError(f"{where} must be an object")
        name = item.get("name")
        if not isinstance(name, str) or len(name) > 63 or not re.match(NAME_PATTERN, name):
            raise ValueError(f"{where}.name must be lower-case letters, digits and '-' (at most 63), got {name!r:.40}")
        if name == DEFAULT_CLASS:
            raise ValueError(f"{where}.name: {DEFAULT_CLASS!r} is the class of slo's own ttftMs/tbtMs/e2eMs")
        classes.append(_class(where, name, item, _CLASS_KEYS))
    default_name = obj.get("defaultClass", DEFAULT_CLASS)
    if not isinstance(default_name, str):
        raise ValueError(f"slo.defaultClass must be a class name, got {default_name!r:.40}")
    return SloClasses(classes, default_name)


def load(flag: str | None = None, environ: Mapping[str, str] | None = None) -> SloClasses:
    """The server's classes: ``--slo-classes`` (inline JSON or a JSON file), else the environment
    variable the operator sets (``PDSERVE_SLO_CLASSES``), else one best-effort class ``default``."""
    environ = os.environ if environ is None else environ
    source, text = "--slo-classes", flag
    if not flag:
        source, text = ENV_SLO_CLASSES, environ.get(ENV_SLO_CLASSES)
    if not text or not text.strip():
        return parse(None)
    if not text.lstrip().startswith(("{", "[")):
        path = Path(text)
        try:
            source, text = str(path), path.read_text()
        except OSError as exc:
            raise ValueError(f"{source}: not JSON and not a readable file: {exc}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: invalid JSON: {exc}") from None
    try:
        return parse(obj)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
