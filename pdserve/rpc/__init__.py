"""Generated gRPC stubs for proto/pdserve.proto (do not edit; run scripts/gen_proto.py)."""

PROTOCOL_VERSION = 1
