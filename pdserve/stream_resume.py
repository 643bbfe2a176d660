"""Streams that outlive their prefill (issue 32): the wire contract between the router and the prefills.

The router (``router/resume.py``) relays a prefill's SSE stream to the client; the prefill
(``prefill_server/resume.py``) writes it. When the relaying prefill dies mid-stream, the router
asks another prefill to continue the stream where the client's copy ends. The names below are
the one place these facts are written; both sides import them.

1. ``RESUMABLE_HEADER: 1`` on a request: the sender (the router) can resume the stream. The
   prefill then adds ``EVENT_KEY`` as the LAST key of every event of a stream it can resume (one
   choice, no ``echo``, no tools: the others never carry it):

       token event   ..., "pdserve": {"token_ids": [t]}}
       finish event  ..., "pdserve": {"token_ids": [], "finish_reason": "length"}}
       usage event   ..., "pdserve": {"token_ids": [], "usage": true}}

   (JSON without spaces, as the prefill writes every event). The router cuts ``,"pdserve":{...}``
   out of each event before the client gets it: the client's bytes are the prefill's bytes
   without the extension. Error events and ``[DONE]`` never carry it.
2. ``RESUME_FIELD`` in a request body (the original body otherwise unchanged):

       "pdserve_resume": {"token_ids": [...], "id": "cmpl-...", "created": 1700000000,
                          "finish_reason": "length"}        # only when the finish event was relayed

   ``token_ids``: every token the client received, in order; ``id`` / ``created``: the stream's
   own, kept by the continuation. The prefill continues the stream as if it had sent those
   events itself: prompt + ``token_ids`` as the prompt, ``max_tokens`` less them, the same
   sampling and seed (the sampler's position offset by them), stop strings over the text already
   sent plus the new, no second chat role, usage as ONE request (the original prompt's tokens;
   completion tokens of both parts; ``cached_tokens`` what the continuing prefill's prefix cache
   held of the original prompt, which may differ from the first prefill's). With
   ``finish_reason`` nothing is generated: only what follows the finish event (the usage event
   when asked, then ``[DONE]``). A prefill validates the field like any other (400 naming it):
   it may come from any client.
3. gRPC ``Generate`` (``protos/generate.proto``): every GenerateResponse already carries its token
   ids, so nothing is added to the responses. ``GRPC_RESUME_FIELD`` (``resume_token_ids``) in a
   GenerateRequest (the original request otherwise unchanged, ``request_id`` the stream's own) continues
   a stream as ``RESUME_FIELD`` does: its responses are the rest of the uninterrupted stream's, the same
   ``request_id``, ``completion_tokens`` counting the tokens the client had, ``prompt_tokens`` the
   original prompt's. A stream ends with its finish response, so a resume never needs a finish reason.
   Validated like any other field (INVALID_ARGUMENT naming it).
"""

from __future__ import annotations

RESUMABLE_HEADER = "X-PDServe-Resumable"
EVENT_KEY = "pdserve"
RESUME_FIELD = "pdserve_resume"
GRPC_RESUME_FIELD = "resume_token_ids"
