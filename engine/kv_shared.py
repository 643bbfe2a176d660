"""A CPU KV pool in shared memory that another process of this machine can map (same-node P/D).

``shared_zeros(shape, dtype)`` allocates the tensor in a memfd (``memfd_create``: anonymous
shared memory; no file in /dev/shm or anywhere else, so nothing is left behind when the process
exits, however it exits) with mode 0600, and returns it with the fd. The fd stays open for the
process's life: the CacheStore names it (pid, fd, inode) in the decode's endpoint so that a
prefill on the same machine maps the same pages (``cachestore/samenode.py``) through
``/proc/<pid>/fd/<fd>``, which only a process of the same user (ptrace-read access) may open.
The memory is freed when the last mapping and fd are gone.

Every page is touched (written) once here, at start: a memfd's pages are otherwise allocated and
mapped on first touch, so a KV block's first use faults in whichever decode step first reads or
writes it (the step trace counted up to about 700 faults in a step that a request joined: fewer
than the prompt's pages, the kernel maps several a fault; those steps took 8% more CPU than their
batch size's median: ``faults`` in docs/bench_raw/2026-12-06-decode-tails/). A pool in ordinary
memory (``torch.zeros``) is written once at allocation the same way.
"""

from __future__ import annotations

import math
import os
from typing import cast

import torch


def available() -> bool:
    """memfd_create exists (Linux)."""
    return hasattr(os, "memfd_create")


def shared_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """(a zeroed contiguous CPU tensor in a fresh memfd, the memfd's fd)."""
    if not available():
        raise RuntimeError("a shared KV pool needs memfd_create (Linux)")
    nbytes = max(1, math.prod(shape) * torch.empty(0, dtype=dtype).element_size())
    fd = os.memfd_create("pdserve-kv", os.MFD_CLOEXEC)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, nbytes)  # zero pages, allocated on first touch
        storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes)
    except BaseException:
        os.close(fd)
        raise
    flat = torch.empty(0, dtype=torch.uint8).set_(cast(torch.UntypedStorage, storage))
    flat.zero_()  # every page allocated and mapped now, not on first touch in a step (module docstring)
    return flat.view(dtype).view(shape), fd


def describe(fd: int) -> dict:
    """What another process of this machine (and user) needs to map the memfd ``fd`` of this one (``open_shared``)."""
    st = os.fstat(fd)
    return {"pid": os.getpid(), "fd": fd, "dev": st.st_dev, "ino": st.st_ino}


def open_shared(desc: dict, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """(the tensor ``shape`` of ``dtype`` in another process's memfd named by ``describe``, mapped here; this
    process's own fd of it). RuntimeError naming why it cannot (the process gone, another user, another memfd
    under that fd number)."""
    path = f"/proc/{desc['pid']}/fd/{desc['fd']}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise RuntimeError(f"cannot open the shared KV pool {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (desc["dev"], desc["ino"]):
            raise RuntimeError(f"{path} is not the shared KV pool named (another file under that fd number)")
        nbytes = max(1, math.prod(shape) * torch.empty(0, dtype=dtype).element_size())
        if st.st_size < nbytes:
            raise RuntimeError(f"the shared KV pool {path} holds {st.st_size} bytes, {nbytes} expected")
        storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes)
    except BaseException:
        os.close(fd)
        raise
    flat = torch.empty(0, dtype=torch.uint8).set_(cast(torch.UntypedStorage, storage))
    return flat.view(dtype).view(shape), fd
