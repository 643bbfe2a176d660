"""OutputProcessor: a sampled token -> the sequence's output, its stop check, its RequestOutput.

Contract for one generated token (``append_token``):

1. An EOS id (unless ``ignore_eos``) or a ``stop_token_ids`` id finishes the request with
   reason "stop"; the token is not part of the output.
2. Otherwise the token joins the output and its text is detokenized (when the sequence has a
   detokenizer). The text is cut before the earliest stop string (finish "stop", see
   ``stop_strings.py``); a tail that could start a stop string is held back until it can't.
3. ``max_tokens`` generated tokens, or a full context, finish the request with "length";
   any held-back text is then flushed.

Produced tokens and text accumulate in ``seq.pending_ids`` / ``seq.pending_text`` until
``take_output`` reports them (once per step) and clears them.
"""

from __future__ import annotations

from .sequence import RequestOutput, Sequence, Status
from .stop_strings import stop_cut


class OutputProcessor:
    def __init__(self, eos_ids: set[int], max_model_len: int):
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len

    def append_token(self, seq: Sequence, token: int, logprob=None) -> None:
        """Add one sampled token (and its TokenLogprob, when the request asked) to ``seq`` and finish
        it if it stops here (see the module contract). A grammar's matcher accepts the token."""
        sp = seq.sampling
        if seq.matcher is not None and (not seq.matcher.accept(token) or seq.matcher.done):
            # the grammar ended (it allowed only a stop token, not output), or a token that was not
            # sampled under its mask (a caller's first token) broke it
            finish(seq, "stop")
            return
        if (not sp.ignore_eos and token in self.eos_ids) or token in sp.stop_token_ids:
            finish(seq, "stop")
            return
        seq.append_output(token)
        seq.pending_ids.append(token)
        if sp.logprobs is not None:
            seq.pending_logprobs.append(logprob)
        if seq.detok is not None:
            seq.detok.add([token])
            text = seq.detok.text
            end, stopped = stop_cut(text, sp.stop)
            if stopped:
                seq.pending_text += text[seq.emitted_len : end]
                seq.emitted_len = end
                finish(seq, "stop")
                return
            end = max(seq.emitted_len, end)
            seq.pending_text += text[seq.emitted_len : end]
            seq.emitted_len = end
        if len(seq.output_ids) >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            finish(seq, "length")


def finish(seq: Sequence, reason: str) -> None:
    """Mark ``seq`` finished; unless a stop string ended it, flush the text the detokenizer held."""
    seq.status, seq.finish_reason = Status.FINISHED, reason
    if seq.detok is not None and reason != "stop":
        seq.detok.flush()
        seq.pending_text += seq.detok.text[seq.emitted_len :]
        seq.emitted_len = len(seq.detok.text)


def take_output(seq: Sequence) -> RequestOutput:
    """What ``seq`` produced since its last output (then cleared)."""
    out = RequestOutput(
        request_id=seq.request_id,
        new_token_ids=seq.pending_ids,
        finished=seq.status is Status.FINISHED,
        finish_reason=seq.finish_reason if seq.status is Status.FINISHED else None,
        text=seq.pending_text,
        num_prompt_tokens=len(seq.prompt_ids),
        num_cached_tokens=seq.num_cached_tokens,
        logprobs=seq.pending_logprobs if seq.sampling.logprobs is not None else None,
    )
    if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent and not seq.needs_prompt_logits:
        out.prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True  # once, with the first output
    seq.pending_ids, seq.pending_text, seq.pending_logprobs = [], "", []
    return out
