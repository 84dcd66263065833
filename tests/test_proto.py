"""The committed gRPC stubs are exactly what proto/pdserve.proto generates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_regenerating_the_stubs_changes_nothing(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.generate(tmp_path)
    for name in gen.FILES:
        committed = (ROOT / "pdserve" / "rpc" / name).read_text()
        assert (tmp_path / name).read_text() == committed, (
            f"{name} is stale: run scripts/gen_proto.py"
        )


def test_stubs_live_inside_the_package():
    text = (ROOT / "pdserve" / "rpc" / "pdserve_pb2_grpc.py").read_text()
    assert "from pdserve.rpc import pdserve_pb2" in text
    assert "\nimport pdserve_pb2" not in text
