"""The prefill's side of streams that outlive their prefill (``pdserve.stream_resume`` is the contract).

- ``resumable(parsed, headers)``: the request came with ``X-PDServe-Resumable: 1`` and is a stream
  that can be resumed (one choice: one prompt, ``n`` 1; no ``echo``; no tools): its events then
  carry their token ids (``tag``), which the router strips;
- ``parse_resume(body, parsed, vocab_size)``: the body's ``pdserve_resume`` as a ``Resume``, or None
  without one. It may come from any client, so it is checked like any other field: an object with
  ``token_ids`` (token ids of the vocabulary), ``id`` (a non-empty string), ``created`` (a
  non-negative integer) and optionally ``finish_reason`` (stop | length), on a request that can be
  resumed; ``Resume.check(sp)`` adds, once the request's max_tokens is known, that the tokens are
  not more than it. Anything else is a 400 whose ``param`` names the field. Whether the tokens are
  the ones the model would have produced is not checked: they are the client's own text, as a
  prompt is; the usage counts them as completion tokens, as the router's client received them;
- ``tag(payload, token_ids, **more)``: an event with the extension as its last key;
- ``grpc_resume(token_ids, sp, vocab_size)``: a gRPC GenerateRequest's ``resume_token_ids`` checked the
  same way (ids of the vocabulary, not more than max_tokens; INVALID_ARGUMENT naming the field); gRPC
  Generate is always one choice without echo or tools, so any stream of it can be resumed.

The continuation itself is the node's resume (``PrefillNode.generate(..., produced=...)``), the
text's the Frontend's (``Frontend.text_stream``), the response's ``openai_serving.start``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.stream_resume import EVENT_KEY, GRPC_RESUME_FIELD, RESUMABLE_HEADER, RESUME_FIELD

from .openai_numbers import INT64_MAX, BadRequest, check_token_ids

if TYPE_CHECKING:
    from pdserve.engine import SamplingParams

MAX_ID_CHARS = 256
FINISH_REASONS = ("stop", "length")
FIELDS = ("token_ids", "id", "created", "finish_reason")


@dataclass(frozen=True, slots=True)
class Resume:
    token_ids: list[int]  # the tokens the client received, in order
    id: str  # the stream's id, kept
    created: int  # the stream's created, kept
    finish_reason: str | None = None  # the finish event went out too: only the stream's end is left

    def check(self, sp: SamplingParams) -> None:
        """The tokens against the request's max_tokens (the engine's SamplingParams)."""
        _not_more_than_max_tokens(self.token_ids, sp, f"{RESUME_FIELD}.token_ids")


def _not_more_than_max_tokens(token_ids: list[int], sp: SamplingParams, name: str) -> None:
    if len(token_ids) > sp.max_tokens:
        raise BadRequest(f"{name} holds {len(token_ids)} tokens, more than the request's max_tokens "
                         f"({sp.max_tokens})", name)


def _why_not(parsed) -> str | None:
    """Why this request's stream cannot be resumed, or None."""
    if not parsed.stream:
        return "only a stream (stream: true) can be resumed"
    if len(parsed.prompts) > 1 or parsed.n != 1:
        return "a stream of several choices (n, a list of prompts) cannot be resumed"
    if parsed.echo:
        return "a stream with echo cannot be resumed"
    if parsed.tools and parsed.tool_choice != "none":
        return "a stream with tools cannot be resumed"
    return None


def resumable(parsed, headers) -> bool:
    return headers.get(RESUMABLE_HEADER) == "1" and _why_not(parsed) is None


def parse_resume(body: dict, parsed, vocab_size: int | None = None) -> Resume | None:
    field = body.get(RESUME_FIELD)
    if field is None:
        return None
    if not isinstance(field, dict):
        raise BadRequest(f"{RESUME_FIELD} must be an object {{\"token_ids\": [...], \"id\": ..., \"created\": ...}}",
                         RESUME_FIELD)
    unknown = sorted(set(field) - set(FIELDS))
    if unknown:
        raise BadRequest(f"{RESUME_FIELD} has unknown fields {unknown}; it takes {list(FIELDS)}", RESUME_FIELD)
    why = _why_not(parsed)
    if why is not None:
        raise BadRequest(f"{RESUME_FIELD}: {why}", RESUME_FIELD)
    if "token_ids" not in field:
        raise BadRequest(f"{RESUME_FIELD}.token_ids is missing", f"{RESUME_FIELD}.token_ids")
    token_ids = check_token_ids(field["token_ids"], f"{RESUME_FIELD}.token_ids", vocab_size)
    rid = field.get("id")
    if not isinstance(rid, str) or not rid or len(rid) > MAX_ID_CHARS or not rid.isprintable():
        raise BadRequest(f"{RESUME_FIELD}.id must be the stream's id: a non-empty printable string of at most "
                         f"{MAX_ID_CHARS} characters", f"{RESUME_FIELD}.id")
    created = field.get("created")
    if isinstance(created, bool) or not isinstance(created, int) or not 0 <= created <= INT64_MAX:
        raise BadRequest(f"{RESUME_FIELD}.created must be the stream's created: an integer in [0, {INT64_MAX}]",
                         f"{RESUME_FIELD}.created")
    finish = field.get("finish_reason")
    if finish is not None and finish not in FINISH_REASONS:
        raise BadRequest(f"{RESUME_FIELD}.finish_reason must be one of {list(FINISH_REASONS)} or absent, got "
                         f"{str(finish)[:40]!r}", f"{RESUME_FIELD}.finish_reason")
    return Resume(token_ids, rid, created, finish)


def tag(payload: dict, token_ids: list[int], **more) -> dict:
    """The event ``payload`` with the extension (its token ids, and ``more``) as its last key."""
    payload[EVENT_KEY] = {"token_ids": list(token_ids), **more}
    return payload


def grpc_resume(token_ids, sp: SamplingParams, vocab_size: int | None = None) -> list[int]:
    """A GenerateRequest's ``resume_token_ids`` (empty: not a resume), checked against the vocabulary and
    the request's max_tokens (the engine's SamplingParams)."""
    if not token_ids:
        return []
    ids = check_token_ids(list(token_ids), GRPC_RESUME_FIELD, vocab_size)
    _not_more_than_max_tokens(ids, sp, GRPC_RESUME_FIELD)
    return ids
