"""Generated gRPC stubs for proto/pdserve.proto (do not edit; run scripts/gen_proto.py)."""

# 2: KVLayout.planes_per_layer, ReserveResponse.headroom_cost_blocks
# 3: GenerateRequest.continuation (an old router would ignore it and repeat tokens)
PROTOCOL_VERSION = 3
# Generate's metadata: the router sends ACCEPTED_KEY at once (it has the request) and
# STATUS_KEY in the trailers of every status it ends a call with, so a client tells a
# router that vanished mid-request (resume it: pdserve/client.py) from one that answered
ACCEPTED_KEY = "pdserve-accepted"
STATUS_KEY = "pdserve-status"
