"""RemotePrefill: a request whose KV is computed here and pushed elsewhere (the P/D prefill side).

A request kind, not a second path: the Scheduler admits, chunks and batches it as any prompt
(``scheduler.py``); what differs is what happens to its KV and its first token:

- after every layer of every step that wrote some of its prompt, ``on_layer(layer, block_ids,
  first)`` gets the prompt blocks ``[first, first + len(block_ids))`` whose KV for that layer is
  now complete: a block is handed over once per layer, when its last token's KV is written
  (the first step's call starts at block 0, prefix-cache hits included; the last step's call
  ends with the prompt's last, maybe partial, block), so the receiver sees every block of
  every layer exactly once, in block order per layer;
- when its last chunk is computed, its first token is sampled and ``on_done(token, None)`` is
  called; the request is then *held* (its blocks kept, in no queue) until ``release``;
- if ``on_layer`` raises, or the request is aborted or its step fails before that,
  ``on_done(None, error)`` is called once and its blocks are freed.

Admission by grant (``want``): a remote prefill whose KV has nowhere to go yet (no decode has
allocated blocks for it) waits in the Scheduler's line like any prompt, in its place, but is not
computed until ``granted``. When the Scheduler would admit it (or expects to in its next step:
``Scheduler.ask_ahead``) it calls ``want()`` once; the caller then asks a decode for blocks, binds
the push, and grants it (``PDHooks.grant``): from then on it is an ordinary remote prefill. So
which prompt a decode holds blocks for, and when, is the Scheduler's decision: at most about one
step's budget of prompt tokens ahead of what it computes, never a prompt stuck behind a backlog.

Both callbacks and ``want`` run on the thread that steps the engine. ``pushed`` counts the
leading prompt blocks already handed to ``on_layer`` (every layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .block_manager import blocks_needed

if TYPE_CHECKING:
    from .sequence import Sequence

OnLayer = Callable[[int, list[int], int], None]
OnDone = Callable[[int | None, BaseException | None], None]
Want = Callable[[], None]


class PrefillAborted(RuntimeError):
    """A remote prefill ended before its first token (aborted, or the engine stopped)."""


@dataclass(slots=True)
class RemotePrefill:
    on_layer: OnLayer | None
    on_done: OnDone | None
    pushed: int = 0  # leading prompt blocks handed to on_layer, every layer
    error: BaseException | None = None  # what on_layer raised (the request fails after the step)
    done: bool = False  # on_done was called
    want: Want | None = None  # called once when the Scheduler wants to compute it and it is not granted yet
    granted: bool = True  # may be computed (False: it waits in line for its grant; see the module)
    asked: bool = False  # want was called

    def ask(self) -> None:
        """Call ``want`` once. It must not raise; if it does, the error is kept and the request waits for its
        abort (it is never computed ungranted), so one caller's failure never stops a step."""
        if self.asked or self.granted:
            return
        self.asked = True
        if self.want is not None:
            try:
                self.want()
            except Exception as exc:  # noqa: BLE001 - kept; its caller aborts it
                self.error = exc

    def finish(self, token: int | None, error: BaseException | None) -> None:
        """Call ``on_done`` once."""
        if self.done:
            return
        self.done = True
        if self.on_done is not None:
            self.on_done(token, error)


def blocks_to_push(seq: Sequence, block_size: int) -> tuple[int, int]:
    """The prompt blocks ``[first, end)`` this step completes for a remote sequence: every block whose
    tokens are all computed once the step's ``num_new`` tokens are, the last partial block at the end."""
    assert seq.remote is not None
    done = seq.num_computed + seq.num_new
    n_prompt = len(seq.prompt_ids)
    end = blocks_needed(n_prompt, block_size) if done >= n_prompt else done // block_size
    return seq.remote.pushed, end


class LayerCallback:
    """The model's per-layer callback for one step: each remote sequence's newly complete blocks to its
    ``on_layer``; an error is kept on the sequence (the step goes on for the others). ``blocks``: every
    block id the step pushes through rank 0 (a tensor-parallel engine gathers them there first:
    ``tp/transfer.py``); ``direct``: some request's KV leaves from every rank's own pool (its ``on_layer``
    has a true ``kv_direct``: the per-rank push, ``tp/rank_pools.py``; the ranks only sync after each layer)."""

    def __init__(self, pushes: list[tuple[RemotePrefill, list[int], int]]):
        self.pushes = pushes
        direct = [getattr(remote.on_layer, "kv_direct", False) for remote, _, _ in pushes]
        self.blocks = sorted({b for (_, block_ids, _), d in zip(pushes, direct) if not d for b in block_ids})
        self.direct = any(direct)

    def fail(self, error: BaseException) -> None:
        """Every pushing request of the step fails after it (its KV is not handed over any more)."""
        for remote, _, _ in self.pushes:
            if remote.error is None:
                remote.error = error

    def __call__(self, layer: int) -> None:
        for remote, block_ids, first in self.pushes:
            if remote.error is None:
                try:
                    remote.on_layer(layer, list(block_ids), first)  # type: ignore[misc]
                except Exception as exc:  # noqa: BLE001 - this request fails after the step, the others go on
                    remote.error = exc


def layer_callback(batch: list[Sequence], block_size: int) -> LayerCallback | None:
    """The step's ``LayerCallback``; None when no remote sequence of the batch pushes anything this step."""
    pushes = []
    for seq in batch:
        if seq.remote is None or seq.remote.on_layer is None:
            continue
        first, end = blocks_to_push(seq, block_size)
        if end > first:
            pushes.append((seq.remote, list(seq.block_table[first:end]), first))
    return LayerCallback(pushes) if pushes else None
