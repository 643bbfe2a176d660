"""What travels between the controller and the stages, as tensors over torch.distributed.

Ranks: 0 is the controller (the process that owns requests and blocks), stage ``s`` is rank
``s + 1``. A micro-batch goes 0 -> 1 -> ... -> N (the last stage) -> 0, two messages per hop
(each message costs a round of the transport, so everything else is packed into them):

  header   int64[8 + num_stages]: cmd, micro-batch id, kind, num_seqs, meta length, hidden
           rows, sampling bytes, payload bytes, then each stage's compute nanoseconds (each
           stage writes its own slot)
  payload  uint8[payload bytes], the concatenation of
           meta     int64[meta length]: per sequence ``num_computed, n_new, n_generated,
                    num_tokens, n_blocks, block_table..., new token ids...`` (prefill spans
                    first, then decode rows: the order of the logits, so of the tokens that
                    come back). A span that ends before ``num_tokens`` (a chunk of a prompt
                    before its last) writes its KV and samples nothing.
           hidden   [rows, hidden_size] activations (into stage 1 onwards; the model dtype)
           sampling pickled SamplingParams list of the rows that sample, only when some is
                    not greedy
           (from the last stage to 0 the payload is the sampled tokens, int64[rows that
           sample], in row order; nothing when no row samples)

Every stage holds the same block ids (the controller's one BlockManager): block ``b`` on stage
``s`` holds the KV of stage ``s``'s layers for the tokens that block ``b`` holds.

Sends are ``isend`` (a stage never blocks on a slow neighbour); ``Link`` keeps their handles
and tensors alive until they complete.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

CMD_STOP, CMD_RUN = 0, 1
KIND_PREFILL, KIND_DECODE, KIND_MIXED = 0, 1, 2
KIND_NAMES = {KIND_PREFILL: "prefill", KIND_DECODE: "decode", KIND_MIXED: "mixed"}
HEADER_LEN = 8  # + num_stages timing slots


def encode_rows(rows: list[tuple[int, list[int], int, list[int], int]]) -> list[int]:
    """``[(num_computed, new_ids, n_generated, block_table, num_tokens), ...]`` -> the flat meta."""
    out: list[int] = []
    for num_computed, new_ids, n_generated, table, num_tokens in rows:
        out += (num_computed, len(new_ids), n_generated, num_tokens, len(table))
        out += table
        out += new_ids
    return out


class OffsetIds:
    """``all_ids`` of a sequence of which only the ids from ``offset`` on are known (a stage
    needs no more): indexing and ``[offset:stop]`` work as on the full list, and ``len``."""

    __slots__ = ("offset", "ids")

    def __init__(self, offset: int, ids: list[int]):
        self.offset, self.ids = offset, ids

    def __len__(self) -> int:
        return self.offset + len(self.ids)

    def __getitem__(self, key):
        if isinstance(key, slice):
            if key.start != self.offset or key.step is not None:
                raise IndexError(f"only [{self.offset}:] of these ids is known")
            return self.ids if key.stop is None else self.ids[: key.stop - self.offset]
        return self.ids[key - self.offset]


class Row:
    """One sequence of a micro-batch as a stage sees it (what ModelRunner.build_batch reads)."""

    __slots__ = ("num_computed", "all_ids", "block_table", "n_generated", "num_tokens")

    def __init__(self, num_computed: int, new_ids: list[int], n_generated: int, table: list[int], num_tokens: int):
        self.num_computed, self.n_generated, self.block_table = num_computed, n_generated, table
        self.all_ids = OffsetIds(num_computed, new_ids)
        self.num_tokens = num_tokens  # the sequence's tokens in all (a chunk ends before)

    @property
    def chunk_end(self) -> int:
        """Where this micro-batch's computation of the sequence ends: after its known ids."""
        return len(self.all_ids)

    @property
    def samples(self) -> bool:
        """The span reaches the sequence's last token: its last position samples the next one."""
        return self.chunk_end >= self.num_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_tokens - self.num_computed == 1 and self.num_computed > 0


def decode_rows(meta: list[int], num_seqs: int) -> list[Row]:
    rows, i = [], 0
    for _ in range(num_seqs):
        num_computed, n_new, n_generated, num_tokens, n_blocks = meta[i : i + 5]
        i += 5
        table = meta[i : i + n_blocks]
        i += n_blocks
        rows.append(Row(num_computed, meta[i : i + n_new], n_generated, table, num_tokens))
        i += n_new
    return rows


def pack_sampling(params: list) -> torch.Tensor | None:
    if all(p.greedy for p in params):
        return None
    return torch.frombuffer(bytearray(pickle.dumps(params)), dtype=torch.uint8)


def unpack_sampling(t: torch.Tensor) -> list:
    return pickle.loads(t.cpu().numpy().tobytes())


class Link:
    """Point-to-point sends that never block the caller, and blocking receives."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pending: list[tuple[object, torch.Tensor]] = []

    def send(self, dst: int, tensors: list[torch.Tensor]) -> None:
        self.reap()
        for t in tensors:
            t = t.to(self.device).contiguous()
            self.pending.append((dist.isend(t, dst), t))

    def reap(self) -> None:
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]

    def flush(self) -> None:
        for w, _ in self.pending:
            w.wait()
        self.pending = []

    def recv(self, src: int, shape, dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(t, src)
        return t

    def recv_header(self, src: int, num_stages: int) -> list[int]:
        return self.recv(src, (HEADER_LEN + num_stages,), torch.int64).tolist()


def pack(parts: list[torch.Tensor]) -> torch.Tensor:
    """Tensors -> one uint8 tensor of their bytes (in order)."""
    return (torch.cat([p.contiguous().view(-1).view(torch.uint8) for p in parts])
            if parts else torch.empty(0, dtype=torch.uint8))


def unpack(payload: torch.Tensor, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """The inverse of ``pack`` given each part's shape and dtype."""
    out, at = [], 0
    for shape, dtype in specs:
        n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        out.append(payload[at : at + n].view(dtype).view(shape))
        at += n
    return out
