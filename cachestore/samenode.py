"""Same-node KV: the decode's pool region shared with a prefill process on the same machine.

When prefill and decode run on one machine the prefill can write each layer's blocks straight into
the decode's KV pool, with no socket copy (cpu) or no trip through host memory (cuda). This module
holds what that needs on each side, without threads or the link (``samenode_link.py`` is the data
thread, ``samenode_receive.py`` what the receiver does with the prefill's notifications):

* ``describe(region)`` (decode, receiver): the descriptor put in the endpoint (``Endpoint.local``),
  or {} when the region cannot be shared. It names the machine (``boot_id()``) and how to reach the
  region:

  - cpu: the pool was allocated in a memfd (``engine/kv_shared.py``: anonymous shared memory, no
    file in /dev/shm or anywhere, gone with the last process that maps it; mode 0600). The
    descriptor holds the decode's pid, the fd number and the memfd's (st_dev, st_ino, size); the
    prefill opens ``/proc/<pid>/fd/<fd>``, which the kernel allows only to a process that may
    ptrace-read the decode (same user, or CAP_SYS_PTRACE), and checks the inode it got is the one
    named (a prefill in another pid namespace would otherwise open another process's fd).
  - cuda: the pool's storage exported by CUDA IPC (torch's ``UntypedStorage._share_cuda_``, the
    handle ``torch.multiprocessing.reductions.reduce_tensor`` sends); the prefill rebuilds it with
    ``UntypedStorage._new_shared_cuda`` on the same device (the CUDA driver refuses a process of
    another machine, or the exporting process itself).

* ``open_remote(desc, nbytes)`` (prefill, sender): the decode's region mapped into this process, a
  ``RemoteRegion`` with ``copy`` (local byte range -> remote byte range: a memcpy on cpu, a
  device-to-device copy on its own stream on cuda), ``sync`` and ``close``. Raises ``SameNodeError``
  naming why it cannot (another machine, another pid namespace, permission, no CUDA...): the sender
  then falls back to the endpoint's transport (``tcp`` / ``nixl``) and logs it once a receiver.
"""

from __future__ import annotations

import base64
import logging
import os
from typing import Any, cast

from .memory import MemoryRegion

log = logging.getLogger("pdserve.cachestore.samenode")
SAME_NODE_MODES = ("auto", "on", "off")  # CacheStoreSender(same_node=...), the servers' --kv-same-node
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


class SameNodeError(RuntimeError):
    """The receiver's region cannot be mapped by this process (the message says why)."""


def boot_id() -> str:
    """This machine's boot id ("" when the kernel does not say): two processes with one boot id share a kernel."""
    try:
        with open(BOOT_ID_PATH) as f:
            return f.read().strip()
    except OSError:
        return ""


def describe(region: MemoryRegion) -> dict:
    """The descriptor of a shareable region for ``Endpoint.local`` ({} when it cannot be shared)."""
    node = boot_id()
    if not node:
        return {}
    if region.device == "cpu":
        fd = region.shared_fd
        if fd is None:
            return {}
        st = os.fstat(fd)
        return {"boot_id": node, "kind": "memfd", "pid": os.getpid(), "fd": fd, "dev": st.st_dev, "ino": st.st_ino,
                "nbytes": region.nbytes}
    try:
        handle = _export_cuda(region.owner)
    except (AttributeError, RuntimeError, TypeError) as exc:  # no tensor behind it, or the driver refuses
        log.warning("the KV pool cannot be exported by CUDA IPC (%s): no same-node KV transfer to it", exc)
        return {}
    return {"boot_id": node, "kind": "cuda_ipc", "nbytes": region.nbytes, "device": region.device_id,
            "handle": handle}


def _export_cuda(tensor: Any) -> list:
    """CUDA IPC handle of the tensor's storage, JSON-able (bytes as base64; the storage offset in bytes last)."""
    storage = tensor.untyped_storage()
    fields = storage._share_cuda_()  # (device, handle, size, offset, ref handle, ref offset, event, event sync)
    enc = [{"b64": base64.b64encode(v).decode()} if isinstance(v, (bytes, bytearray)) else v for v in fields]
    return enc + [tensor.storage_offset() * tensor.element_size()]


