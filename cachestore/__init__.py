"""pdserve.cachestore: layer-wise KV transfer from prefill to decode, keyed by request id.

Read first: ``cachestore/README.md`` (protocol sequence), then ``receiver.py`` and
``sender.py`` (each opens with its request lifecycle), then ``entries.py`` (pins, shared
blocks), ``transport.py`` (tcp and nixl behind one interface per side), ``link.py``
(connections, threads; ``nixl_link.py`` its NIXL WRITEs),
``samenode.py`` (a decode's pool mapped by a prefill of the same machine: ``samenode_link.py``,
``samenode_receive.py``, ``landing.py``), ``scheduler.py`` (MoLink / FIFO) and ``frames.py``
(wire format). It never imports the engine: it sees a ``MemoryRegion`` (the KV pool tensor,
registered once) and a ``KVLayout``.

Usage (decode side receives, prefill side sends)::

    layout = KVLayout(num_layers, num_blocks, block_nbytes)
    region = MemoryRegion.from_tensor(kv_pool)          # one region per pool tensor, at start-up
    compat = CompatInfo(dtype="float32", num_layers=..., num_kv_heads=..., head_dim=..., block_size=64)

    rx = CacheStoreReceiver(region, layout, compat, transport="tcp", host="127.0.0.1", port=0)
    await rx.start(); ep = rx.endpoint                  # bytes for the prefill (address, version, hash, nixl md)
    dst = rx.expect(rid, dst_block_ids, timeout_s)      # pin; the dst list for the sender, dst.token its bind token
    await rx.load(rid, layer, timeout_s)                # woken when that layer arrived
    await rx.wait_all(rid, timeout_s)                   # every layer arrived
    rx.delete(rid)                                      # unpin (idempotent)

    tx = CacheStoreSender(region, layout, compat, transport="tcp", scheduler="priority")
    await tx.start()
    tx.bind(rid, ep, dst)                               # CompatError on version/hash mismatch; dst.token
                                                        # (over the wire: bind(rid, ep, blocks, token))
    tx.store(rid, layer, src_block_ids)                 # any thread, non-blocking, after the layer's KV is written
    await tx.wait_sent(rid, timeout_s)                  # every layer delivered (acked)
    tx.delete(rid)

Who frees what, when:

* The engine owns the blocks on both sides. The decode allocates dst blocks, calls
  ``expect`` and must keep them until ``wait_all`` returned and it used them, or until the
  entry failed; then it calls ``delete`` and frees its blocks. If the entry was deleted or
  failed while KV was still arriving, ``await rx.released(rid, timeout_s)`` first: a frame
  already on the wire stops writing within one 1 MiB piece. The prefill keeps src blocks
  until ``wait_sent`` returned or raised, then ``delete``s and frees them.
* Any wait that raises ``TransferError`` (peer died, CANCEL/ERROR from the peer, timeout)
  has already freed the CacheStore entry; ``delete`` afterwards is a no-op. Cancelling an
  awaiting task only ends that wait.
* KV integrity: with ``CacheStoreSender(checksum=True)`` every slice carries a CRC32C that the
  receiver checks before the blocks count as arrived; a mismatch fails the request with
  ``ChecksumError`` (a ``TransferError``) on both sides (``checksum.py``).
* Only the sender given ``dst`` (with its token) can bind the request or send its KV: a BIND or
  DATA with another token is refused and the entry untouched (``entries.py``). With ``tls`` (a
  ``TlsContexts``, ``tls_sockets.py``) both sides' connections are mutual TLS.
* Two live requests share a dst block only if ``expect`` got equal block hashes for it:
  the block is sent once (``expect`` returns -1 for it to the second request) and stays
  pinned until the last owner is deleted.

Contract details the servers rely on: ``expect`` takes optional ``block_hashes`` and returns
the dst list to pass to ``bind`` (the hash dedupe lives on the receiver, which owns the
destination blocks; ``bind``/``store`` take no hashes). ``wait_sent`` waits for all layers of
the layout, not only those stored so far. On a GPU the engine stores a layer when its writes
are only queued: the region's ``layer_written`` (``MemoryRegion``) gives the event the link
waits on before it reads. Both sides' ``stats()`` report ``pinned_entries`` and
``inflight_transfers``.
"""

from .endpoint import TRANSPORTS
from .entries import Destination
from .errors import (CHECKSUM_MISMATCH, BindRefused, ChecksumError, CompatError, ProtocolError, TransferError,
                     UnknownRequestError)
from .frames import WIRE_VERSION
from .memory import CompatInfo, KVLayout, MemoryRegion, merge_runs
from .receiver import CacheStoreReceiver
from .samenode import SAME_NODE_MODES, SameNodeError
from .scheduler import FifoScheduler, PriorityScheduler
from .sender import CacheStoreSender
from .tls_sockets import TlsContexts

__all__ = [
    "BindRefused", "CHECKSUM_MISMATCH", "CacheStoreReceiver", "CacheStoreSender", "ChecksumError", "CompatError",
    "CompatInfo", "Destination", "FifoScheduler", "KVLayout", "MemoryRegion", "PriorityScheduler", "ProtocolError",
    "SAME_NODE_MODES", "SameNodeError",
    "TRANSPORTS", "TlsContexts", "TransferError", "UnknownRequestError", "WIRE_VERSION", "merge_runs",
]
