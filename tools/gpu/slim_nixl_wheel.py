"""A NIXL wheel that fits what a GPU run carries: the published nixl-cu1X wheel cut to the UCX backend and the
libraries it loads (issue 51 item 2).

    python tools/gpu/slim_nixl_wheel.py WHEEL [--out DIR] [--keep-ib]

The published wheel (nixl-cu13 1.5.1: 59 MB) holds every NIXL plugin (object stores, GDS, libfabric, ...),
their SDKs (AWS, Azure, gRPC, etcd) and the expert-parallel package ``nixl_ep_cu1X``; a run carries at most
64 MiB with the repository. pdserve's CacheStore uses one backend, UCX (``cachestore/nixl_backend.py``), so
the slim wheel keeps:

- the Python package (``nixl_cu1X/``: its bindings) and the dist-info (RECORD rewritten for what is kept);
- the UCX plugin (``.nixl_cu1X.mesonpy.libs/plugins/libplugin_UCX.so``) and UCX's transport modules that one
  machine uses: ``ucx/libuct_cuda`` (cuda_copy, cuda_ipc, gdr_copy), ``ucx/libucm_cuda`` (CUDA memory hooks),
  ``ucx/libuct_cma`` (shared memory between processes); with ``--keep-ib`` the InfiniBand/RoCE modules too
  (RDMA between nodes; they add libibverbs, libmlx5, libnl);
- every library those load, found by following their ELF ``NEEDED`` entries (``readelf -d``) to files of the
  wheel, whatever their directory (the wheel's RPATHs are ``$ORIGIN``-relative, so the layout stays).

Libraries outside the wheel (libc, libstdc++, the driver's libcuda and libnvidia-ml, CUDA's libcudart from
torch's nvidia wheels) are the machine's. Prints what was kept and dropped, and the sizes.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

UCX_MODULES = ("libuct_cuda", "libucm_cuda", "libuct_cma")
IB_MODULES = ("libuct_ib",)  # libuct_ib, libuct_ib_mlx5*, libuct_ib_efa
NEEDED = re.compile(r"\(NEEDED\)\s+Shared library: \[(.+?)\]")


def roots(names: list[str], package: str, keep_ib: bool) -> set[str]:
    """The files kept for themselves: the package, the dist-info, the UCX plugin and modules."""
    modules = UCX_MODULES + (IB_MODULES if keep_ib else ())
    keep = set()
    for name in names:
        p = PurePosixPath(name)
        if p.parts[0] == package or p.parts[0].endswith(".dist-info") and p.name != "RECORD":
            keep.add(name)
        elif p.name == "libplugin_UCX.so":
            keep.add(name)
        elif p.parent.name == "ucx" and p.name.startswith(modules) and ".so" in p.name:
            keep.add(name)
    return keep


def needed(path: Path) -> list[str]:
    """The ELF NEEDED entries of ``path`` (readelf, binutils)."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return NEEDED.findall(out)


def closure(tree: Path, names: list[str], keep: set[str]) -> set[str]:
    """``keep`` and every library of the wheel that the kept ELF files need, transitively."""
    by_base: dict[str, str] = {}
    for name in names:
        by_base.setdefault(PurePosixPath(name).name, name)
    todo, done = [n for n in keep if ".so" in n], set(keep)
    while todo:
        for lib in needed(tree / todo.pop()):
            found = by_base.get(lib)
            if found and found not in done:
                done.add(found)
                todo.append(found)
    return done


def record_line(name: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [name, f"sha256={digest}", str(len(data))]


def slim(wheel: Path, out_dir: Path, keep_ib: bool) -> Path:
    with zipfile.ZipFile(wheel) as z, tempfile.TemporaryDirectory() as tmp:
        names = [i.filename for i in z.infolist() if not i.is_dir()]
        package = next(PurePosixPath(n).parts[0] for n in names if PurePosixPath(n).name == "_api.py")
        z.extractall(tmp)
        kept = closure(Path(tmp), names, roots(names, package, keep_ib))
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        out = out_dir / wheel.name
        out_dir.mkdir(parents=True, exist_ok=True)
        rows = []
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as w:
            for name in sorted(kept):
                data = z.read(name)
                info = z.getinfo(name)
                w.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
                rows.append(record_line(name, data))
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerows(rows + [[f"{dist_info}/RECORD", "", ""]])
            w.writestr(f"{dist_info}/RECORD", buf.getvalue())
    dropped = sorted(set(names) - kept - {f"{dist_info}/RECORD"})
    print(f"kept {len(kept)} files, dropped {len(dropped)} (top folders dropped: "
          f"{sorted({PurePosixPath(n).parts[0] for n in dropped} - {PurePosixPath(n).parts[0] for n in kept})})")
    for name in sorted(n for n in kept if ".so" in n):
        print(f"  kept {name}")
    print(f"{wheel.name}: {wheel.stat().st_size / 2**20:.1f} MiB -> {out.stat().st_size / 2**20:.1f} MiB ({out})")
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("wheel", type=Path, help="the published nixl-cu12/nixl-cu13 wheel")
    p.add_argument("--out", type=Path, default=Path(".whl"), help="folder of the slim wheel (default .whl)")
    p.add_argument("--keep-ib", action="store_true", help="keep UCX's InfiniBand/RoCE modules (RDMA between nodes)")
    a = p.parse_args(argv)
    if a.out.resolve() == a.wheel.resolve().parent:
        p.error("--out must differ from the published wheel's folder (the slim wheel has the same name)")
    slim(a.wheel, a.out, a.keep_ib)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
