"""`pdserve bench fuzz`: generated inputs (pdserve/bench/fuzz_inputs.py) against a launched
cluster with a cluster secret and an API key, every RPC and the HTTP API, then the checks a
user would make of a server that took abuse:

    crash      a gRPC answer UNKNOWN / INTERNAL / DATA_LOSS (a handler raised), or a process
               of the cluster exited
    http_5xx   an HTTP answer >= 500
    hang       no answer within the call's deadline
    door       a call without the right credential that was not refused UNAUTHENTICATED /
               PERMISSION_DENIED (HTTP 401), or one with it that was
    leak       after each batch, blocks still held once the fuzzer released what it reserved
    greedy     after each batch and at the end, the cluster's greedy tokens for fixed prompts
               differ from a fresh cluster's

Everything is seeded: the same --seed replays the same inputs.
"""

from __future__ import annotations

import collections
import http.client
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType

import grpc

from pdserve.bench.fuzz_inputs import Case, Inputs
from pdserve.client import Client
from pdserve.progress import progress
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.serving import auth
from pdserve.serving.auth import Security

API_KEY = "fuzz-api-key-0123456789"
CRASH = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS})
REFUSED = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
DEADLINE_S = 60.0  # longer than any legitimate answer here: tiny prompts, <= 8 new tokens
HTTP_PUBLIC = ("/health", "/metrics")
REFERENCE = ([1, 2, 3, 4], list(range(10, 60)), [7] * 20)
# the doors as docs/security.md promises them, written out here rather than read from the
# table the servers enforce (a method filed under the wrong door there must fail here)
DOORS = MappingProxyType(
    {
        "Router/Generate": "client",
        "Router/Abort": "client",
        "Router/ListWorkers": "client",
        "Router/Health": "open",
        "Router/Register": "cluster",
        "Decode/Reserve": "cluster",
        "Decode/Start": "cluster",
        "Decode/Release": "cluster",
        "Decode/Renew": "cluster",
        "Decode/Health": "open",
        "Prefill/Prefill": "cluster",
        "Prefill/Health": "open",
    }
)
REFERENCE_TOKENS = 8


def _reference(client) -> list[list[int]]:
    return [
        client.generate(p, max_tokens=REFERENCE_TOKENS, temperature=0, ignore_eos=True).token_ids
        for p in REFERENCE
    ]


def _creds(name: str, secret: str) -> Security:
    return {
        "none": Security(),
        "wrong": Security(cluster_secret="not-the-cluster-secret", api_key="not-a-key"),
        "key": Security(api_key=API_KEY),
        "member": Security(cluster_secret=secret),
    }[name]


