"""The committed generated gRPC modules match protos/*.proto, and import package-relatively."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _gen_module():
    spec = importlib.util.spec_from_file_location("gen_protos", REPO / "tools" / "gen_protos.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_modules_are_fresh():
    stale = _gen_module().stale_files()
    assert stale == [], f"stale generated modules, run `make protos`: {stale}"


def test_stale_module_is_detected(tmp_path):
    gen = _gen_module()
    for proto in (REPO / "protos").glob("*.proto"):
        (tmp_path / proto.name).write_text(proto.read_text())
    gen.generate(tmp_path, tmp_path)
    assert gen.stale_files(tmp_path) == []
    proto = tmp_path / "session.proto"
    proto.write_text(proto.read_text().replace("bool draining = 8;", "bool draining = 8;\n  int32 extra = 10;"))
    assert "session_pb2.py" in gen.stale_files(tmp_path)


def test_grpc_modules_import_relatively():
    text = (REPO / "protos" / "session_pb2_grpc.py").read_text()
    assert "from . import session_pb2" in text
    from pdserve.protos import PROTOCOL_VERSION, session_pb2, session_pb2_grpc  # noqa: F401

    assert "pdserve.protos" in session_pb2_grpc.__name__
    assert isinstance(PROTOCOL_VERSION, int)
    assert "session_pb2" not in sys.modules  # nothing imported the generated module top-level
