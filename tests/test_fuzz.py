"""The fuzz suite (pdserve bench fuzz): its generator reaches every RPC and every kind of bad
input, its verdicts catch what they must, and a short pass against a launched cluster finds
no crash, 5xx, hang, open door, leaked block or changed greedy output (the long pass,
10,000 inputs, is the benchmark command; docs/security.md)."""

from __future__ import annotations

import collections

import grpc
import pytest

from pdserve.bench.fuzz import Fuzzer, bench_fuzz, format_table, ok
from pdserve.bench.fuzz_inputs import CREDS, GRPC_TARGETS, Case, Inputs
from pdserve.rpc import pdserve_pb2 as pb


def test_the_generator_covers_every_rpc_credential_and_bad_body():
    gen = Inputs(seed=3, vocab=100, max_model_len=64)
    cases = [gen.next() for _ in range(3000)]
    targets = collections.Counter(c.target for c in cases)
    assert set(targets) == {*GRPC_TARGETS, "http"}
    assert {c.creds for c in cases} == set(CREDS)
    assert sum(isinstance(c.message, bytes) for c in cases) > 300  # bent serializations
    bodies = [c.body for c in cases if c.target == "http"]
    assert any(b"\\ud800" in b or b"\\udc00" in b for b in bodies)  # lone surrogates
    assert any(b.startswith(b"[" * 1000) or b.startswith(b'{"a":' * 1000) for b in bodies)
    assert any(b"1e999" in b or b"9" * 5000 in b or b"NaN" in b for b in bodies)
    assert any(b.count(b'"max_tokens"') == 2 for b in bodies)  # duplicate keys
    gen = Inputs(seed=3, vocab=100, max_model_len=64)
    again = [gen.next() for _ in range(50)]
    assert again == cases[:50]  # seeded: the same inputs again


def test_a_members_registration_is_always_impossible():
    """The fuzzer holds the secret; a registration it could make succeed would add a fake
    worker that later requests are routed to."""
    from pdserve.router.service import check_worker_info

    gen = Inputs(seed=5, vocab=100, max_model_len=64)
    member = [c for c in (gen.next() for _ in range(4000)) if c.target == "Router/Register"]
    member = [c for c in member if c.creds == "member" and not isinstance(c.message, bytes)]
    assert member
    for case in member:
        with pytest.raises(ValueError):
            check_worker_info(case.message.worker)


@pytest.mark.parametrize(
    "target, creds, code, failure",
    [
        ("Router/Generate", "key", grpc.StatusCode.UNKNOWN, "crash"),
        ("Router/Generate", "key", grpc.StatusCode.INTERNAL, "crash"),
        ("Router/Generate", "none", grpc.StatusCode.DEADLINE_EXCEEDED, "hang"),
        ("Router/Generate", "none", grpc.StatusCode.OK, "door"),  # no key, served
        ("Router/Generate", "key", grpc.StatusCode.UNAUTHENTICATED, "door"),  # key refused
        ("Decode/Reserve", "key", grpc.StatusCode.OK, "door"),  # a client reserving blocks
        ("Decode/Reserve", "wrong", grpc.StatusCode.INVALID_ARGUMENT, "door"),  # parsed
        ("Decode/Reserve", "key", grpc.StatusCode.PERMISSION_DENIED, None),
        ("Decode/Reserve", "member", grpc.StatusCode.RESOURCE_EXHAUSTED, None),
        ("Decode/Health", "none", grpc.StatusCode.OK, None),
        ("Router/Abort", "none", grpc.StatusCode.UNAUTHENTICATED, None),
    ],
)
def test_verdicts(target, creds, code, failure):
    assert Fuzzer._verdict(Case(target, creds, pb.Empty()), code) == failure


def test_the_doors_the_fuzzer_expects_are_the_doors_the_servers_keep():
    """The fuzzer writes out the doors docs/security.md promises; the servers' table must
    be the same (a method filed under the wrong door fails here and in the fuzz pass)."""
    from pdserve.bench.fuzz import DOORS
    from pdserve.serving import auth

    assert {f"/pdserve.v1.{m}": door for m, door in DOORS.items()} == dict(auth.DOORS)


@pytest.mark.slow
def test_a_short_fuzz_pass_against_a_launched_cluster():
    report = bench_fuzz("tiny-llama", inputs=400, seed=11, batch=200, threads=4)
    assert report["inputs"] == 400 and report["batches"] == 2
    assert ok(report), format_table(report)