class Fuzzer:
    def __init__(self, cluster, vocab: int, max_model_len: int) -> None:
        self.cluster = cluster
        self.member = Client(cluster.address, security=cluster.security)
        addresses = {"Router": cluster.address}
        for w in self.member.workers():
            addresses[w.role.capitalize()] = w.address
        secret = cluster.security.cluster_secret
        self.channels = {
            (service, name): auth.channel(address, _creds(name, secret))
            for service, address in addresses.items()
            for name in ("none", "wrong", "key", "member")
        }
        self.vocab, self.max_len = vocab, max_model_len
        self.reserved: set[str] = set()  # ids a member's Reserve succeeded for

    # -- one case --------------------------------------------------------------------------
    def run(self, case: Case) -> tuple[str, str | None]:
        """-> (answer, failure category or None)."""
        if case.target == "http":
            return self._http(case)
        service, method = case.target.split("/")
        channel = self.channels[(service, case.creds)]
        message = case.message
        serialize = None if isinstance(message, bytes) else type(message).SerializeToString
        path = f"/pdserve.v1.{case.target}"
        streaming = case.target in ("Router/Generate", "Decode/Start")
        make = channel.unary_stream if streaming else channel.unary_unary
        call = make(path, request_serializer=serialize, response_deserializer=None)
        try:
            reply = call(message, timeout=DEADLINE_S)
            if streaming and case.cancel_after == 0:
                reply.cancel()  # before any answer: the release path of a queued request
            if streaming:
                for got, _ in enumerate(reply, start=1):
                    if case.cancel_after is not None and got >= case.cancel_after:
                        reply.cancel()  # the caller walks away mid-stream
                        break
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
        if code == grpc.StatusCode.OK and case.target == "Decode/Reserve":
            reserve = message
            if isinstance(message, bytes):  # bent, and it still parsed: the server read this
                reserve = pb.ReserveRequest.FromString(message)
            self.reserved.add(reserve.request_id)
        return code.name, self._verdict(case, code)

    @staticmethod
    def _verdict(case: Case, code: grpc.StatusCode) -> str | None:
        if code in CRASH:
            return "crash"
        if code == grpc.StatusCode.CANCELLED and case.cancel_after is not None:
            return None  # we cancelled it: it says nothing about the door
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "hang"
        door = DOORS[case.target]
        shut = (door == "client" and case.creds in ("none", "wrong")) or (
            door == "cluster" and case.creds != "member"
        )
        if shut != (code in REFUSED):
            return "door"
        return None

    def _http(self, case: Case) -> tuple[str, str | None]:
        host, port = self.cluster.http_address.rsplit(":", 1)
        headers = {"Content-Type": case.content_type} if case.content_type else {}
        if case.creds in ("key", "member"):
            headers["Authorization"] = f"Bearer {API_KEY}"
        elif case.creds == "wrong":
            headers["Authorization"] = "Bearer not-a-key"
        connection = http.client.HTTPConnection(host, int(port), timeout=DEADLINE_S)
        try:
            connection.request(case.method, case.path, body=case.body, headers=headers)
            response = connection.getresponse()
            response.read()
            status = response.status
        except TimeoutError:
            return "timeout", "hang"
        except (ConnectionError, http.client.HTTPException) as e:
            return type(e).__name__, "crash"
        finally:
            connection.close()
        if status >= 500:
            return str(status), "http_5xx"
        shut = case.creds in ("none", "wrong") and case.path not in HTTP_PUBLIC
        if shut != (status == 401):
            return str(status), "door"
        return str(status), None

    # -- between batches ---------------------------------------------------------------------
    def release_and_count_held(self, timeout_s: float = 30.0) -> int:
        """Releases every reservation the fuzzer made, then waits for every pool to be
        whole again -> blocks still held at the deadline (0: none leaked)."""
        stub = rpc.DecodeStub(self.channels[("Decode", "member")])
        for rid in sorted(self.reserved):
            # no prefill ever pushed into them (the fuzzed Prefill requests name layouts
            # no worker has), so they need no fence
            stub.Release(pb.AbortRequest(request_id=rid, unpushed=True), timeout=10)
        self.reserved.clear()
        released = time.monotonic()
        deadline = released + timeout_s
        while True:
            workers = self.member.workers()
            # counts from heartbeats sent after the releases only: an older one may predate
            # a reservation made at the end of the batch
            fresh = all(w.last_heartbeat_age_s < time.monotonic() - released for w in workers)
            held = sum(w.total_blocks - w.free_blocks for w in workers)
            if (fresh and held == 0) or time.monotonic() > deadline:
                return held
            time.sleep(0.2)

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self.member.close()


def bench_fuzz(
    model: str,
    inputs: int = 10_000,
    seed: int = 0,
    batch: int = 500,
    threads: int = 8,
    num_kv_blocks: int = 64,
) -> dict:
    from pdserve.launch import Cluster
    from pdserve.weights import resolve

    config = resolve(model).config
    worker_args = ["--num-kv-blocks", str(num_kv_blocks)]
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys"
        keys.write_text(API_KEY + "\n")
        started = time.monotonic()
        with (
            Cluster(model, 1, 1, http_port=0, worker_args=worker_args) as fresh,
            Client(fresh.address, security=fresh.security) as c,
        ):
            expected = _reference(c)
        with Cluster(
            model, 1, 1, http_port=0, worker_args=worker_args, api_key_file=str(keys)
        ) as cluster:
            report = _fuzz(cluster, config, inputs, seed, batch, threads, expected)
    report["wall_s"] = time.monotonic() - started
    report.update(model=model, seed=seed, num_kv_blocks=num_kv_blocks, threads=threads)
    return report


