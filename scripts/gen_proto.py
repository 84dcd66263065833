#!/usr/bin/env python3
"""Regenerate pdserve/rpc/ from proto/pdserve.proto (grpcio-tools).

protoc writes `import pdserve_pb2` into the gRPC stub; it is rewritten to the package path
so the stubs live inside the pdserve package (never a top-level module)."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto" / "pdserve.proto"
OUT = ROOT / "pdserve" / "rpc"
FILES = ("pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{PROTO.parent}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                str(PROTO),
            ]
        )
        if rc != 0:
            raise SystemExit(f"protoc failed with exit code {rc}")
        stub = Path(tmp, "pdserve_pb2_grpc.py")
        stub.write_text(
            stub.read_text().replace(
                "import pdserve_pb2 as pdserve__pb2",
                "from pdserve.rpc import pdserve_pb2 as pdserve__pb2",
            )
        )
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            shutil.copyfile(Path(tmp, name), out_dir / name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=OUT)
    generate(parser.parse_args().out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
