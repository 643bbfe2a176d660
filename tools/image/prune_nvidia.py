"""Delete the files of the nvidia-* packages that a CPU-only torch never loads (image build step).

PyPI's Linux torch wheel is the CUDA build: libtorch_cuda.so links against cuBLAS, cuFFT,
cuSPARSE, NCCL, ... so those libraries must exist for `import torch` even on a CPU. Much of
what the nvidia-* wheels ship is never mapped there: cuDNN's engine libraries (cuDNN 9 loads
them on demand, on a GPU), cuSOLVER-Mg, the profiler's libraries, NVSHMEM's device bitcode,
headers and static archives: about 1.3 GB.

What stays is measured, not listed: the probe below runs `pdserve generate` on the built-in
model (import torch, torch.cuda.is_available(), a real forward pass and sampling) under
LD_DEBUG=files, and every shared object the dynamic loader mapped is kept. Everything else under
site-packages/nvidia/ is removed, then the probe runs again without them and must print the same
text. Run it with the image's Python: `python prune_nvidia.py` (no arguments).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig

PROBE = [os.path.join(os.path.dirname(sys.executable), "pdserve"), "generate", "--model", "tiny",
         "--max-tokens", "4", "--ignore-eos", "--device", "cpu", "hello"]


def run_probe(ld_debug: bool) -> tuple[str, set[str]]:
    """Run the probe; return its stdout and (with ld_debug) the real paths of the objects loaded."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    if ld_debug:
        env["LD_DEBUG"] = "files"
    proc = subprocess.run(PROBE, env=env, capture_output=True, text=True, cwd="/")
    if proc.returncode != 0:
        sys.exit(f"prune_nvidia: the probe {PROBE} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    loaded = set()
    for line in proc.stderr.splitlines():
        # "     12345:	calling init: /path/libfoo.so" is printed once per object the loader mapped.
        _, sep, path = line.partition("calling init: ")
        if sep:
            loaded.add(os.path.realpath(path.strip()))
    return proc.stdout, loaded


def main() -> None:
    root = os.path.join(sysconfig.get_paths()["purelib"], "nvidia")
    if not os.path.isdir(root):
        print(f"prune_nvidia: no {root}; nothing to prune")
        return
    before, loaded = run_probe(ld_debug=True)
    kept = sorted(p for p in loaded if p.startswith(root + os.sep))
    if not kept:
        sys.exit("prune_nvidia: the probe loaded nothing from nvidia/: is this torch's CUDA build?")
    freed = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            if os.path.islink(path) or os.path.realpath(path) in loaded or name.endswith(".py"):
                continue
            freed += os.path.getsize(path)
            os.remove(path)
    after, _ = run_probe(ld_debug=False)
    if after != before:
        sys.exit(f"prune_nvidia: the probe's output changed after pruning: {before!r} -> {after!r}")
    print(f"prune_nvidia: removed {freed / 1e6:.0f} MB under {root}; kept {len(kept)} loaded libraries:")
    for path in kept:
        print(f"  {os.path.relpath(path, root)} ({os.path.getsize(path) / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