def _fuzz(cluster, config, inputs, seed, batch, threads, expected) -> dict:
    fuzzer = Fuzzer(cluster, config.vocab_size, config.max_position)
    generator = Inputs(seed, config.vocab_size, config.max_position)
    answers: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failures = collections.Counter()
    examples: list[dict] = []
    leaked, greedy_ok, batches = [], True, 0
    bar = progress(total=inputs, desc="bench fuzz", unit="input")
    with ThreadPoolExecutor(threads) as pool:
        done = 0
        while done < inputs:
            cases = [generator.next() for _ in range(min(batch, inputs - done))]
            for case, (answer, failure) in zip(cases, pool.map(fuzzer.run, cases)):
                answers[case.kind][answer] += 1
                if failure is not None:
                    failures[failure] += 1
                    if len(examples) < 20:
                        examples.append(_example(case, answer, failure))
                bar.update(1)
            done += len(cases)
            batches += 1
            leaked.append(fuzzer.release_and_count_held())
            if any(p.poll() is not None for p in cluster.procs):
                failures["crash"] += 1
                examples.append({"failure": "crash", "answer": "a cluster process exited"})
                break
            greedy_ok = greedy_ok and _reference(fuzzer.member) == expected
    fuzzer.close()
    return {
        "benchmark": "fuzz",
        "inputs": done,
        "batches": batches,
        "failures": {k: failures.get(k, 0) for k in ("crash", "http_5xx", "hang", "door")},
        "leaked_blocks_after_each_batch": leaked,
        "greedy_equal_to_a_fresh_cluster": greedy_ok,
        "answers": {kind: dict(c) for kind, c in sorted(answers.items())},
        "examples": examples,
    }


def _example(case: Case, answer: str, failure: str) -> dict:
    shown = case.body[:200] if case.target == "http" else case.message
    body = shown if isinstance(shown, (bytes, str)) else str(shown)[:200]
    return {
        "failure": failure,
        "kind": case.kind,
        "creds": case.creds,
        "answer": answer,
        "input": repr(body)[:300],
    }


def ok(report: dict) -> bool:
    return (
        not any(report["failures"].values())
        and not any(report["leaked_blocks_after_each_batch"])
        and report["greedy_equal_to_a_fresh_cluster"]
    )


def format_table(report: dict) -> str:
    lines = [
        f"pdserve bench fuzz: {report['inputs']} inputs ({report['model']}, seed "
        f"{report['seed']}, {report['threads']} threads, {report['wall_s']:.0f} s)",
        f"{'input kind':<36} {'count':>6}  answers",
    ]
    for kind, answers in report["answers"].items():
        top = ", ".join(f"{a} {n}" for a, n in sorted(answers.items(), key=lambda x: -x[1])[:4])
        lines.append(f"{kind:<36} {sum(answers.values()):>6}  {top}")
    f = report["failures"]
    lines.append(
        f"crashes {f['crash']}, HTTP 5xx {f['http_5xx']}, hangs {f['hang']}, door errors "
        f"{f['door']}; leaked blocks after each batch: max "
        f"{max(report['leaked_blocks_after_each_batch'], default=0)}; greedy output equals a "
        f"fresh cluster's: {report['greedy_equal_to_a_fresh_cluster']}"
    )
    for e in report["examples"][:10]:
        lines.append(
            f"  {e['failure']}: {e.get('kind')} [{e.get('creds')}] -> {e['answer']}: "
            f"{e.get('input', '')[:120]}"
        )
    lines.append("PASS" if ok(report) else "FAIL")
    return "\n".join(lines)