def _decode_fields(enc: list) -> list:
    return [base64.b64decode(v["b64"]) if isinstance(v, dict) else v for v in enc]


class RemoteRegion:
    """The receiver's region mapped here: a flat uint8 tensor ``remote`` beside ours, ``local``."""

    def __init__(self, local: Any, remote: Any, kind: str, stream: Any = None):
        self.local, self.remote, self.kind, self.stream = local, remote, kind, stream

    def copy(self, src: int, dst: int, nbytes: int) -> None:
        """Bytes [src, src+nbytes) of our region into [dst, dst+nbytes) of the receiver's (queued on cuda)."""
        if self.stream is None:
            self.remote[dst:dst + nbytes].copy_(self.local[src:src + nbytes])
            return
        import torch

        with torch.cuda.stream(self.stream):
            self.remote[dst:dst + nbytes].copy_(self.local[src:src + nbytes], non_blocking=True)

    def flip(self, dst: int) -> None:
        """Test hook (checksum.py): flip one byte of the receiver's region, after our copy landed there."""
        self.sync()
        self.remote[dst] = self.remote[dst] ^ 0xFF

    def sync(self) -> None:
        """Every copy queued so far has landed (before the receiver is told)."""
        if self.stream is not None:
            self.stream.synchronize()

    def close(self) -> None:
        """Unmap (cpu) / release the imported handle (cuda) once its tensors are dropped."""
        self.sync()
        self.remote = None


def _local_bytes(region: MemoryRegion) -> Any:
    import torch

    if region.device == "cpu":
        return torch.frombuffer(region.host_view(), dtype=torch.uint8)
    return region.owner.reshape(-1).view(torch.uint8)


def open_remote(desc: dict, region: MemoryRegion, nbytes: int) -> RemoteRegion:
    """Map the receiver's region (``Endpoint.local``) here; ``nbytes``: what its layout needs of it."""
    if not desc:
        raise SameNodeError("the receiver offers no shared region (its pool is not shareable, or --kv-same-node off)")
    node = boot_id()
    if desc.get("boot_id") != node or not node:
        raise SameNodeError("the receiver runs on another machine (its boot id is not this one's)")
    if int(desc.get("nbytes", 0)) < nbytes:
        raise SameNodeError(f"the receiver's shared region has {desc.get('nbytes')} bytes, its layout needs {nbytes}")
    kind = desc.get("kind")
    if kind == "memfd":
        if region.device != "cpu":
            raise SameNodeError("the receiver's pool is in host memory and this sender's on cuda")
        return RemoteRegion(_local_bytes(region), _open_memfd(desc, nbytes), "memfd")
    if kind == "cuda_ipc":
        if region.device != "cuda":
            raise SameNodeError("the receiver's pool is on cuda and this sender's in host memory")
        return _open_cuda(desc, region, nbytes)
    raise SameNodeError(f"unknown shared region kind {kind!r}")


def _open_memfd(desc: dict, nbytes: int) -> Any:
    import torch

    path = f"/proc/{int(desc['pid'])}/fd/{int(desc['fd'])}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise SameNodeError(f"cannot open the receiver's shared region {path}: {exc.strerror} (another pid "
                            "namespace, or another user)") from None
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (desc["dev"], desc["ino"]) or st.st_size < nbytes:
            raise SameNodeError(f"{path} is not the receiver's shared region (another pid namespace)")
        storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes)
    finally:
        os.close(fd)  # the mapping keeps the memory; the fd is not needed any more
    return torch.empty(0, dtype=torch.uint8).set_(cast(torch.UntypedStorage, storage))


def _open_cuda(desc: dict, region: MemoryRegion, nbytes: int) -> RemoteRegion:
    import torch

    fields = _decode_fields(desc["handle"])
    offset = int(fields.pop())
    try:
        with torch.cuda.device(int(desc["device"])):
            storage = torch.UntypedStorage._new_shared_cuda(*fields)
    except (RuntimeError, TypeError) as exc:
        raise SameNodeError(f"cannot open the receiver's CUDA IPC handle: {exc}") from None
    remote = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)[offset:offset + nbytes]
    local = _local_bytes(region)
    return RemoteRegion(local, remote, "cuda_ipc", torch.cuda.Stream(device=local.device))
