"""The receiver's endpoint descriptor: the opaque bytes the decode hands to the prefill.

It says where to connect (host, port), which protocol version and compatibility hash the
receiver speaks (the sender refuses a mismatch before connecting), which receiver instance
this is (a restarted receiver gets a new one, so pooled connections are not reused), for
the ``nixl`` transport the agent metadata and the registered region descriptor, and when its
pool can be shared with processes of its machine, how to map it (``local``, ``samenode.py``).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field

from .frames import WIRE_VERSION

ENDPOINT_MAGIC = b"PDKVEP1:"
TRANSPORTS = ("tcp", "nixl")  # the one list of transports (cachestore.TRANSPORTS; the CLIs use it)


@dataclass(slots=True)
class Endpoint:
    host: str
    port: int
    transport: str
    compat_hash: str
    compat: str  # human-readable fields behind the hash, for error messages
    instance: str
    num_blocks: int = 0  # the receiver's pool size (its layout's num_blocks): nixl computes remote addresses
    version: int = WIRE_VERSION
    nixl_agent: str = ""
    nixl_metadata: bytes = b""
    nixl_region: tuple = field(default_factory=tuple)  # (base address, nbytes, device id, "DRAM"|"VRAM")
    local: dict = field(default_factory=dict)  # the region shared with processes of this node (samenode.py), or {}

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")

    def to_bytes(self) -> bytes:
        doc = {
            "host": self.host, "port": self.port, "transport": self.transport, "compat_hash": self.compat_hash,
            "compat": self.compat, "instance": self.instance, "num_blocks": self.num_blocks, "version": self.version,
            "nixl_agent": self.nixl_agent,
            "nixl_metadata": base64.b64encode(self.nixl_metadata).decode(), "nixl_region": list(self.nixl_region),
            "local": self.local,
        }
        return ENDPOINT_MAGIC + json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Endpoint":
        if not isinstance(data, (bytes, bytearray)) or not bytes(data).startswith(ENDPOINT_MAGIC):
            raise ValueError("endpoint bytes are not a pdserve CacheStore endpoint (use CacheStoreReceiver.endpoint)")
        try:
            doc = json.loads(bytes(data)[len(ENDPOINT_MAGIC):])
            return cls(host=doc["host"], port=int(doc["port"]), transport=doc["transport"],
                       compat_hash=doc["compat_hash"], compat=doc["compat"], instance=doc["instance"],
                       num_blocks=int(doc["num_blocks"]), version=int(doc["version"]), nixl_agent=doc["nixl_agent"],
                       nixl_metadata=base64.b64decode(doc["nixl_metadata"]), nixl_region=tuple(doc["nixl_region"]),
                       local=dict(doc.get("local") or {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed CacheStore endpoint bytes: {exc}") from None
