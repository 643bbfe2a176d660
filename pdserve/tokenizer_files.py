"""The tokenizer files a prefill hands to a router that mounts no model (``GET /tokenizer``).

A router only hashes prompts, so it needs only the files ``pdserve fetch-model --tokenizer-only``
downloads (``FILES``: ``model_fetch.allow_patterns(tokenizer_only=True)``, config and tokenizer,
no weights). A prefill serves the ones its ``--model`` directory holds
(``prefill_server/tokenizer_api.py``); ``pdserve router --tokenizer-from-prefill``
(``router/prefill_tokenizer.py``) writes them into a temporary directory and loads its tokenizer
from there, as ``--model DIR`` would. The operator starts a router that way when the model is on a
claim, so the router pod mounts no claim and may run on any node.

The answer (JSON, status 200)::

    {"version": 1, "model": "<the prefill's --model>", "files": {"tokenizer.json": "<base64>", ...}}

``files`` is empty for a built-in model (``--model`` is not a directory): a folder without
tokenizer.json loads the byte-level tokenizer, the built-in model's, as the engine does. The files
together are at most ``MAX_BYTES`` (before base64): a prefill refuses to send more (500,
``tokenizer_too_large``), a router to read more. ``unpack`` takes only names of ``FILES``, so an
answer cannot write outside its folder.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

from pdserve import model_fetch

ROUTE = "/tokenizer"
VERSION = 1
FILES = tuple(model_fetch.allow_patterns(tokenizer_only=True))  # plain names, no wildcards
MAX_BYTES = 64 * 2**20  # the largest tokenizer.json of common models is ~35 MB (Gemma 3)
MAX_ANSWER_BYTES = MAX_BYTES * 4 // 3 + 64 * 1024  # the same in base64, plus the JSON around it


class TokenizerFilesError(ValueError):
    """Files that cannot be sent or used as asked; the message says why, in one line."""


def pack(model: str) -> dict:
    """The answer for a server whose ``--model`` is ``model`` (reads the files; call it off the event loop)."""
    folder = Path(model)
    files: dict[str, str] = {}
    if folder.is_dir():
        total = 0
        for name in FILES:
            path = folder / name
            if not path.is_file():
                continue
            data = path.read_bytes()
            total += len(data)
            if total > MAX_BYTES:
                raise TokenizerFilesError(f"the tokenizer files of {model} exceed {MAX_BYTES // 2**20} MiB: start the "
                                          "router with --model on a copy of them instead of --tokenizer-from-prefill")
            files[name] = base64.b64encode(data).decode("ascii")
    return {"version": VERSION, "model": model, "files": files}


def unpack(doc: object, dest: Path) -> list[str]:
    """Write an answer's files into the folder ``dest``; their names, sorted (empty: the byte-level tokenizer)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
        raise TokenizerFilesError("the answer is not {\"version\", \"model\", \"files\": {name: base64}}")
    if doc.get("version") != VERSION:
        raise TokenizerFilesError(f"the answer has format version {doc.get('version')!r}, this router reads {VERSION}: "
                                  "run the same pdserve version on the router and the prefills")
    unknown = sorted(set(doc["files"]) - set(FILES))
    if unknown:
        raise TokenizerFilesError(f"the answer names files {unknown} outside {list(FILES)}")
    blobs = {}
    for name, text in doc["files"].items():
        try:
            blobs[name] = base64.b64decode(text, validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise TokenizerFilesError(f"file {name} of the answer is not base64") from None
    if sum(len(b) for b in blobs.values()) > MAX_BYTES:
        raise TokenizerFilesError(f"the answer's files exceed {MAX_BYTES // 2**20} MiB")
    for name, data in blobs.items():
        (dest / name).write_bytes(data)
    return sorted(blobs)
