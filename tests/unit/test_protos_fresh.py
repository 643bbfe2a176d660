"""The committed generated gRPC modules match protos/*.proto, and import package-relatively.

protoc runs in a child process: grpc_tools' compiled protoc crashes when it is loaded into an
interpreter that already holds torch's and NIXL's native libraries (as pytest's does).
"""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GEN = REPO / "tools" / "gen_protos.py"


def _gen(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GEN), *args], capture_output=True, text=True, timeout=120)


def test_generated_modules_are_fresh():
    out = _gen("--check")
    assert out.returncode == 0, f"stale generated modules, run `make protos`: {out.stdout}{out.stderr}"


def test_stale_module_is_detected(tmp_path):
    for proto in (REPO / "protos").glob("*.proto"):
        (tmp_path / proto.name).write_text(proto.read_text())
    assert _gen("--proto-dir", str(tmp_path)).returncode == 0
    assert _gen("--check", "--proto-dir", str(tmp_path)).returncode == 0
    proto = tmp_path / "session.proto"
    proto.write_text(proto.read_text().replace("bool draining = 8;", "bool draining = 8;\n  int32 extra = 99;"))
    out = _gen("--check", "--proto-dir", str(tmp_path))
    assert out.returncode == 1
    assert "session_pb2.py" in out.stdout


def test_grpc_modules_import_relatively():
    text = (REPO / "protos" / "session_pb2_grpc.py").read_text()
    assert "from . import session_pb2" in text
    from pdserve.protos import PROTOCOL_VERSION, session_pb2, session_pb2_grpc  # noqa: F401

    assert "pdserve.protos" in session_pb2_grpc.__name__
    assert isinstance(PROTOCOL_VERSION, int)
    assert "session_pb2" not in sys.modules  # nothing imported the generated module top-level
