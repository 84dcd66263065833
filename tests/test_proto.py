"""The committed gRPC stubs are exactly what proto/pdserve.proto generates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = ("pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py")


def test_regenerating_the_stubs_changes_nothing(tmp_path):
    # In its own process: grpc_tools' bundled protoc crashes when loaded into a process that
    # already imported protobuf's upb runtime (seen with grpcio-tools 1.85.1, protobuf 7.36).
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        check=True,
        timeout=120,
    )
    for name in FILES:
        committed = (ROOT / "pdserve" / "rpc" / name).read_text()
        assert (tmp_path / name).read_text() == committed, (
            f"{name} is stale: run scripts/gen_proto.py"
        )


def test_stubs_live_inside_the_package():
    text = (ROOT / "pdserve" / "rpc" / "pdserve_pb2_grpc.py").read_text()
    assert "from pdserve.rpc import pdserve_pb2" in text
    assert "\nimport pdserve_pb2" not in text
