"""The prefill server's client gRPC API: ``Generator.Generate`` (server streaming).

One GenerateResponse per generated token (its ``text`` may be "", see http_api.py's
streaming rules), then a last one with ``finish_reason`` set and no token.

Status codes: INVALID_ARGUMENT for bad input (message names the field) and for a request
larger than any decode's whole KV pool, RESOURCE_EXHAUSTED when the admission queue is
full, UNAVAILABLE when no decode could take the request and local fallback is off
(message lists the reasons),
ABORTED when a decode failed after tokens were streamed, DEADLINE_EXCEEDED when the
request's deadline passed: ``--request-timeout``, shortened by the client's own gRPC
deadline (``context.time_remaining()``; we stop a little before it, so that our message
arrives and the Session to decode is released by us). A client that cancels its call
cancels this coroutine; the Session to decode is closed and both ends free the request.
The SLO class comes from the call's metadata ``x-slo-class`` (unknown: INVALID_ARGUMENT
naming the known classes); early rejection is RESOURCE_EXHAUSTED with the estimate.

A request with ``resume_token_ids`` continues a stream another prefill began (a router resuming it
after that prefill died; ``resume.py``, the contract ``pdserve.stream_resume``): the Frontend's
``stream(..., produced=...)``, as for HTTP; ``completion_tokens`` counts those tokens, the responses keep
the request's ``request_id``, and the request runs here under an id of its own (the first prefill's
may still be on the decode).
"""

from __future__ import annotations

import uuid

import grpc

from pdserve.protos import generate_pb2 as gpb
from pdserve.protos import generate_pb2_grpc as gpb_grpc
from pdserve.slo import HEADER, Rejected

from .closing import aclose_fully
from .decode_session import DecodeFailed
from .frontend import RequestTimedOut
from .node import NoDecodeAvailable, QueueFull, RequestTooLarge

# End this much before the client's gRPC deadline, so DEADLINE_EXCEEDED carries our message.
CLIENT_DEADLINE_MARGIN_S = 0.05
SLO_METADATA = HEADER.lower()  # x-slo-class: the request's SLO class, as the HTTP header
from .openai_api import BadRequest, check_token_ids, parse_sampling
from .resume import grpc_resume


class GenerateServicer(gpb_grpc.GeneratorServicer):
    def __init__(self, frontend):
        self.fe = frontend

    def _parse(self, req: gpb.GenerateRequest):
        fe = self.fe
        if req.model and req.model != fe.model_name:
            raise BadRequest(f"model {req.model!r} does not exist; this server serves {fe.model_name!r}", "model")
        if req.prompt_token_ids:
            ids = check_token_ids(list(req.prompt_token_ids), "prompt_token_ids", fe.vocab_size)
        elif req.prompt:
            ids = fe.tokenizer.encode(req.prompt)
        else:
            raise BadRequest("one of prompt or prompt_token_ids is required", "prompt")
        fe.check_prompt(ids)
        # the same table of ranges as the OpenAI endpoints; proto3 defaults mean "unset"
        spec = parse_sampling({
            "max_tokens": req.max_tokens or None,  # 0 = server default (negative: refused)
            "temperature": req.temperature if req.HasField("temperature") else None,
            "top_p": req.top_p if req.HasField("top_p") else None,
            "top_k": req.top_k, "seed": req.seed if req.HasField("seed") else None,
            "stop": list(req.stop), "stop_token_ids": list(req.stop_token_ids), "ignore_eos": req.ignore_eos,
        }, ("max_tokens",), fe.max_model_len, fe.vocab_size)
        return ids, fe.sampling(spec, len(ids))

    async def Generate(self, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            ids, sp = self._parse(request)
            resumed = grpc_resume(request.resume_token_ids, sp, self.fe.vocab_size)
            slo_class = self.fe.slo_class(dict(context.invocation_metadata() or ()).get(SLO_METADATA))
        except BadRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
        request_id = request.request_id or uuid.uuid4().hex
        remaining = context.time_remaining()  # None without a client deadline
        timeout_s = None if remaining is None else max(0.001, remaining - CLIENT_DEADLINE_MARGIN_S)
        run_id = uuid.uuid4().hex if resumed else request_id  # a resumed stream's own id here (see the module doc)
        pieces = self.fe.stream(run_id, ids, sp, timeout_s, slo_class, produced=resumed)
        produced, cached = len(resumed), 0
        try:
            async for piece in pieces:
                produced += len(piece.token_ids)
                if piece.cached_tokens is not None:
                    cached = min(piece.cached_tokens, len(ids))
                yield gpb.GenerateResponse(
                    request_id=request_id, token_ids=piece.token_ids, text=piece.text,
                    finish_reason=piece.finish_reason or "", prompt_tokens=len(ids), completion_tokens=produced,
                    cached_tokens=cached,
                )
        except BadRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
        except RequestTooLarge as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Rejected as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except NoDecodeAvailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except DecodeFailed as exc:
            await context.abort(grpc.StatusCode.ABORTED, str(exc))
        except RequestTimedOut as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        finally:
            await aclose_fully(pieces)
