"""TokenLogprob: the log-probability of one generated token and its top alternatives (torch-free).

Logprobs are the model's raw distribution at that position (log-softmax of the logits, before
temperature, top-k/top-p and any grammar mask), as vLLM reports them by default. They travel
with their token: from the engine in ``RequestOutput.logprobs``, from prefill to decode's client
in the Session (the first token's is sampled on prefill, the rest on decode).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = field(default=())  # (token id, logprob), most likely first


MAX_LOGPROBS = 20  # alternatives per token a request may ask for
