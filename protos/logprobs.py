"""TokenLogprob <-> the Session's ``TokenLogprob`` message (pure; duck-typed so protos imports
nothing else of pdserve: any object with ``token_id``, ``logprob`` and ``top`` ((id, logprob), ...))."""

from __future__ import annotations

from . import session_pb2 as pb


def logprob_to_proto(lp) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_ids=[t for t, _ in lp.top],
                           top_logprobs=[v for _, v in lp.top])


def logprob_fields(msg: pb.TokenLogprob) -> tuple[int, float, tuple[tuple[int, float], ...]]:
    """(token id, logprob, top) of a message, for the caller's own TokenLogprob type."""
    return msg.token_id, msg.logprob, tuple(zip(msg.top_ids, msg.top_logprobs))
