"""KV integrity: a CRC32C per slice of KV the sender puts on the wire, checked on arrival.

What is summed: one *slice*, the unit a link sends: one contiguous run of destination
blocks of one layer of one request (a tcp DATA frame; one ``(block, nblocks)`` entry of a
NIXL notification). With the priority scheduler a slice is at most ``chunk_bytes`` (4 MiB by
default); with fifo it is a whole run of one layer. So every layer is covered by one or more
checksums, and a mismatch names the request, the layer and the blocks.

Where: the sender computes it over its source blocks right before it sends them (tcp: in the
connection's writer thread, then the DATA header carries it; nixl: in the link's data thread
before the WRITE is posted, and the notification carries it). The receiver recomputes it over
the destination blocks after the bytes landed and BEFORE they count as arrived (tcp: piece by
piece as they are received, then compared before the ACK; nixl: when the notification comes).
A mismatch fails the entry with ``ChecksumError`` (every waiter gets it, the blocks are
unpinned, the sender gets ``ERROR rid`` with ``FLAG_CHECKSUM_MISMATCH``), so ``wait_all``
never returns for corrupted KV and the decode never runs a request on it.

Library: ``crc32c`` (PyPI, hardware CRC32C: SSE4.2 / ARMv8 CRC instructions; it releases
the GIL on large buffers). CRC32C catches every error burst up to 32 bits long, so any single
flipped byte, with certainty. Measured on the development box (one core, 1 MiB pieces): 10 GiB/s
from memory, 17 GiB/s hot in cache; ``zlib.crc32`` 2.6 GiB/s (too slow); ``xxhash.xxh3_64``
9 GiB/s from memory, 38 GiB/s hot (faster but only probabilistic for small errors).

cuda regions: tcp sums the bytes in its pinned staging buffer (host side, as they go on or
come off the wire); nixl copies the slice through a pinned buffer to sum it (correct, but
an extra device-to-host copy per slice: leave checksums off on nixl+cuda until it is summed
on the device).

Test hook (never used in production): ``CacheStoreSender(corrupt_kv=N)`` (the prefill passes
its ``CORRUPT_KV_ENV`` from the environment: pdserve/test_hooks.py) flips one byte of
one layer (the middle one) of each of the first N requests it sends, in flight: the checksum
is computed over the true source bytes, and the bytes sent are a copy with the byte flipped
(tcp: the copy is sent instead of the source slice; nixl: the first block of the slice is
WRITten from a registered scratch copy). The sender's own KV is never modified.
"""

from __future__ import annotations

import crc32c as _crc32c

ALGORITHM = "crc32c"


def crc32c(data, value: int = 0) -> int:
    """CRC32C of a bytes-like object (memoryview slices of the region: no copy), continuing ``value``."""
    return _crc32c.crc32c(data, value)


def default_on(transport: str, cuda: bool) -> tuple[bool, str]:
    """Whether a server sums its KV when ``--kv-checksum`` is not given, and why (for its log).
    On, except for nixl on a cuda pool: there the slice would be copied to the host to be summed."""
    if transport == "nixl" and cuda:
        return False, ("off: nixl on a cuda pool would copy every slice to the host to sum it (no checksum on the "
                       "device yet); --kv-checksum turns them on")
    return True, f"on: {ALGORITHM} per slice of KV, checked before a request joins the batch (--no-kv-checksum: off)"


def mismatch_text(rid: str, layer: int, block: int, nblocks: int, expected: int, got: int) -> str:
    """The receiver's message for a slice whose bytes do not match: names request, layer and blocks."""
    return (f"kv_checksum_mismatch: request {rid!r} layer {layer} blocks {block}..{block + nblocks - 1}: "
            f"{ALGORITHM} of the bytes received is {got:#010x}, the sender computed {expected:#010x}")
