"""A script of bench/tools loaded as a module (they are run as files, not imported as a package), for the unit
tests of its pure parts."""

import importlib.util
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[2] / "bench" / "tools"


def load_bench_tool(name: str) -> ModuleType:
    """bench/tools/<name>.py, executed once as the module ``<name>_tool``."""
    spec = importlib.util.spec_from_file_location(f"{name}_tool", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
