"""The shared KV pool (engine/kv_shared.py) is mapped when it is made, not page by page on first use: a
decode step that first touches a KV block then takes no page faults for it."""

import os
import resource

import torch

from pdserve.engine.kv_shared import shared_zeros

PAGES = 2048  # 8 MiB of 4 KiB pages


def _faults() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def test_writing_the_whole_pool_after_it_is_made_takes_no_page_fault_per_page():
    pool, fd = shared_zeros((PAGES, 1024), torch.float32)  # one 4 KiB page a row
    try:
        before = _faults()  # (nothing read first: a read would map the pages too)
        pool.fill_(1.0)  # every page written: without the touch at start, one fault each
        faults = _faults() - before
        assert faults < PAGES // 8, f"{faults} page faults writing {PAGES} pages"
        assert pool.sum().item() == PAGES * 1024
    finally:
        os.close(fd)


def test_a_new_pool_is_zeros():
    pool, fd = shared_zeros((16, 1024), torch.float32)
    try:
        assert pool.abs().sum().item() == 0
    finally:
        os.close(fd)
