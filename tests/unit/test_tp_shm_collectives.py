"""engine/tp/shm_collectives.py: the CPU ranks' all-reduce and logits gather through shared memory.

Two real processes (rank 1 a child Python) exchange tensors through one segment: sums and gathers equal
what the ranks put in, in float32 and bfloat16, over many operations (the two buffers alternate); a peer
that never arrives ends the wait with the ``lost()`` reason or "timed out"; a tensor over a slot does not
fit (the caller sends it by gloo); after ``unlink_segment`` nothing of it is left in /dev/shm.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pdserve.engine.tp import shm_collectives as shm

OPS = 200
CHILD = textwrap.dedent("""
    import sys, torch
    from pdserve.engine.tp.shm_collectives import ShmCollectives
    c = ShmCollectives(sys.argv[1], 1, 2, 60.0, lambda: None)
    for i in range(int(sys.argv[2])):
        t = torch.full((3, 5), float(i), dtype=torch.float32) * 2
        c.all_reduce(t)
        g = c.all_gather_last(torch.full((2, 3), float(i + 1), dtype=torch.bfloat16))
    c.close()
""")


def _segment_files(path: str) -> list[str]:
    base = os.path.basename(path)
    return [f for f in os.listdir(shm.SHM_DIR) if f.startswith(base)]


def test_two_processes_sum_and_gather_what_each_put_in():
    path = shm.create_segment(2)
    child = subprocess.Popen([sys.executable, "-c", CHILD, path, str(OPS)])
    c = shm.ShmCollectives(path, 0, 2, 60.0, lambda: None if child.poll() is None else "rank 1 exited")
    try:
        for i in range(OPS):
            t = torch.full((3, 5), float(i), dtype=torch.float32)
            assert c.all_reduce(t) is t
            assert torch.equal(t, torch.full((3, 5), 3.0 * i))  # i from here, 2i from rank 1
            mine = torch.full((2, 3), -float(i), dtype=torch.bfloat16)
            g = c.all_gather_last(mine)
            assert g.shape == (2, 6) and g.dtype == torch.bfloat16
            assert torch.equal(g[:, :3], mine) and torch.equal(g[:, 3:], torch.full((2, 3), float(i + 1),
                                                                                   dtype=torch.bfloat16))
        assert child.wait(timeout=60) == 0
    finally:
        c.close()
        child.kill()
        shm.unlink_segment(path, 2)
    assert _segment_files(path) == []


def test_a_lost_peer_ends_the_wait_with_its_reason():
    path = shm.create_segment(2)
    try:
        c = shm.ShmCollectives(path, 0, 2, 60.0, lambda: "tensor-parallel rank 1 (pid 1) exited with code -9")
        with pytest.raises(RuntimeError, match=r"shared-memory collective: tensor-parallel rank 1 \(pid 1\) exited"):
            c.all_reduce(torch.ones(4))
        c.close()
    finally:
        shm.unlink_segment(path, 2)


def test_a_peer_that_never_comes_times_out_naming_it():
    path = shm.create_segment(2)
    try:
        c = shm.ShmCollectives(path, 0, 2, 0.2, lambda: None)
        with pytest.raises(RuntimeError, match="timed out after 0.2s waiting for tensor-parallel rank 1"):
            c.all_gather_last(torch.ones(1, 4))
        c.close()
    finally:
        shm.unlink_segment(path, 2)
    assert _segment_files(path) == []


def test_usable_on_this_x86_cpu_but_never_for_a_gpu():
    assert shm.usable(torch.device("cpu"))  # the CI machines are x86 with /dev/shm
    assert not shm.usable(torch.device("cuda"))


def test_only_small_contiguous_cpu_tensors_fit():
    slot_floats = shm.SLOT_BYTES // 4
    assert shm.ShmCollectives.fits(torch.ones(slot_floats))
    assert not shm.ShmCollectives.fits(torch.ones(slot_floats + 1))
    assert not shm.ShmCollectives.fits(torch.ones(8, 8).t())  # not contiguous
