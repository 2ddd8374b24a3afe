"""Rebuild `grpc_predict_v2.pb`, the compiled descriptor of the vendored .proto beside it, with
grpcio-tools' protoc: `python optiserve/grpc_protocol/build.py` (after editing the .proto; a test
checks the two agree). The package reads the descriptor, so serving needs no protoc and no
generated code tied to one protobuf release."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = HERE / "grpc_predict_v2.proto"
DESCRIPTOR = HERE / "grpc_predict_v2.pb"


def compile_descriptor() -> bytes:
    """The FileDescriptorSet protoc makes of the .proto (bytes); needs grpcio-tools."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        code = protoc.main(["protoc", f"-I{HERE}", f"--descriptor_set_out={out}", PROTO.name])
        if code != 0:
            raise RuntimeError(f"protoc failed on {PROTO} (exit {code})")
        return out.read_bytes()


def main() -> int:
    from optiserve.files import atomic_write

    with atomic_write(DESCRIPTOR, "wb") as f:
        f.write(compile_descriptor())
    print(f"wrote {DESCRIPTOR}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
