"""Generated gRPC stubs for proto/pdserve.proto (do not edit; run scripts/gen_proto.py)."""

# 2: KVLayout.planes_per_layer, ReserveResponse.headroom_cost_blocks
# 3: GenerateRequest.continuation (a version-2 router refuses version-3 requests, so it
#    never ignores a continuation and repeats tokens; version-2 clients are still served)
# 4: StartRequest.prefill_here (a version-3 decode worker would ignore it and wait for a push
#    that never comes: the router registers only workers of its own version). Generate did
#    not change: clients still send GENERATE_VERSION 3, so that version-3 routers serve them
PROTOCOL_VERSION = 4
GENERATE_VERSION = 3  # what the SDK sends in GenerateRequest.protocol_version
GENERATE_VERSIONS = frozenset({0, 2, 3, PROTOCOL_VERSION})  # what a router's Generate accepts
# Generate's metadata: the router sends ACCEPTED_KEY at once (it has the request) and
# STATUS_KEY in the trailers of every status it ends a call with, so a client tells a
# router that vanished mid-request (resume it: pdserve/client.py) from one that answered
ACCEPTED_KEY = "pdserve-accepted"
STATUS_KEY = "pdserve-status"
# a failed Prefill's trailers carry UNPOSTED_KEY when no WRITE of the request was ever
# posted: its reserved blocks can take no byte of it, so the router releases them unfenced
UNPOSTED_KEY = "pdserve-unposted"
