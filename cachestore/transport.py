"""How a request's KV bytes travel: one interface per side, a ``tcp`` and a ``nixl`` implementation
of each, chosen once by name (``receive_side`` / ``send_side``).

Both transports share the TCP control channel: the handshake, BIND, CANCEL and ERROR frames
(``tcp_server.py`` on the receiving end, ``link.py`` on the sending end). What differs is the bytes:

* ``tcp``: they travel in DATA frames on the link's connections (``connections_per_peer`` of them);
  the receiver's connection threads write each frame straight into the region and ACK it.
* ``nixl``: one TCP connection carries the control frames only; the bytes go by NIXL WRITEs from the
  sender's registered region into the receiver's (``nixl_link.py``: UCX over shared memory or TCP on
  one machine, RDMA / GPUDirect between machines), each with a notification that the receiver's
  notification thread turns into arrivals (``nixl_receive.py``). The endpoint carries the
  receiver's NIXL agent metadata and region descriptor.

The sender and the receiver reach their transport only through these classes: a third transport
is a new pair here and a name in ``endpoint.TRANSPORTS``.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import TYPE_CHECKING, Any, Callable, Protocol

from .endpoint import TRANSPORTS, Endpoint
from .memory import MemoryRegion

if TYPE_CHECKING:  # pragma: no cover
    from .entries import EntryTable
    from .memory import KVLayout
    from .nixl_backend import NixlMemory
    from .nixl_receive import NixlReceiveLoop


class ReceiveSide(Protocol):
    """A receiver's transport: what runs beside its TCP server."""

    name: str
    frames_carry_data: bool  # DATA frames arrive on the TCP connections (tcp) or never (nixl)

    async def start(self, has_senders: Callable[[], bool]) -> None:
        """Register memory and start the threads that notice arrivals (before the server listens)."""

    def describe(self, ep: Endpoint) -> None:
        """Add to the receiver's endpoint what a sender needs to reach its memory."""

    def wake(self) -> None:
        """An entry was just expected: look for its arrivals soon."""

    def stop(self) -> list[threading.Thread]:
        """Stop the threads (returned for the caller to join)."""

    def close(self) -> None:
        """Deregister memory (after ``stop``'s threads ended)."""


class SendSide(Protocol):
    """A sender's transport: what every link to a receiver uses besides its control connection."""

    name: str
    frames_carry_data: bool  # the link's connections send DATA frames (tcp) or carry control only (nixl)
    has_data_thread: bool    # a link runs ``run_data_thread`` in a thread of its own

    @property
    def agent(self) -> str:
        """Named in the handshake (the NIXL agent), "" for none."""

    async def start(self) -> None:
        """Register memory (once per sender)."""

    def connections(self, configured: int) -> int:
        """How many TCP connections a link opens, given ``connections_per_peer``."""

    def run_data_thread(self, link: Any) -> None:
        """A link's own data thread, for a transport whose bytes do not go in DATA frames: moves the
        link's chunks until the link is down (raises on failure). None of it for tcp."""

    def close(self) -> None:
        """Deregister memory (after every link closed)."""


# ----- tcp ---------------------------------------------------------------------------------------
class TcpReceive:
    name = "tcp"
    frames_carry_data = True

    async def start(self, has_senders: Callable[[], bool]) -> None:
        pass

    def describe(self, ep: Endpoint) -> None:
        pass

    def wake(self) -> None:
        pass

    def stop(self) -> list[threading.Thread]:
        return []

    def close(self) -> None:
        pass


class TcpSend:
    name = "tcp"
    frames_carry_data = True
    agent = ""
    has_data_thread = False

    async def start(self) -> None:
        pass

    def connections(self, configured: int) -> int:
        return configured

    def run_data_thread(self, link: Any) -> None:
        raise RuntimeError("the tcp transport sends DATA frames on the link's connections; it has no data thread")

    def close(self) -> None:
        pass


# ----- nixl --------------------------------------------------------------------------------------
class NixlReceive:
    name = "nixl"
    frames_carry_data = False

    def __init__(self, region: MemoryRegion, instance: str, table: "EntryTable", layout: "KVLayout",
                 counters: dict, on_arrived: Callable, on_corrupt: Callable):
        from .nixl_backend import load_nixl

        load_nixl()  # a clear error at construction, not at the first request
        self.region, self.instance, self.table, self.layout = region, instance, table, layout
        self.counters, self.on_arrived, self.on_corrupt = counters, on_arrived, on_corrupt
        self.memory: NixlMemory | None = None  # the agent and the registered region
        self.loop: NixlReceiveLoop | None = None  # the notification thread

    async def start(self, has_senders: Callable[[], bool]) -> None:
        from .nixl_backend import NixlMemory
        from .nixl_receive import NixlReceiveLoop

        self.memory = memory = await asyncio.to_thread(NixlMemory, f"pdserve-rx-{self.instance}", self.region)
        self.loop = loop = NixlReceiveLoop(memory, self.table, self.layout, self.counters, self.on_arrived,
                                           has_senders, self.on_corrupt)
        loop.start()

    def describe(self, ep: Endpoint) -> None:
        memory = _started(self.memory)
        ep.nixl_agent = memory.name
        ep.nixl_metadata = memory.metadata()
        ep.nixl_region = (self.region.ptr, self.region.nbytes, self.region.device_id, memory.mem_type)

    def wake(self) -> None:
        if self.loop is not None:
            self.loop.wake()

    def stop(self) -> list[threading.Thread]:
        return [self.loop.stop()] if self.loop is not None else []

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()
            self.memory = None


class NixlSend:
    name = "nixl"
    frames_carry_data = False
    has_data_thread = True

    def __init__(self, region: MemoryRegion):
        from .nixl_backend import load_nixl

        load_nixl()
        self.region = region
        self.memory: NixlMemory | None = None  # created by start()

    @property
    def agent(self) -> str:
        return self.memory.name if self.memory is not None else ""

    async def start(self) -> None:
        from .nixl_backend import NixlMemory

        self.memory = await asyncio.to_thread(NixlMemory, f"pdserve-tx-{uuid.uuid4().hex[:12]}", self.region)

    def connections(self, configured: int) -> int:
        return 1  # the control channel

    def run_data_thread(self, link: Any) -> None:
        from .nixl_link import NixlWriter

        cfg = link.config
        NixlWriter(_started(self.memory), cfg.region, cfg.layout, link.endpoint, link.peer,
                   chunk_blocks=cfg.chunk_blocks, checksum=cfg.checksum, stall_timeout_s=cfg.stall_timeout_s,
                   take=link.take_chunks, chunks_done=link.chunks_done, stall_error=link.stall_error).run()

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()
            self.memory = None


def _started(memory: NixlMemory | None) -> NixlMemory:
    if memory is None:
        raise RuntimeError("the NIXL transport is used before its start() registered the memory")
    return memory


def _check(name: str) -> None:
    if name not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {name!r}")


def receive_side(name: str, region: MemoryRegion, instance: str, table: "EntryTable", layout: "KVLayout",
                 counters: dict, on_arrived: Callable, on_corrupt: Callable) -> ReceiveSide:
    """The receiving half of transport ``name`` (ValueError naming the choices for another name)."""
    _check(name)
    if name == "nixl":
        return NixlReceive(region, instance, table, layout, counters, on_arrived, on_corrupt)
    return TcpReceive()


def send_side(name: str, region: MemoryRegion) -> SendSide:
    """The sending half of transport ``name`` (ValueError naming the choices for another name)."""
    _check(name)
    return NixlSend(region) if name == "nixl" else TcpSend()
