"""API keys: the key file's format, and matching a presented key in constant time (pure, no I/O but
``load``). The HTTP side (the 401, the flags, which paths stay open) is ``http_auth.py``.

The key file (``--api-key-file``, ``--metrics-key-file``; in Kubernetes the key of the Secret that
``spec.auth`` names): one key a line, surrounding spaces ignored, blank lines and lines starting
with ``#`` ignored (a ``#`` later in a line is part of the key)::

    # the team's keys
    alice:sk-3f9c1e...        <- name "alice": requests are counted under it
    sk-77aa01...              <- no name: counted under "key-" + the first 8 hex digits of its SHA-256

A line with a ``:`` is ``name:key`` (split at the first ``:``, so a key that itself holds a ``:``
must be given a name). Names are ``NAME_PATTERN`` and unique; keys hold no spaces and are unique.
Errors name the file and the line, never the key.

The name is what the metrics and the logs show of a key: the key itself is never shown (``ApiKey``'s
repr hides it). A name is better than the derived id: an id of a short or guessable key can be
brute-forced from its hash.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field
from pathlib import Path

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}"
_NAME = re.compile(NAME_PATTERN)
_KEY = re.compile(r"[\x21-\x7e]+")  # printable ASCII without spaces: what a Bearer token may hold


class KeyFileError(ValueError):
    """A key file that cannot be used; the message is one line naming the file (never a key)."""


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str  # what metrics and logs show
    secret: bytes = field(repr=False)


def derived_name(secret: str) -> str:
    """The name of a key given without one: ``key-`` + the first 8 hex digits of its SHA-256."""
    return "key-" + hashlib.sha256(secret.encode()).hexdigest()[:8]


def parse(text: str, source: str) -> tuple[ApiKey, ...]:
    """The keys of a key file's ``text``; ``source`` (its path) names it in errors."""
    keys: list[ApiKey] = []
    lines_of: dict[bytes, int] = {}
    names: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, secret = line.partition(":")
        if not sep:
            name, secret = derived_name(line), line
        elif not _NAME.fullmatch(name):
            raise KeyFileError(f"{source}, line {number}: the name before ':' must match {NAME_PATTERN}")
        if not _KEY.fullmatch(secret):
            raise KeyFileError(f"{source}, line {number}: a key must be printable ASCII without spaces, not empty")
        if name in names:
            raise KeyFileError(f"{source}, line {number}: the name {name!r} is already on line {names[name]}")
        if secret.encode() in lines_of:
            raise KeyFileError(f"{source}, line {number}: the same key as line {lines_of[secret.encode()]}")
        names[name], lines_of[secret.encode()] = number, number
        keys.append(ApiKey(name, secret.encode()))
    if not keys:
        raise KeyFileError(f"{source}: no keys in the file (one key a line; blank lines and # comments are ignored)")
    return tuple(keys)


def load(path: str | Path) -> tuple[ApiKey, ...]:
    """The keys of the file at ``path``; KeyFileError (one line naming the file) when it cannot be read or holds
    no keys."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise KeyFileError(f"{path}: cannot read the key file: {reason}") from None
    return parse(text, str(path))


class ApiKeys:
    """A set of keys; ``match`` says which one a presented key is, comparing with every key in constant time."""

    def __init__(self, keys: tuple[ApiKey, ...]):
        if not keys:
            raise ValueError("ApiKeys needs at least one key")
        self.keys = keys

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.keys)

    def match(self, presented: str) -> ApiKey | None:
        """The key equal to ``presented``, or None. Every key is compared (hmac.compare_digest), so the time
        taken says nothing about which key, or how much of one, matched."""
        candidate = presented.encode("utf-8", "replace")
        found = None
        for key in self.keys:
            if hmac.compare_digest(key.secret, candidate):
                found = key
        return found

    def first(self) -> bytes:
        """A key this process presents itself (the router asking a prefill for its tokenizer)."""
        return self.keys[0].secret
