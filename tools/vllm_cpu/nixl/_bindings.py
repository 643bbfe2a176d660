"""``nixl._bindings`` = ``nixl_cu12._bindings`` (vLLM reads its transfer telemetry type from here)."""
from nixl_cu12._bindings import *  # noqa: F401,F403
