"""The Batch API's input checks (pure): an uploaded file, a batch's parameters, each input line.

An upload is refused whole (HTTP 400) only when it cannot be a batch input at all: over the
size limit, empty, not UTF-8 text, more than ``MAX_LINES`` lines, or not JSONL (no line of it
is a JSON object). Anything wrong with a single line is that line's error in the batch's
error file, and the other lines run (``split_lines``): not JSON, no string ``custom_id``, a
``custom_id`` seen before, a method other than POST, a url other than the batch's endpoint,
no ``body`` object, or ``stream: true``.
"""

from __future__ import annotations

import json

from .store import error_line

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_LINES = 50_000  # as OpenAI
MAX_METADATA_KEYS = 16


class BatchInputError(ValueError):
    """Refused whole: HTTP 400 with this message, ``code`` and ``param``."""

    def __init__(self, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.message, self.code, self.param = message, code, param


def _nonblank(text: str) -> list[tuple[int, str]]:
    return [(i, line) for i, line in enumerate(text.split("\n"), 1) if line.strip()]


def check_upload(content: bytes, max_bytes: int) -> None:
    """BatchInputError unless ``content`` can be a batch input file (see the module docstring)."""
    if len(content) > max_bytes:
        raise BatchInputError(f"file is larger than this server's limit of {max_bytes} bytes (--batch-max-file-bytes)",
                              "file_too_large", "file")
    if not content.strip():
        raise BatchInputError("file is empty; a batch input file is JSONL: one request object a line", "empty_file",
                              "file")
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BatchInputError(f"file is not UTF-8 text (byte {exc.start}); a batch input file is JSONL: one request "
                              f"object a line", "invalid_file_format", "file") from None
    lines = _nonblank(text)
    if len(lines) > MAX_LINES:
        raise BatchInputError(f"file has {len(lines)} lines; a batch takes at most {MAX_LINES}", "too_many_lines",
                              "file")
    for _, line in lines:
        try:
            if isinstance(json.loads(line), dict):
                return
        except ValueError:
            continue
    raise BatchInputError(f"file is not JSONL: none of its {len(lines)} non-blank lines is a JSON object",
                          "invalid_file_format", "file")


def check_batch_params(body: dict) -> tuple[str, str, str, dict | None]:
    """POST /v1/batches's body -> (input_file_id, endpoint, completion_window, metadata)."""
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str) or not file_id:
        raise BatchInputError("missing required field 'input_file_id' (the id of a file uploaded with purpose batch)",
                              "missing_required_parameter", "input_file_id")
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise BatchInputError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {str(endpoint)[:60]!r}",
                              "invalid_endpoint", "endpoint")
    window = body.get("completion_window")
    if window not in COMPLETION_WINDOWS:
        raise BatchInputError(f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}, got "
                              f"{str(window)[:20]!r}", "invalid_completion_window", "completion_window")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_KEYS or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items())):
        raise BatchInputError(f"metadata must be an object of at most {MAX_METADATA_KEYS} string keys (at most 64 "
                              f"characters) and string values (at most 512)", "invalid_metadata", "metadata")
    return file_id, endpoint, window, metadata


def split_lines(content: bytes, endpoint: str) -> list[tuple[str | None, str | None, dict | None]]:
    """The input file's lines: (custom_id, request body as JSON text, None) to run, or
    (custom_id or None, None, the error file's line) for a bad one."""
    out: list[tuple[str | None, str | None, dict | None]] = []
    seen: set[str] = set()
    for line_no, line in _nonblank(content.decode("utf-8", errors="replace")):
        custom_id = None

        def bad(code: str, message: str):
            out.append((custom_id, None, error_line(custom_id, {"code": code, "message": f"line {line_no}: {message}",
                                                                "line": line_no})))

        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as exc:
            bad("invalid_json_line", f"not valid JSON ({str(exc)[:100]})")
            continue
        if not isinstance(obj, dict):
            bad("invalid_json_line", f"must be a JSON object, got {type(obj).__name__}")
            continue
        if isinstance(obj.get("custom_id"), str) and obj["custom_id"]:
            custom_id = obj["custom_id"]
        else:
            bad("missing_custom_id", "custom_id must be a non-empty string")
            continue
        if custom_id in seen:
            bad("duplicate_custom_id", f"custom_id {custom_id[:64]!r} appears on an earlier line (the first one runs)")
            continue
        seen.add(custom_id)
        if obj.get("method") != "POST":
            bad("invalid_method", f"method must be POST, got {str(obj.get('method'))[:20]!r}")
        elif obj.get("url") != endpoint:
            bad("mismatched_url", f"url {str(obj.get('url'))[:60]!r} is not the batch's endpoint {endpoint}")
        elif not isinstance(obj.get("body"), dict):
            bad("missing_body", "body must be a JSON object (the request to run)")
        elif obj["body"].get("stream") not in (None, False):
            bad("invalid_body", "stream is not supported in a batch")
        else:
            out.append((custom_id, json.dumps(obj["body"]), None))
    return out
