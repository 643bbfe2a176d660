"""vLLM's logprobs in pdserve's shape (``pdserve.engine.logprobs.TokenLogprob``); imports no vLLM.

vLLM reports a position's logprobs as a dict ``{token id: Logprob(logprob, rank, ...)}`` holding the
chosen token (first, with its rank in the whole vocabulary) and the ``k`` most likely tokens (ranks
1..k; the chosen one appears once if it is among them). Its default ``logprobs_mode`` is
``raw_logprobs``: the log-softmax of the raw logits, before temperature and filters, as the built-in
engine reports them. ``token_logprob`` turns one such dict into a TokenLogprob (``top``: the k most
likely, most likely first); ``prompt_logprobs`` turns vLLM's prompt logprobs (None for the first
prompt token) into the built-in engine's list.
"""

from __future__ import annotations

from pdserve.engine.logprobs import TokenLogprob


def token_logprob(token_id: int, position: dict, k: int) -> TokenLogprob:
    """The TokenLogprob of ``token_id`` from vLLM's dict of one position, with its top ``k``."""
    if token_id not in position:
        raise ValueError(f"vLLM reported no logprob for token {token_id} (it has {sorted(position)})")
    top = sorted(((t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= k),
                 key=lambda item: (item[1].rank, -item[1].logprob))
    return TokenLogprob(token_id, float(position[token_id].logprob), tuple((t, float(lp.logprob)) for t, lp in top[:k]))


def sample_logprobs(token_ids: list[int], positions, k: int | None) -> list[TokenLogprob] | None:
    """One TokenLogprob per generated token (None when the request asked for none)."""
    if k is None or positions is None:
        return None
    if len(positions) != len(token_ids):
        raise ValueError(f"vLLM reported logprobs of {len(positions)} positions for {len(token_ids)} tokens")
    return [token_logprob(t, pos, k) for t, pos in zip(token_ids, positions)]


def prompt_logprobs(prompt_ids: list[int], positions, k: int | None) -> list[TokenLogprob | None] | None:
    """The built-in engine's prompt logprobs: None for the first prompt token, then each token's TokenLogprob
    given those before it (None when the request asked for none)."""
    if k is None or positions is None:
        return None
    if len(positions) != len(prompt_ids):
        raise ValueError(f"vLLM reported prompt logprobs of {len(positions)} positions for {len(prompt_ids)} tokens")
    return [None if pos is None else token_logprob(t, pos, k) for t, pos in zip(prompt_ids, positions)]
