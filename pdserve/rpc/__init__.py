"""Generated gRPC stubs for proto/pdserve.proto (do not edit; run scripts/gen_proto.py)."""

PROTOCOL_VERSION = 2  # 2: KVLayout.planes_per_layer, ReserveResponse.headroom_cost_blocks
