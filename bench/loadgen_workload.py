"""What the load generator sends and when: request lengths, prompts and arrival times.

Pure functions (no I/O but reading a dataset file), so they are unit-tested without a server.

Lengths come from one of four sources:

- ``synthetic`` (default): log-normal prompt and output lengths (long-tailed: most requests
  are short, a few are very long), given a median and a spread, clipped to [min, max].
- ``jsonl``: one JSON object per line, ``{"prompt_tokens": 812, "output_tokens": 64}``.
- ``random``: every request has exactly the given prompt and output lengths; prompts are
  random token ids drawn from a tokenizer's vocabulary (its special tokens left out), or
  below a vocabulary size, as in vLLM's random dataset.
- ``sharegpt``: the ShareGPT format, a JSON list of ``{"conversations": [{"from": "human",
  "value": ...}, {"from": "gpt", "value": ...}, ...]}``; the first human turn is the prompt
  and the first reply after it gives the output length. Token counts are estimated as
  characters / 4 (the server's usage report gives the true prompt length afterwards).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

CHARS_PER_TOKEN = 4  # estimate for text whose tokenizer we do not load
# Words that are one token in common BPE vocabularies; prompts are built from them.
_WORDS = ("time person year way day thing man world life hand part child eye woman place work week "
          "case point number group problem fact river stone light water green table paper music "
          "field north south east west bread glass horse cloud summer winter garden window").split()


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request: its prompt (text, or token ids when prompt_ids is set) and lengths."""

    prompt_tokens: int
    output_tokens: int
    prompt: str = ""
    prompt_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1, got {self.output_tokens}")


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """Log-normal lengths with the given median; sigma is the spread of log(length)."""

    median: int
    sigma: float
    minimum: int
    maximum: int

    def __post_init__(self) -> None:
        if not 1 <= self.minimum <= self.median <= self.maximum:
            raise ValueError(f"need 1 <= min ({self.minimum}) <= median ({self.median}) <= max ({self.maximum})")
        if self.sigma < 0:
            raise ValueError(f"sigma must be >= 0, got {self.sigma}")

    def sample(self, rng: random.Random) -> int:
        value = int(round(math.exp(rng.gauss(math.log(self.median), self.sigma))))
        return max(self.minimum, min(self.maximum, value))


def make_prompt(n_tokens: int, rng: random.Random, tag: int) -> str:
    """About n_tokens words of text; it starts with a unique tag so no two prompts share a prefix."""
    words = [f"r{tag}"] + [rng.choice(_WORDS) for _ in range(max(0, n_tokens - 1))]
    return " ".join(words)


def make_prompt_ids(n_tokens: int, rng: random.Random, vocab_size: int) -> tuple[int, ...]:
    """n_tokens random token ids in [1, vocab_size) (0 is avoided: often a special token)."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    return tuple(rng.randrange(1, vocab_size) for _ in range(n_tokens))


def tokenizer_prompt_ids(path: str | Path) -> list[int]:
    """The ids random prompts are drawn from: a tokenizer.json's vocabulary without its special tokens.

    path is the tokenizer.json or a model directory holding one."""
    from tokenizers import Tokenizer

    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise ValueError(f"--tokenizer {path}: no tokenizer.json there")
    tok = Tokenizer.from_file(str(file))
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    ids = [i for i in range(tok.get_vocab_size(with_added_tokens=True)) if i not in special]
    if not ids:
        raise ValueError(f"--tokenizer {path}: every token is a special token")
    return ids


def random_requests(n: int, prompt_tokens: int, output_tokens: int, rng: random.Random,
                    pool: list[int]) -> list[RequestSpec]:
    """n requests of exactly these lengths whose prompts are ids drawn uniformly from pool."""
    if not pool:
        raise ValueError("no token ids to draw prompts from")
    return [RequestSpec(prompt_tokens, output_tokens, prompt_ids=tuple(rng.choice(pool) for _ in range(prompt_tokens)))
            for _ in range(n)]


def synthetic_lengths(n: int, prompt: LengthDistribution, output: LengthDistribution,
                      rng: random.Random) -> list[tuple[int, int]]:
    return [(prompt.sample(rng), output.sample(rng)) for _ in range(n)]


def jsonl_lengths(path: Path) -> list[tuple[int, int]]:
    """(prompt_tokens, output_tokens) per line of a JSONL file; errors name the line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                p, o = row["prompt_tokens"], row["output_tokens"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: expected {{\"prompt_tokens\": int, "
                                 f"\"output_tokens\": int}}: {e}") from None
            if not (isinstance(p, int) and isinstance(o, int) and p >= 1 and o >= 1):
                raise ValueError(f"{path}:{lineno}: prompt_tokens and output_tokens must be integers >= 1")
            out.append((p, o))
    if not out:
        raise ValueError(f"{path}: no requests in the file")
    return out


def sharegpt_requests(path: Path, max_prompt_tokens: int, max_output_tokens: int) -> list[RequestSpec]:
    """Prompts (first human turn) and output lengths (the reply) from a ShareGPT JSON file."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: ShareGPT files are a JSON list of conversations")
    out = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            continue
        for first, second in zip(turns, turns[1:]):
            if first.get("from") == "human" and second.get("from") in ("gpt", "assistant"):
                text, reply = str(first.get("value", "")), str(second.get("value", ""))
                p = max(1, len(text) // CHARS_PER_TOKEN)
                o = max(1, len(reply) // CHARS_PER_TOKEN)
                if text.strip() and p <= max_prompt_tokens:
                    out.append(RequestSpec(prompt_tokens=p, output_tokens=min(o, max_output_tokens), prompt=text))
                break
    if not out:
        raise ValueError(f"{path}: no usable conversations (a human turn followed by a gpt turn)")
    return out


def build_requests(lengths: list[tuple[int, int]], rng: random.Random,
                   vocab_size: int | None = None) -> list[RequestSpec]:
    """Turn lengths into requests with prompts (text, or token ids when vocab_size is given)."""
    out = []
    for i, (p, o) in enumerate(lengths):
        if vocab_size:
            out.append(RequestSpec(p, o, prompt_ids=make_prompt_ids(p, rng, vocab_size)))
        else:
            out.append(RequestSpec(p, o, prompt=make_prompt(p, rng, tag=i)))
    return out


def arrival_times(n: int, rate: float, process: str, rng: random.Random) -> list[float]:
    """Offsets in seconds from the start at which each of n requests is sent.

    process 'poisson': exponential gaps with mean 1/rate; 'fixed': gaps of exactly 1/rate.
    rate = inf sends everything at once.
    """
    if process not in ("poisson", "fixed"):
        raise ValueError(f"arrival process must be 'poisson' or 'fixed', got {process!r}")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate) if process == "poisson" else 1.0 / rate
    return out
