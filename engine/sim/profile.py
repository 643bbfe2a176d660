"""SimProfile: a model's shape and its engine step time, fitted from measurements, as one JSON file.

The format (``"format": "pdserve-sim-profile/1"``; every other key below is required unless marked)::

    {
      "format": "pdserve-sim-profile/1",
      "name": "cpu-small",                      # what logs and reports call it
      "source": "what was measured, where, when and how (free text; the fit's residuals)",
      "model": {                                # the shape the KV pool and the CacheStore handshake take
        "num_layers": 8, "num_kv_heads": 4, "head_dim": 32, "dtype": "float32",
        "vocab_size": 258, "context_length": 16384, "eos_token_ids": [257]
      },
      "step": {                                 # seconds of one engine step (one forward over its batch)
        "base_s": 0.004,                        #   every step
        "prefill_token_s": 2e-05,               #   per prompt token computed
        "prefill_pair_s": 1e-09,                #   per (new token, token it attends to) pair of a prompt chunk
        "decode_seq_s": 0.0002,                 #   per decode row
        "decode_context_token_s": 1e-07         #   per token of context a decode row reads
      },
      "fit": {...}                              # optional: the samples' count and error (fit.py writes it)
    }

A step with prefill chunks ``(new_i, cached_i)`` and decode rows of contexts ``ctx_j`` lasts::

    base_s + sum_i(prefill_token_s * new_i + prefill_pair_s * new_i * (cached_i + (new_i + 1) / 2))
           + sum_j(decode_seq_s + decode_context_token_s * ctx_j)

so ``prefill_s(new, cached)`` is a step of one chunk and ``decode_s(batch, context)`` a step of
``batch`` rows of ``context`` tokens each. KV bytes per token follow from the shape: K and V of every
layer, ``2 * num_layers * num_kv_heads * head_dim * bytes(dtype)`` (the runtime sizes the pool from it,
``pdserve/kv_sizing.py``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT = "pdserve-sim-profile/1"
STEP_TERMS = ("base_s", "prefill_token_s", "prefill_pair_s", "decode_seq_s", "decode_context_token_s")
MODEL_INTS = ("num_layers", "num_kv_heads", "head_dim", "vocab_size", "context_length")
# bytes per K/V element of each model dtype (the CacheStore's DTYPE_BYTES holds the same for the wire; the
# engine imports no cachestore)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"  # the profiles shipped with pdserve (by name)


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True, slots=True)
class SimModel:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...] = ()

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class StepTime:
    base_s: float
    prefill_token_s: float
    prefill_pair_s: float
    decode_seq_s: float
    decode_context_token_s: float

    def step_s(self, prefills: list[tuple[int, int]], decode_contexts: list[int]) -> float:
        """Seconds of one step: prefill chunks ``(new, cached)`` and decode rows of these contexts."""
        t = self.base_s
        for new, cached in prefills:
            t += self.prefill_token_s * new + self.prefill_pair_s * new * (cached + (new + 1) / 2)
        return t + self.decode_seq_s * len(decode_contexts) + self.decode_context_token_s * sum(decode_contexts)

    def prefill_s(self, new: int, cached: int = 0) -> float:
        return self.step_s([(new, cached)], [])

    def decode_s(self, batch: int, context: int) -> float:
        return self.step_s([], [context] * batch)


@dataclass(frozen=True, slots=True)
class SimProfile:
    name: str
    source: str
    model: SimModel
    step: StepTime
    fit: dict = field(default_factory=dict)

    def to_json(self) -> str:
        doc = {"format": FORMAT, **asdict(self)}
        doc["model"]["eos_token_ids"] = list(self.model.eos_token_ids)
        return json.dumps(doc, indent=2) + "\n"


def load_profile(where: str | Path) -> SimProfile:
    """A profile from a JSON file, or by the name of one shipped in ``profiles/`` ("cpu-small")."""
    path = Path(where)
    if not path.is_file() and (PROFILES_DIR / f"{where}.json").is_file():
        path = PROFILES_DIR / f"{where}.json"
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.json")))
        raise ProfileError(f"sim profile {str(where)!r}: no such file, nor a shipped profile ({shipped})")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ProfileError(f"sim profile {path}: not JSON: {exc}") from None
    return parse_profile(doc, str(path))


def parse_profile(doc: object, where: str = "profile") -> SimProfile:
    """A SimProfile from the parsed JSON; ProfileError naming ``where`` and the field that is wrong."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ProfileError(f"sim profile {where}: \"format\" must be {FORMAT!r}, got {got!r}")
    model, step = doc.get("model"), doc.get("step")
    if not isinstance(model, dict) or not isinstance(step, dict):
        raise ProfileError(f"sim profile {where}: needs the objects \"model\" and \"step\"")
    for key in MODEL_INTS:
        value = model.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ProfileError(f"sim profile {where}: model.{key} must be a positive integer, got {value!r}")
    if model.get("dtype") not in DTYPE_BYTES:
        raise ProfileError(f"sim profile {where}: model.dtype must be one of {', '.join(DTYPE_BYTES)}, "
                           f"got {model.get('dtype')!r}")
    eos = model.get("eos_token_ids", [])
    if not isinstance(eos, list) or not all(isinstance(t, int) and 0 <= t < model["vocab_size"] for t in eos):
        raise ProfileError(f"sim profile {where}: model.eos_token_ids must be token ids below vocab_size, got {eos!r}")
    for key in STEP_TERMS:
        value = step.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 3600:
            raise ProfileError(f"sim profile {where}: step.{key} must be seconds >= 0, got {value!r}")
    shape = SimModel(**{k: model[k] for k in MODEL_INTS}, dtype=model["dtype"], eos_token_ids=tuple(eos))
    return SimProfile(str(doc.get("name") or Path(where).stem), str(doc.get("source", "")), shape,
                      StepTime(**{k: float(step[k]) for k in STEP_TERMS}), dict(doc.get("fit") or {}))
