"""NIXL (UCX) plumbing shared by both sides: guarded import, one agent per side, notifications.

The pool region is registered with the agent ONCE (``NixlMemory``). The prefill side WRITEs
into the decode's registered memory; each WRITE carries a notification naming, for each
(request, layer) it holds, the destination blocks and (with checksums on) each slice's CRC32C,
which the decode's agent delivers after the bytes have landed.

Import name: the PyPI wheels ``nixl-cu12``/``nixl-cu13`` install ``nixl_cu12``/``nixl_cu13`` (CUDA 12 or
13 builds: the one matching torch's CUDA); source builds install ``nixl``. All are tried (``NIXL_MODULES``,
in order); the error (with the install hint) appears only when the ``nixl`` transport is chosen.
"""

from __future__ import annotations

import importlib
import logging
import os
import struct
from typing import Any

from .errors import ProtocolError
from .frames import TOKEN_BYTES
from .memory import MemoryRegion

NOTIF_MAGIC = b"PDN3"                    # "PDNX" (protocol 1), "PDN2" (2: checksums), "PDN3" (3: bind tokens)
_NOTIF_COUNT = struct.Struct("!4sBH")    # magic, flags (NOTIF_CRC32C), number of records
_NOTIF_HEAD = struct.Struct(f"!IHH{TOKEN_BYTES}s")  # per record: layer, rid_len, nslices, the request's bind token
_NOTIF_SLICE = struct.Struct("!QII")     # dst block, nblocks, CRC32C of the slice's bytes (0 without NOTIF_CRC32C)
NOTIF_CRC32C = 0x01


NIXL_MODULES = ("nixl", "nixl_cu13", "nixl_cu12")  # a source build, then the PyPI wheels' import names


def load_nixl() -> Any:
    """NIXL's ``_api`` module (nixl_agent, nixl_agent_config, ...), or a RuntimeError saying how to install it."""
    for name in NIXL_MODULES:
        try:
            _api = importlib.import_module(f"{name}._api")
            break
        except ImportError:
            continue
    else:
        raise RuntimeError(
            f"transport='nixl' needs the NIXL Python package (import {', '.join(NIXL_MODULES)}): "
            "pip install 'pdserve[nixl]' (nixl-cu12), or use transport='tcp'")
    if not os.environ.get("NIXL_LOG_LEVEL"):
        # NIXL logs every agent and backend creation at INFO to stdout; keep warnings only
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return _api


def mem_type(region: MemoryRegion) -> str:
    return "DRAM" if region.device == "cpu" else "VRAM"


class NixlMemory:
    """A NIXL agent with the UCX backend and the KV region registered once."""

    def __init__(self, name: str, region: MemoryRegion):
        api = load_nixl()
        self.name = name
        self.region = region
        self.mem_type = mem_type(region)
        # No NIXL progress thread: idle, it keeps a quarter of a core busy. Progress is driven
        # by our own calls instead: the sender polls its WRITEs while any is in flight and the
        # receiver polls notifications while some entry still waits for KV.
        # STRICT thread sync: one sender agent is used by one data thread per receiver link
        # (and the event loop); NIXL's default without a listener thread is no locking at all.
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                       sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.agent = api.nixl_agent(name, config)
        if "UCX" not in self.agent.backends:
            raise RuntimeError("NIXL has no UCX backend plugin here; the nixl transport needs UCX")
        self._reg = self.agent.register_memory([(region.ptr, region.nbytes, region.device_id, "")], self.mem_type)

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def close(self) -> None:
        if self._reg is not None:
            try:
                self.agent.deregister_memory(self._reg)
            finally:
                self._reg = None


NotifRecord = tuple[str, int, bytes, list[tuple[int, int, int]]]


def encode_notif(records: list[NotifRecord], checksum: bool = False) -> bytes:
    """Notification text for one WRITE: (request id, layer, bind token, [(dst block, nblocks, crc32c)])
    records.

    ``checksum`` says the crc values are meant (set NOTIF_CRC32C); without it they are sent as 0."""
    out = [_NOTIF_COUNT.pack(NOTIF_MAGIC, NOTIF_CRC32C if checksum else 0, len(records))]
    for rid, layer, token, slices in records:
        rid_b = rid.encode()
        out.append(_NOTIF_HEAD.pack(layer, len(rid_b), len(slices), token) + rid_b)
        out.extend(_NOTIF_SLICE.pack(b, n, crc if checksum else 0) for b, n, crc in slices)
    return b"".join(out)


def decode_notif(msg: bytes) -> tuple[bool, list[NotifRecord]]:
    """(whether the slices carry checksums, the records) of a notification; ProtocolError if it is not
    one of ours or is malformed."""
    try:
        magic, flags, count = _NOTIF_COUNT.unpack_from(msg)
        if magic != NOTIF_MAGIC:
            raise ProtocolError(f"NIXL notification with bad magic {magic!r}")
        pos, records = _NOTIF_COUNT.size, []
        for _ in range(count):
            layer, rid_len, nslices, token = _NOTIF_HEAD.unpack_from(msg, pos)
            pos += _NOTIF_HEAD.size
            rid = msg[pos:pos + rid_len].decode(errors="replace")
            pos += rid_len
            slices = [_NOTIF_SLICE.unpack_from(msg, pos + i * _NOTIF_SLICE.size) for i in range(nslices)]
            pos += nslices * _NOTIF_SLICE.size
            records.append((rid, layer, token, slices))
    except struct.error:
        raise ProtocolError(f"NIXL notification of {len(msg)} bytes is truncated") from None
    if pos != len(msg):
        raise ProtocolError("NIXL notification has trailing bytes")
    return bool(flags & NOTIF_CRC32C), records
