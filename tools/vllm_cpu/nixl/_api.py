"""``nixl._api`` = ``nixl_cu12._api``, with the progress thread off by default when tuned.

NIXL's UCX progress thread spins a whole core while idle; on a 2-core machine that core is the
one the other instance computes on. With ``PDSERVE_VLLM_TUNED=1`` (set by
``pdserve bench experiment peer``), ``nixl_agent_config`` defaults to
``enable_prog_thread=False``, as pdserve's own NIXL backend does; otherwise NIXL's default holds.
"""
import os

from nixl_cu12 import _api as _real
from nixl_cu12._api import *  # noqa: F401,F403


class nixl_agent_config(_real.nixl_agent_config):  # noqa: N801 (NIXL's name)
    def __init__(self, enable_prog_thread=None, *args, **kwargs):
        if enable_prog_thread is None:
            enable_prog_thread = os.environ.get("PDSERVE_VLLM_TUNED") != "1"
        super().__init__(enable_prog_thread, *args, **kwargs)
