"""Generated inputs for `pdserve bench fuzz`: every RPC and every HTTP endpoint, with every
kind of credential, from one seeded `random.Random` (the same seed, the same inputs).

A `Case` is plain data: where it goes, with which credential, and the bytes or message it
carries. Messages start from a well-formed one and are bent: fields set to edge values
(NaN, inf, denormals, int32/int64 limits, negative counts, ids outside the vocabulary,
prompts beyond max_model_len, odd request ids), or the serialized bytes flipped, cut and
grown (invalid protobuf, invalid UTF-8 in strings). HTTP bodies are bent JSON, raw bytes,
deep nesting, lone surrogates, duplicate keys, huge numbers, wrong types.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from pdserve.rpc import PROTOCOL_VERSION
from pdserve.rpc import pdserve_pb2 as pb

CREDS = ("none", "wrong", "key", "member")  # what the caller presents
GRPC_TARGETS = (
    "Router/Generate",
    "Router/Abort",
    "Router/ListWorkers",
    "Router/Health",
    "Router/Register",
    "Decode/Reserve",
    "Decode/Start",
    "Decode/Release",
    "Decode/Renew",
    "Decode/Health",
    "Prefill/Prefill",
    "Prefill/Health",
)
HTTP_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
INTS = (0, 1, -1, 2, 7, 100, 4096, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63))
FLOATS = (0.0, 1.0, -1.0, 0.5, 1e-45, 1e-6, 3.4e38, float("nan"), float("inf"), float("-inf"))
IDS = ("", "a", "req-1", "x" * 129, "../etc", "id with space", "ünï", "dup", "r-\x00")


@dataclass(frozen=True)
class Case:
    target: str  # "Router/Generate", ... or "http"
    creds: str  # one of CREDS
    message: object = None  # a proto message, or bytes for a bent serialization
    method: str = "POST"  # http
    path: str = ""  # http
    body: bytes = b""  # http
    content_type: str = "application/json"
    cancel_after: int | None = None  # streaming RPCs: the caller cancels after this many

    @property
    def kind(self) -> str:
        return f"http {self.method} {self.path}" if self.target == "http" else self.target


class Inputs:
    """`next()` -> one Case. `vocab` and `max_model_len` aim the edge values."""

    def __init__(self, seed: int, vocab: int, max_model_len: int) -> None:
        self.rng = random.Random(seed)
        self.vocab, self.max_len = vocab, max_model_len

    def next(self) -> Case:
        rng = self.rng
        creds = rng.choice(CREDS)
        if rng.random() < 0.4:
            return self._http(creds)
        target = rng.choice(GRPC_TARGETS)
        if target == "Router/Register" and creds == "member":
            # a member may register; the fuzzer must not add a fake worker the next request
            # is routed to, so a member's registration is always impossible by construction
            message: object = self._register(impossible=True)
        else:
            message = self._message(target)
        # (a member's registration stays unbent: a flipped byte could make it possible)
        if rng.random() < 0.25 and not (target == "Router/Register" and creds == "member"):
            message = self._bend_bytes(message.SerializeToString())
        cancel = None
        if target in ("Router/Generate", "Decode/Start") and rng.random() < 0.3:
            # after the first answers, so a refusal (which comes first) is still seen
            cancel = rng.randrange(1, 4)
        return Case(target, creds, message, cancel_after=cancel)

    # -- values ------------------------------------------------------------------------
    def _int(self) -> int:
        return self.rng.choice(INTS) if self.rng.random() < 0.5 else self.rng.randrange(-5, 64)

    def _float(self) -> float:
        return self.rng.choice(FLOATS) if self.rng.random() < 0.5 else self.rng.uniform(-2, 2)

    def _tokens(self) -> list[int]:
        rng = self.rng
        n = rng.choice((0, 1, 3, 17, self.max_len - 1, self.max_len + 1, 3 * self.max_len))
        ids = [rng.randrange(self.vocab) for _ in range(n)]
        if ids and rng.random() < 0.3:
            ids[rng.randrange(n)] = rng.choice((-1, self.vocab, 2**31 - 1, -(2**31)))
        return ids

    def _sampling(self) -> pb.SamplingParams:
        rng = self.rng
        s = pb.SamplingParams(max_tokens=rng.choice((1, 2, 4, 8)), temperature=0.0, top_p=1.0)
        for _ in range(rng.randrange(4)):
            field = rng.choice(("max_tokens", "temperature", "top_p", "top_k", "seed", "stop"))
            if field in ("temperature", "top_p"):
                setattr(s, field, self._float())
            elif field == "stop":
                s.stop_token_ids.extend(self._int() % 2**31 for _ in range(rng.randrange(3)))
            elif field == "seed":
                s.has_seed, s.seed = True, self._int()
            else:
                setattr(s, field, max(-(2**31), min(2**31 - 1, self._int())))
        s.ignore_eos = rng.random() < 0.5
        return s

    def _id(self) -> str:
        rng = self.rng
        return rng.choice(IDS) if rng.random() < 0.5 else f"fz-{rng.randrange(10**6)}"

    # -- messages ----------------------------------------------------------------------
    def _message(self, target: str):
        rng = self.rng
        if target == "Router/Generate" and rng.random() < 0.3:
            return self._good_generate()
        if target == "Router/Generate":
            msg = pb.GenerateRequest(
                protocol_version=rng.choice((0, PROTOCOL_VERSION, PROTOCOL_VERSION + 1, 2**31)),
                sampling=self._sampling(),
                request_id=self._id() if rng.random() < 0.3 else "",
            )
            kind = rng.choice(("ids", "ids", "text", "none"))
            if kind == "ids":
                msg.token_ids.ids.extend(t % 2**31 if t < 0 else t for t in self._tokens())
            elif kind == "text":
                msg.text = rng.choice(("", "Hello", "é" * 50, "x " * (4 * self.max_len), "\x00"))
            return msg
        if target in ("Router/Abort", "Decode/Release"):
            return pb.AbortRequest(request_id=self._id(), unpushed=rng.random() < 0.5)
        if target == "Decode/Renew":
            return pb.RenewRequest(
                request_id=self._id(), fence=self._int() % 2**64, lease_s=self._lease()
            )
        if target == "Router/Register":
            return self._register(impossible=rng.random() < 0.5)
        if target == "Decode/Reserve":
            return pb.ReserveRequest(
                request_id=self._id(),
                prompt_token_ids=[t % 2**31 for t in self._tokens()],
                sampling=self._sampling(),
                lease_s=self._lease(),
                push_window_s=self._lease(),
            )
        if target == "Decode/Start":
            return pb.StartRequest(request_id=self._id(), first_token=self._int() % 2**31)
        if target == "Prefill/Prefill":
            return pb.PrefillRequest(
                request_id=self._id(),
                prompt_token_ids=[t % 2**31 for t in self._tokens()],
                sampling=self._sampling(),
                dest_worker_id=self._id(),
                dest_block_ids=[self._int() % 2**31 for _ in range(rng.randrange(4))],
                dest_layout=pb.KVLayout(
                    wire_version=rng.randrange(3),
                    num_blocks=self._int() % 2**31,
                    block_bytes=self._int(),
                    planes_per_layer=rng.randrange(-1, 4),
                ),
                dest_agent_metadata=rng.randbytes(rng.randrange(64)),
                dest_cached_blocks=self._int() % 2**31,
            )
        return pb.Empty()

    def _lease(self) -> float:
        return self.rng.choice((0.0, -1.0, 5.0, 30.0, 1e12, float("nan"), float("inf")))

    def _good_generate(self) -> pb.GenerateRequest:
        """A request a real client would send: real work (KV reserved, pushed, decoded,
        released) between the bad ones."""
        rng = self.rng
        msg = pb.GenerateRequest(
            protocol_version=PROTOCOL_VERSION,
            sampling=pb.SamplingParams(
                max_tokens=rng.randrange(1, 17),
                temperature=rng.choice((0.0, 0.7)),
                top_p=1.0,
                ignore_eos=True,
            ),
        )
        n = rng.randrange(1, max(2, min(64, self.max_len // 4)))
        msg.token_ids.ids.extend(rng.randrange(self.vocab) for _ in range(n))
        return msg

    def _register(self, impossible: bool) -> pb.RegisterRequest:
        rng = self.rng
        info = pb.WorkerInfo(
            worker_id=f"fake-{rng.randrange(1000)}",
            role=rng.choice(("prefill", "decode")),
            address=f"127.0.0.1:{rng.randrange(1, 65536)}",
            total_blocks=64,
            free_blocks=64,
            headroom_blocks=64,
        )
        if impossible:
            choice = rng.randrange(4)
            if choice == 0:
                info.queued_tokens = -rng.randrange(1, 2**31)
            elif choice == 1:
                info.free_blocks = info.total_blocks + 1
            elif choice == 2:
                info.role = rng.choice(("", "router", "admin"))
            else:
                info.address = rng.choice(("", "nowhere", "127.0.0.1:0", "127.0.0.1:99999"))
        return pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, worker=info)

    def _bend_bytes(self, data: bytes) -> bytes:
        rng = self.rng
        out = bytearray(data)
        for _ in range(rng.randrange(1, 6)):
            op = rng.randrange(3)
            if op == 0 and out:
                out[rng.randrange(len(out))] = rng.randrange(256)
            elif op == 1 and out:
                del out[rng.randrange(len(out)) :]
            else:
                at = rng.randrange(len(out) + 1)
                out[at:at] = rng.randbytes(rng.randrange(1, 16))
        return bytes(out)

    # -- HTTP --------------------------------------------------------------------------
    def _http(self, creds: str) -> Case:
        rng = self.rng
        path = rng.choice((*HTTP_PATHS, "/v1/nowhere", "/"))
        method = rng.choice(("POST",) * 6 + ("GET", "PUT", "DELETE"))
        content_type = rng.choice(("application/json",) * 4 + ("text/plain", ""))
        return Case("http", creds, None, method, path, self._body(), content_type)

    def _json_value(self, depth: int = 0):
        rng = self.rng
        kind = rng.randrange(8 if depth < 3 else 5)
        if kind == 0:
            return self._int()
        if kind == 1:
            return self._float()
        if kind == 2:
            return rng.choice(("", "hi", "é", "\x00", "a" * 300))
        if kind == 3:
            return rng.choice((True, False, None))
        if kind == 4:
            return [rng.randrange(self.vocab) for _ in range(rng.randrange(5))]
        if kind in (5, 6):
            return [self._json_value(depth + 1) for _ in range(rng.randrange(4))]
        return {f"k{i}": self._json_value(depth + 1) for i in range(rng.randrange(3))}

    def _body(self) -> bytes:
        rng = self.rng
        base = {"model": "m", "max_tokens": rng.choice((1, 2, 4)), "temperature": 0}
        if rng.random() < 0.5:
            base["prompt"] = rng.choice(("Hi", [1, 2, 3], [[1, 2]], "é"))
        else:
            base["messages"] = [{"role": "user", "content": "Hi"}]
        kind = rng.randrange(9)
        if kind <= 2:  # a well-formed body, some fields bent (none in a third of them)
            base["stream"] = rng.random() < 0.5
            for _ in range(rng.choice((0, 0, 1, 2, 3))):
                field = rng.choice(
                    ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream")
                    + ("n", "prompt", "messages", "stream_options", "logprobs", "model")
                )
                base[field] = self._json_value()
            text = json.dumps(base, allow_nan=True)
            return text.encode()
        if kind == 3:  # a lone surrogate, escaped the way JSON allows
            field = "prompt" if "prompt" in base else "messages"
            if field == "prompt":
                return (
                    json.dumps(base).replace('"prompt": ', '"prompt": "\\ud800" , "x": ').encode()
                )
            return json.dumps(base).replace('"Hi"', '"\\udc00 hi"').encode()
        if kind == 4:
            n = rng.choice((64, 1000, 100_000))
            return (
                ("[" * n + "]" * n).encode()
                if rng.random() < 0.5
                else ('{"a":' * n + "1" + "}" * n).encode()
            )
        if kind == 5:  # duplicate keys
            return b'{"model": "m", "max_tokens": 1, "max_tokens": 2, "prompt": "a"}'
        if kind == 6:  # huge numbers
            return rng.choice(
                (
                    b'{"prompt": "a", "max_tokens": 1e999}',
                    b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}",
                    b'{"prompt": "a", "temperature": NaN}',
                )
            )
        if kind == 7:
            return rng.randbytes(rng.randrange(64))  # not UTF-8, not JSON
        return json.dumps(self._json_value()).encode()
