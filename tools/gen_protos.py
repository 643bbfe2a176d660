"""Regenerate the committed gRPC modules in protos/ from protos/*.proto.

    python tools/gen_protos.py           # rewrite protos/*_pb2.py and *_pb2_grpc.py
    python tools/gen_protos.py --check   # exit 1 (naming the files) if the committed ones are stale

protoc writes ``import session_pb2 as ...`` in the *_grpc modules; they live inside the
package ``pdserve.protos``, so the imports are rewritten to ``from . import session_pb2``.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parents[1] / "protos"


def proto_files(proto_dir: Path = PROTO_DIR) -> list[Path]:
    return sorted(proto_dir.glob("*.proto"))


def generate(out_dir: Path, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Run protoc on every .proto into out_dir and make imports package-relative; return the files."""
    from grpc_tools import protoc
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    names = [p.name for p in proto_files(proto_dir)]
    if not names:
        raise SystemExit(f"no .proto files in {proto_dir}")
    rc = protoc.main(
        ["grpc_tools.protoc", f"-I{proto_dir}", f"-I{include}", f"--python_out={out_dir}",
         f"--grpc_python_out={out_dir}", *names]
    )
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    stems = [Path(n).stem for n in names]
    written = []
    for path in sorted(out_dir.glob("*_pb2*.py")):
        text = path.read_text()
        for stem in stems:
            text = re.sub(rf"^import {stem}_pb2 as ", f"from . import {stem}_pb2 as ", text, flags=re.M)
        path.write_text(text)
        written.append(path)
    return written


def stale_files(proto_dir: Path = PROTO_DIR) -> list[str]:
    """Names of generated modules that differ from (or are missing next to) the .proto files."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp), proto_dir)
        stale = []
        for path in fresh:
            committed = proto_dir / path.name
            if not committed.exists() or committed.read_text() != path.read_text():
                stale.append(path.name)
        return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that the committed modules are fresh")
    parser.add_argument("--proto-dir", type=Path, default=PROTO_DIR,
                        help="folder of the .proto files and generated modules")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files(args.proto_dir)
        if stale:
            print("stale generated modules (run `make protos`): " + ", ".join(stale))
            return 1
        print("generated modules are fresh")
        return 0
    for path in generate(args.proto_dir, args.proto_dir):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
