"""What one NIXL WRITE carries: chunks grouped per layer, runs merged, descriptors built (pure).

A nixl link's data thread (``nixl_link.py``) pops chunks from the link's scheduler; the
chunks of one layer (a ``Transfer``: one ``store()`` call) come back together here, so a
layer goes as ONE WRITE with ONE notification record, whatever chunk size the scheduler
cut it into:

- ``merge_runs_ordered(runs)``: ``(src, dst, count)`` ranges in order; a range that continues
  the previous one on BOTH sides (src and dst each exactly adjacent) is merged into it. Used
  for block slices (units of blocks) and for descriptors (units of bytes).
- ``group_layers(chunks)``: ``[(transfer, merged slices)]``, one entry per transfer, in the
  order of its first chunk (MoLink may put a short transfer between two chunks of a long one).
- ``layer_descriptors(...)``: ``(local address, remote address, nbytes)`` of one layer's
  slices in the two registered regions (``[layer, block]`` layout on both sides, each with
  its own block count), merged where adjacent on both sides: the WRITE's descriptor lists.

No NIXL, no threads: unit-tested in ``tests/unit/test_cachestore_nixl_plan.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:
    from .scheduler import Chunk, Transfer


def merge_runs_ordered(runs: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge ``(src, dst, count)`` ranges, in order, where one continues the previous on both sides."""
    out: list[list[int]] = []
    for src, dst, count in runs:
        if count <= 0:
            continue
        if out:
            last = out[-1]
            if last[0] + last[2] == src and last[1] + last[2] == dst:
                last[2] += count
                continue
        out.append([src, dst, count])
    return [(s, d, n) for s, d, n in out]


def group_layers(chunks: Sequence[Chunk]) -> list[tuple[Transfer, list[tuple[int, int, int]]]]:
    """Chunks (``.transfer``, ``.slices``) -> ``[(transfer, merged slices)]``, one per transfer, first-seen order."""
    order: list[Transfer] = []
    slices: dict[int, list[tuple[int, int, int]]] = {}
    for chunk in chunks:
        key = id(chunk.transfer)
        if key not in slices:
            order.append(chunk.transfer)
            slices[key] = []
        slices[key].extend(chunk.slices)
    return [(t, merge_runs_ordered(slices[id(t)])) for t in order]


def layer_descriptors(layer: int, slices: Sequence[tuple[int, int, int]], *, block_nbytes: int,
                      src_base: int, src_num_blocks: int, dst_base: int, dst_num_blocks: int
                      ) -> list[tuple[int, int, int]]:
    """``(local address, remote address, nbytes)`` for ``slices`` of ``layer``, adjacent ones merged.

    The block ``b`` of ``layer`` starts at ``base + (layer * num_blocks + b) * block_nbytes`` on
    each side; ``slices`` are ``(src_block, dst_block, count)``. Lists of several layers can be
    concatenated and merged again with ``merge_runs_ordered`` (a layer's last block may touch
    the next layer's first on both sides)."""
    return merge_runs_ordered(
        (src_base + (layer * src_num_blocks + s) * block_nbytes, dst_base + (layer * dst_num_blocks + d) * block_nbytes,
         n * block_nbytes) for s, d, n in slices)
