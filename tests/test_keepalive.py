"""A caller whose host goes silent (here: its process stopped, so nothing answers for it)
loses its calls on our servers within the keepalive's bounds, instead of holding them (and
a server thread each) until TCP gives up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving.server import start_server

CLIENT = """
import sys, time
import grpc
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
calls = rpc.DecodeStub(grpc.insecure_channel(sys.argv[1])).Feed(pb.FeedRequest(feed_id="f"))
next(calls)
print("open", flush=True)
time.sleep(120)
"""


def test_a_stopped_callers_stream_ends_within_the_keepalive():
    opened, ended = threading.Event(), threading.Event()

    class Decode(rpc.DecodeServicer):
        def Feed(self, request, context):
            yield pb.FeedBatch()
            opened.set()
            while context.is_active():
                time.sleep(0.05)
            ended.set()

    server, port = start_server(
        lambda s: rpc.add_DecodeServicer_to_server(Decode(), s),
        "127.0.0.1",
        0,
        keepalive=(0.5, 0.5),
    )
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, f"127.0.0.1:{port}"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert client.stdout.readline().strip() == "open" and opened.wait(10)
        time.sleep(1.5)  # a live client answers pings: its call stays
        assert not ended.is_set()
        os.kill(client.pid, signal.SIGSTOP)
        assert ended.wait(10), "the stopped caller's call was not ended"
    finally:
        client.kill()
        client.wait(10)
        server.stop(None)
