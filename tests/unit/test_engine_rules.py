"""Three rules of engine/ (issue 46's targets), checked on every file of it, parsed (not imported):

- no function (or method) over 60 lines, its decorators and docstring included;
- no ``PDSERVE_`` name read in engine/: the engine takes its settings from EngineConfig and its
  callers, never from pdserve's environment (a docstring may name a variable its caller reads);
- no device branch outside the files named in DEVICE_FILES: a comparison with "cuda" or "cpu"
  (``x.device.type == "cuda"``), ``.is_cuda`` / ``.is_cpu``, ``torch.cuda``, or an import of a GPU
  kernel module. The model, its layers, the runner and the loader carry none: what differs by device is
  chosen once per engine by the seams (``layer_ops.choose``, ``attention_backends.choose``) and held
  by the model, so a new backend (FlashInfer) is a class there, not a branch in the model code.
"""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"
MAX_LINES = 60


def _long_functions(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - min([d.lineno for d in node.decorator_list] + [node.lineno]) + 1
            if lines > MAX_LINES:
                out.append(f"{node.lineno} {node.name} ({lines} lines)")
    return out


def _pdserve_names(tree: ast.AST) -> list[str]:
    """``PDSERVE_`` in any string of the code but a docstring."""
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    return [f"{node.lineno} {node.value[:60]!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "PDSERVE_" in node.value
            and id(node) not in docs]


DEVICE_NAMES = ("cuda", "cpu")
GPU_MODULES = ("gpu_attention", "gpu_elementwise", "triton_jit")
# the files where a device decision belongs, and why; every other file of engine/ has none
DEVICE_FILES = {
    "attention_backends.py": "the attention seam: the backend chosen by device once; the torch backend's CPU decode",
    "attention.py": "the torch attention backend's math: torch's CPU flash kernel where it exists",
    "layer_ops.py": "the layers' ops seam: the ops chosen by device once per model",
    "mkl_gemm.py": "MKL's packed float32 GEMM: host pointers handed to MKL, CPU tensors only",
    "fp8.py": "the FP8 matmul each device runs (linear_for, asked once per model) and the start-up line",
    "gpu_attention.py": "the CUDA attention kernels (interpreted on CPU tensors in the tests)",
    "gpu_elementwise.py": "the CUDA elementwise kernels (interpreted on CPU tensors in the tests)",
    "decode_graphs.py": "CUDA graphs of decode steps",
    "kv_cache.py": "the KV pool's memory: CUDA events for written layers, shared memory on CPU",
    "kv_tiers.py": "host and disk tiers: pinned host memory, the device stream synchronised before a copy",
    "swap.py": "evicted KV in host memory: pinned for a GPU pool",
    "weight_memory.py": "the free-memory check before a model is built on CUDA",
    "tp/group.py": "tensor parallelism: NCCL for a GPU's tensors, gloo for bytes",
    "tp/ranks.py": "tensor parallelism: each rank's device, its backend",
    "tp/shm_collectives.py": "tensor parallelism: shared-memory collectives for CPU tensors",
    "tp/pieces.py": "tensor parallelism: a KV staging pool, in shared memory on CPU (as kv_cache.py's)",
}
# the model and the runner: never in DEVICE_FILES
MODEL_AND_RUNNER = ("model.py", "models/", "model_runner.py", "loader.py", "llm_engine.py", "engine_core.py",
                    "scheduler.py", "packed_linear.py", "pd_hooks.py")


def _constants(node: ast.AST) -> list:
    if isinstance(node, ast.Constant):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant)]
    return []


def _device_branches(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            if any(v in DEVICE_NAMES for side in (node.left, *node.comparators) for v in _constants(side)):
                out.append(f"{node.lineno} compares with a device name")
        elif isinstance(node, ast.Attribute) and node.attr in ("is_cuda", "is_cpu"):
            out.append(f"{node.lineno} .{node.attr}")
        elif (isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name)
              and node.value.id == "torch"):
            out.append(f"{node.lineno} torch.cuda")
        elif isinstance(node, ast.ImportFrom):
            if any(name.split(".")[-1] in GPU_MODULES for name in [node.module or ""] + [a.name for a in node.names]):
                out.append(f"{node.lineno} imports a GPU kernel module")
    return sorted(out, key=lambda hit: int(hit.split()[0]))


def _files() -> list[Path]:
    files = sorted(ENGINE.rglob("*.py"))
    assert len(files) > 40  # the folder was found
    return files


def _each_file(check, skip=()) -> list[str]:
    return [f"{path.relative_to(ENGINE.parent)}:{hit}" for path in _files()
            if path.relative_to(ENGINE).as_posix() not in skip for hit in check(ast.parse(path.read_text()))]


def test_no_function_in_engine_is_over_60_lines():
    assert _each_file(_long_functions) == []


def test_engine_reads_no_pdserve_variable():
    assert _each_file(_pdserve_names) == []


def test_no_device_branch_outside_the_device_files():
    assert _each_file(_device_branches, skip=DEVICE_FILES) == []


def test_the_device_files_are_not_the_model_or_runner_and_each_still_decides():
    """DEVICE_FILES names no model or runner file, and no file that has stopped deciding anything by device
    (a stale entry would let a branch back in unseen)."""
    assert not [f for f in DEVICE_FILES if f.startswith(MODEL_AND_RUNNER)]
    for name in DEVICE_FILES:
        assert _device_branches(ast.parse((ENGINE / name).read_text())), f"{name} has no device branch left"


def test_the_checks_find_what_they_look_for():
    """A 63-line function that reads PDSERVE_X, with a docstring naming PDSERVE_Y: both checks fire, the
    docstring is not counted."""
    src = 'import os\n\ndef f():\n    """Reads PDSERVE_Y."""\n' + "    x = 1\n" * 60 + \
          "    return os.environ.get('PDSERVE_X')\n"
    tree = ast.parse(src)
    assert _long_functions(tree) == ["3 f (63 lines)"]
    assert _pdserve_names(tree) == ["65 'PDSERVE_X'"]


def test_the_device_check_finds_each_form():
    src = ("from .. import gpu_elementwise\n"
           "def f(x, d):\n"
           "    if x.device.type == 'cuda': pass\n"
           "    if d.type in ('cpu', 'mps'): pass\n"
           "    if x.is_cuda: pass\n"
           "    torch.cuda.synchronize()\n"
           "    if x.dtype == 'float32' or d.type == 'meta': pass\n")
    assert _device_branches(ast.parse(src)) == [
        "1 imports a GPU kernel module", "3 compares with a device name", "4 compares with a device name",
        "5 .is_cuda", "6 torch.cuda"]
