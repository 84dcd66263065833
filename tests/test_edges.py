"""Every edge refuses bad input with a clear typed error (issue 15): the HTTP front door's
bodies and API keys, SamplingParams, and RequestValidator's cost guards.

The front door runs for real (aiohttp on a thread) against a fake router: a gRPC server in
this process whose Generate records each call's metadata and answers two tokens, so no
cluster is needed.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from concurrent import futures
from http.client import HTTPException

import grpc
import pytest
import torch
from http_calls import http
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from pdserve.engine.sampler import sample
from pdserve.openai import protocol as proto
from pdserve.openai.server import MAX_BODY_BYTES, RouterView, start_http
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as rpc
from pdserve.sampling_params import GREEDY_BELOW, SamplingParams
from pdserve.tokenizer import ByteTokenizer
from pdserve.validation import MAX_TOKEN_CHARS, RequestValidator

VOCAB = 300
MAX_MODEL_LEN = 64
KEYS = ("sk-right", "sk-other")
TOKENIZER = ByteTokenizer(VOCAB)


class FakeRouter(rpc.RouterServicer):
    """Answers "hi" (two byte tokens), or aborts with `abort` when set."""

    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []  # one per Generate call
        self.abort: grpc.StatusCode | None = None
        self.finish_reason = "length"

    def Generate(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        if self.abort is not None:
            context.abort(self.abort, f"fake router says {self.abort.name}")
        yield pb.GenerateResponse(
            request_id=request.request_id,
            token_ids=[104, 105],
            finished=True,
            finish_reason=self.finish_reason,
        )


@pytest.fixture(scope="module")
def router():
    fake = FakeRouter()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    rpc.add_RouterServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield fake, port
    server.stop(grace=None)


def view(**extra) -> RouterView:
    return RouterView(
        vocab_size=VOCAB,
        max_model_len=MAX_MODEL_LEN,
        tokenizer=TOKENIZER,
        metrics=CollectorRegistry(),
        workers=lambda: (1, 1),
        **extra,
    )


@pytest.fixture(scope="module")
def open_door(router):
    fake, port = router
    server = start_http(view(), port, "127.0.0.1", 0, "fake")
    yield f"http://127.0.0.1:{server.port}"
    server.close()


channels: list[str] = []  # addresses the keyed door's channel factory was asked for


def recording_channel(address: str) -> grpc.aio.Channel:
    channels.append(address)
    return grpc.aio.insecure_channel(address)


@pytest.fixture(scope="module")
def keyed_door(router):
    fake, port = router
    front = view(
        api_keys=KEYS,
        grpc_metadata=(("x-router-credential", "router-secret"),),
        channel_factory=recording_channel,
    )
    server = start_http(front, port, "127.0.0.1", 0, "fake")
    yield f"http://127.0.0.1:{server.port}"
    server.close()


# -- bodies ----------------------------------------------------------------------------------

MALFORMED = [
    # (path, body, param, a fragment of the message)
    ("c", b'{"prompt": "a\\ud800b"}', "prompt", "prompt: a lone surrogate U+D800"),
    ("c", b'{"prompt": ["ok", "\\udfff"]}', "prompt", "prompt[1]: a lone surrogate"),
    ("chat", b'{"messages": [{"role": "user", "content": "\\udc00"}]}', "messages", "surrogate"),
    ("c", b'{"prompt": "x", "x": ' + b"[" * 1000 + b"]" * 1000 + b"}", None, "nested more"),
    ("c", b'{"prompt": "x", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "nested"),
    ("c", b'{"prompt": "x", "x": ' + b'{"a": ' * 40 + b"1" + b"}" * 40 + b"}", "x", "nested"),
    ("c", b'{"prompt": "x", "prompt": "y"}', "prompt", "prompt: the key appears twice"),
    ("chat", b'{"messages": [{"role": "user", "role": "x", "content": "c"}]}', "messages", "twice"),
    ("c", b'{"prompt": "x", "temperature": 1e999}', "temperature", "out of range for a double"),
    ("c", b'{"prompt": "x", "top_p": -1e999}', "top_p", "out of range for a double"),
    ("c", b'{"prompt": "x", "max_tokens": ' + b"7" * 5000 + b"}", "max_tokens", "5000 digits"),
    ("c", b'{"prompt": [1, ' + b"2" * 40 + b"]}", "prompt", "prompt[1]: an integer of 40"),
    ("c", b'{"prompt": "x", "temperature": NaN}', "temperature", "NaN is not a JSON number"),
    ("c", b'{"prompt": "x", "top_p": Infinity}', "top_p", "Infinity is not a JSON number"),
    ("c", b"-Infinity", None, "body: -Infinity"),
    ("c", b"[1, 2]", None, "JSON object"),
    ("c", b'"a string"', None, "JSON object"),
    ("c", b"null", None, "JSON object"),
    ("chat", b"7", None, "JSON object"),
    ("c", b'{"prompt": "caf\xe9"}', None, "byte 15 is not UTF-8"),
    ("c", b"\xff\xfe{}", None, "not UTF-8"),
    ("c", b"", None, "body: empty"),
    ("c", b"  \n", None, "body: empty"),
    ("c", b'{"prompt": ', None, "not valid JSON"),
    ("c", b'\xef\xbb\xbf{"prompt": "x"}', None, "not valid JSON"),  # a BOM is not JSON
]

WRONG_TYPES = [
    ("c", {"prompt": {}}, "prompt"),
    ("c", {"prompt": [1.5]}, "prompt"),
    ("c", {"prompt": [True]}, "prompt"),
    ("c", {"prompt": None}, "prompt"),
    ("chat", {"messages": {}}, "messages"),
    ("chat", {"messages": ["hi"]}, "messages"),
    ("chat", {"messages": [{"role": ["user"], "content": "x"}]}, "messages"),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "messages",
    ),
    ("c", {"max_tokens": "1"}, "max_tokens"),
    ("c", {"max_tokens": True}, "max_tokens"),
    ("chat", {"max_completion_tokens": 2.0}, "max_completion_tokens"),
    ("c", {"temperature": []}, "temperature"),
    ("c", {"temperature": False}, "temperature"),
    ("c", {"top_p": "0.5"}, "top_p"),
    ("c", {"top_k": 1.5}, "top_k"),
    ("c", {"top_k": -2}, "top_k"),
    ("c", {"seed": True}, "seed"),
    ("c", {"seed": 2**64}, "seed"),
    ("c", {"stop": {}}, "stop"),
    ("c", {"stop": [1]}, "stop"),
    ("c", {"stop": "x" * (proto.MAX_STOP_CHARS + 1)}, "stop"),
    ("c", {"stream": 1}, "stream"),
    ("c", {"stream": True, "stream_options": []}, "stream_options"),
    ("c", {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ("c", {"n": "2"}, "n"),
    ("c", {"best_of": 1.0}, "best_of"),
    ("c", {"echo": 1}, "echo"),
    ("c", {"logprobs": "5"}, "logprobs"),
    ("c", {"presence_penalty": "0"}, "presence_penalty"),
    ("c", {"frequency_penalty": 3}, "frequency_penalty"),
    ("c", {"repetition_penalty": 1.2}, "repetition_penalty"),
    ("c", {"min_p": 0.1}, "min_p"),
    # options that would change the answer: refused, not ignored
    ("c", {"logit_bias": {"5": -100}}, "logit_bias"),
    ("c", {"suffix": "end"}, "suffix"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"function_call": {"name": "f"}}, "function_call"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("c", {"ignore_eos": "true"}, "ignore_eos"),
    ("c", {"model": ["fake"]}, "model"),
]

PATHS = {"c": "/v1/completions", "chat": "/v1/chat/completions"}
GOOD = {"c": {"prompt": "x"}, "chat": {"messages": [{"role": "user", "content": "x"}]}}


@pytest.mark.parametrize(
    "kind,body,param,fragment", MALFORMED, ids=[f"{k}:{b[:40]!r}" for k, b, _, _ in MALFORMED]
)
def test_malformed_bodies_are_400_naming_the_problem(open_door, kind, body, param, fragment):
    status, _, reply = http(open_door, PATHS[kind], body)
    assert status == 400, reply
    assert reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["param"] == param
    assert fragment in reply["error"]["message"]


@pytest.mark.parametrize(
    "kind,fields,param", WRONG_TYPES, ids=[f"{k}:{json.dumps(f)[:40]}" for k, f, _ in WRONG_TYPES]
)
def test_wrong_types_are_400_naming_the_field(open_door, kind, fields, param):
    body = json.dumps({**GOOD[kind], **fields}).encode()
    status, _, reply = http(open_door, PATHS[kind], body)
    assert status == 400, reply
    assert reply["error"]["param"] == param
    assert reply["error"]["message"].startswith(param)


def test_empty_or_default_values_of_options_it_cannot_honour_are_accepted(open_door):
    """What clients send for nothing (LangChain: `logit_bias: {}`, `tools: []`)."""
    nothing = {
        "logit_bias": {}, "tools": [], "functions": [], "tool_choice": "none",
        "function_call": "auto", "response_format": {"type": "text"}, "top_logprobs": 0,
    }  # fmt: skip
    body = json.dumps({**GOOD["chat"], **nothing}).encode()
    status, _, reply = http(open_door, PATHS["chat"], body)
    assert status == 200, reply
    body = {**GOOD["c"], "logit_bias": None, "suffix": ""}
    status, _, reply = http(open_door, PATHS["c"], json.dumps(body).encode())
    assert status == 200, reply


def test_any_content_type_is_read_as_json(open_door):
    for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form"}):
        status, _, reply = http(open_door, "/v1/completions", b'{"prompt": "x"}', headers)
        assert status == 200, reply
        assert reply["choices"][0]["text"] == "hi"


def test_a_body_over_the_limit_is_413(open_door):
    body = b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}'
    status, _, reply = http(open_door, "/v1/completions", body)
    assert status == 413 and reply["error"]["message"].startswith("body:")


def test_a_text_prompt_too_long_for_the_context_names_the_field(open_door):
    body = json.dumps({"prompt": "x" * MAX_MODEL_LEN, "max_tokens": 1}).encode()
    status, _, reply = http(open_door, "/v1/completions", body)
    assert status == 400 and reply["error"]["param"] == "prompt"
    assert f"exceed max_model_len {MAX_MODEL_LEN}" in reply["error"]["message"]


# -- sampling parameters ---------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [math.inf, -math.inf, math.nan, 1e39, 10**400, True])
def test_non_finite_temperatures_are_refused(temperature):
    with pytest.raises(ValueError, match="^temperature: must be a finite number"):
        SamplingParams(temperature=temperature)


@pytest.mark.parametrize("top_p", [math.inf, math.nan, True])
def test_non_finite_top_p_is_refused(top_p):
    with pytest.raises(ValueError, match="^top_p:"):
        SamplingParams(top_p=top_p)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(max_tokens=2**31), "max_tokens"),
        (dict(top_k=2**31), "top_k"),
        (dict(seed=2**63), "seed"),
        (dict(stop_token_ids=[2**31]), "stop_token_ids"),
        (dict(stop_token_ids=5), "stop_token_ids"),
    ],
)
def test_values_the_wire_cannot_carry_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_tiny_temperatures_are_greedy_and_sample_the_argmax():
    assert SamplingParams(temperature=1e-45).greedy  # a float32 denormal
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=1e-45), SamplingParams(temperature=1.0, seed=0)]
    gen = torch.Generator().manual_seed(0)
    assert sample(logits, params, [None, gen], torch.Generator())[0] == 1


# -- RequestValidator ------------------------------------------------------------------------


class NeverTokenize:
    """A tokenizer that fails the test when it is asked to encode."""

    def encode(self, text: str) -> list[int]:
        raise AssertionError("tokenized text the validator should have refused first")


def test_a_10m_token_prompt_is_refused_before_its_ids_are_checked():
    check = RequestValidator(vocab_size=VOCAB, max_model_len=2048)
    prompt = [VOCAB + 1] * 10_000_000  # every id is bad too: the length must be checked first
    started = time.perf_counter()
    with pytest.raises(ValueError, match="^prompt: 10000000 tokens exceed max_model_len 2048$"):
        check.prompt(prompt)
    assert time.perf_counter() - started < 0.1


def test_text_that_cannot_fit_is_refused_before_it_is_tokenized():
    check = RequestValidator(vocab_size=VOCAB, max_model_len=16, tokenizer=NeverTokenize())
    with pytest.raises(ValueError, match="^prompts\\[2\\]: 1025 characters cannot fit"):
        check.prompt("x" * (16 * MAX_TOKEN_CHARS + 1), "prompts[2]")


def test_text_with_a_lone_surrogate_is_refused_naming_the_field():
    check = RequestValidator(vocab_size=VOCAB, max_model_len=16, tokenizer=NeverTokenize())
    with pytest.raises(ValueError, match="^prompt: character 2 is a lone surrogate U\\+D83D"):
        check.prompt("hé\ud83d")


def test_a_prompt_longer_than_the_context_says_so():
    check = RequestValidator(vocab_size=VOCAB, max_model_len=16, tokenizer=TOKENIZER)
    with pytest.raises(ValueError, match="^prompt: 21 tokens exceed max_model_len 16$"):
        check.prompt("x" * 20)  # BOS + 20 bytes
    with pytest.raises(ValueError, match="^prompt: 17 tokens exceed max_model_len 16$"):
        check.request([1] * 17, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="^max_tokens: prompt length 16 \\+ max_tokens 1"):
        check.request([1] * 16, SamplingParams(max_tokens=1))


# -- API keys --------------------------------------------------------------------------------


def test_without_a_key_every_path_but_the_public_ones_is_401(keyed_door, router, caplog):
    caplog.set_level(logging.DEBUG)
    fake, _ = router
    calls = len(fake.metadata)
    cases = [
        ("/v1/completions", b"{not even json", {}),  # 401, not 400: the body is never read
        ("/v1/completions", b'{"prompt": "x"}', {"Authorization": "Bearer sk-wrong"}),
        ("/v1/completions", b'{"prompt": "x"}', {"Authorization": "Basic sk-right"}),
        ("/v1/completions", b'{"prompt": "x"}', {"Authorization": "Bearer "}),
        ("/v1/completions", b'{"prompt": "x"}', {"Authorization": "Bearer sk-right-plus"}),
        ("/v1/chat/completions", b"{}", {"Authorization": "bearer sk-rig"}),
        ("/v1/models", None, {}),
        ("/v1/nothing", None, {}),  # no hint of which routes exist
    ]
    for path, body, headers in cases:
        status, got, reply = http(keyed_door, path, body, headers)
        assert status == 401, (path, headers, reply)
        assert got["WWW-Authenticate"] == "Bearer"
        assert reply["error"]["type"] == "authentication_error"
        assert reply["error"]["message"].startswith("authorization:")
        assert "sk-" not in json.dumps(reply)  # the presented key is never echoed
    assert len(fake.metadata) == calls  # nothing reached the router
    assert "sk-" not in caplog.text


def test_a_right_key_goes_through_and_is_forwarded(keyed_door, router):
    fake, port = router
    for key in KEYS:
        status, _, reply = http(
            keyed_door, "/v1/completions", b'{"prompt": "x"}', {"Authorization": f"Bearer {key}"}
        )
        assert status == 200, reply
        assert reply["choices"][0]["text"] == "hi"
        assert fake.metadata[-1]["authorization"] == f"Bearer {key}"
        assert fake.metadata[-1]["x-router-credential"] == "router-secret"
    assert channels == [f"127.0.0.1:{port}"]  # the channel factory made the one channel
    status, _, reply = http(keyed_door, "/v1/models", None, {"Authorization": f"Bearer {KEYS[0]}"})
    assert status == 200 and reply["data"][0]["id"] == "fake"


def test_health_and_metrics_need_no_key(keyed_door):
    assert http(keyed_door, "/health")[0] == 200
    status, _, body = http(keyed_door, "/metrics")
    assert status == 200 and isinstance(body, str)


def test_without_api_keys_a_presented_key_is_forwarded_and_none_is_sent_otherwise(
    open_door, router
):
    fake, _ = router
    http(open_door, "/v1/completions", b'{"prompt": "x"}', {"Authorization": "Bearer unused"})
    assert fake.metadata[-1]["authorization"] == "Bearer unused"
    http(open_door, "/v1/completions", b'{"prompt": "x"}')
    assert "authorization" not in fake.metadata[-1]


@pytest.mark.parametrize(
    "code,status",
    [
        (grpc.StatusCode.UNAUTHENTICATED, 401),
        (grpc.StatusCode.PERMISSION_DENIED, 403),
        (grpc.StatusCode.ALREADY_EXISTS, 409),
    ],
)
def test_router_auth_failures_map_to_http(open_door, router, code, status):
    fake, _ = router
    fake.abort = code
    try:
        got, headers, reply = http(open_door, "/v1/completions", b'{"prompt": "x"}')
    finally:
        fake.abort = None
    assert got == status, reply
    assert code.name in reply["error"]["message"]
    assert (headers["WWW-Authenticate"] == "Bearer") == (status == 401)


def test_the_developer_role_is_rendered_as_system():
    """OpenAI's newer name for the system role; checkpoints' templates know "system"."""
    body = {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user",
            "content": "hi"}]}  # fmt: skip
    assert proto.messages_of(body) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]


def test_text_parts_are_joined_by_newlines():
    """As vLLM joins a message's text parts (its chat_utils), not glued together."""
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    body = {"messages": [{"role": "user", "content": parts}]}
    assert proto.messages_of(body) == [{"role": "user", "content": "first\nsecond"}]


def test_tool_calls_in_the_history_are_refused_not_erased():
    """This server has no tools: an assistant turn's tool or function calls are refused
    (as `tools` is) instead of the turn rendered as if it had said nothing; empty ones and
    a tool's own message (text the template renders) pass."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for name, value in (("tool_calls", [call]), ("function_call", {"name": "f"})):
        turn = {"role": "assistant", "content": None, name: value}
        body = {"messages": [{"role": "user", "content": "hi"}, turn]}
        with pytest.raises(proto.BadRequest, match=rf"messages\[1\]\.{name}: not supported"):
            proto.messages_of(body)
    body = {
        "messages": [
            {"role": "assistant", "content": "ok", "tool_calls": []},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ]
    }
    assert proto.messages_of(body) == [
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "content": "42"},
    ]


def test_a_messages_name_is_kept_for_the_template_and_must_be_a_string():
    body = {"messages": [{"role": "user", "content": "hi", "name": "ada"}]}
    assert proto.messages_of(body) == [{"role": "user", "content": "hi", "name": "ada"}]
    with pytest.raises(proto.BadRequest, match=r"messages\[0\]\.name"):
        proto.messages_of({"messages": [{"role": "user", "content": "hi", "name": 7}]})


def test_a_chat_prompt_that_fills_the_context_is_refused_naming_the_messages(open_door):
    """Chat without max_tokens takes the rest of the context; when the prompt leaves none,
    the error names the messages, not a max_tokens the client never sent."""
    empty = len(TOKENIZER.encode(TOKENIZER.apply_chat_template([{"role": "user", "content": ""}])))
    content = "x" * (MAX_MODEL_LEN - empty)  # exactly the context: valid, but no room
    body = json.dumps({"messages": [{"role": "user", "content": content}]}).encode()
    status, _, reply = http(open_door, PATHS["chat"], body)
    assert status == 400 and reply["error"]["param"] == "messages", reply
    assert reply["error"]["message"] == (
        f"messages: the prompt's {MAX_MODEL_LEN} tokens leave no room in the model's context "
        f"of {MAX_MODEL_LEN}"
    )
    body = json.dumps({"messages": [{"role": "user", "content": content[1:]}]}).encode()
    status, _, reply = http(open_door, PATHS["chat"], body)  # one token of room: served
    assert status == 200, reply


def test_an_unexpected_failure_is_a_500_in_openais_shape(open_door, monkeypatch):
    def broken(body, vocab_size):
        raise RuntimeError("a bug")

    monkeypatch.setattr(proto, "parse_completion", broken)
    status, _, reply = http(open_door, PATHS["c"], b'{"prompt": "x"}')
    assert status == 500, reply
    assert reply["error"] == {
        "message": "internal error: RuntimeError", "type": "server_error", "param": None,
        "code": None,
    }  # fmt: skip


def test_a_request_ended_by_an_abort_is_an_error_not_a_stop(open_door, router):
    """A request the serving side aborted is not an answer cut short with finish_reason
    "stop": a whole one is a 500 in OpenAI's error shape, a stream ends with an error."""
    fake, _ = router
    fake.finish_reason = "abort"
    try:
        status, _, reply = http(open_door, "/v1/completions", b'{"prompt": "x"}')
        _, _, streamed = http(open_door, "/v1/completions", b'{"prompt": "x", "stream": true}')
    finally:
        fake.finish_reason = "length"
    assert status == 500 and reply["error"]["type"] == "server_error", reply
    assert "aborted" in reply["error"]["message"]
    events = [line.removeprefix("data: ") for line in streamed.split("\n\n") if line]
    assert events[-1] == "[DONE]" and "aborted" in json.loads(events[-2])["error"]["message"]
    assert not any('"finish_reason": "stop"' in e for e in events)


@pytest.mark.parametrize(
    "keys,match",
    [("sk-one", "api_keys: expected a tuple"), (("",), "api_keys"), (("sk-é",), "api_keys")],
)
def test_router_view_refuses_keys_it_could_not_send(keys, match):
    with pytest.raises(ValueError, match=match):
        view(api_keys=keys)


# -- TLS -------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_https_with_an_ssl_context(router, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
        + [
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ]
        + ["-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    server = start_http(view(), router[1], "127.0.0.1", 0, "fake", ssl_context=server_ctx)
    try:
        client_ctx = ssl.create_default_context(cafile=str(cert))
        base = f"https://127.0.0.1:{server.port}"
        status, _, reply = http(base, "/v1/completions", b'{"prompt": "x"}', ctx=client_ctx)
        assert status == 200 and reply["choices"][0]["text"] == "hi"
        with pytest.raises((OSError, HTTPException)):  # plain HTTP: no answer
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=5)
    finally:
        server.close()


# -- properties ------------------------------------------------------------------------------

FIELDS = [
    "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "seed", "stop", "stream", "stream_options", "include_usage", "n", "best_of",
    "echo", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
    "ignore_eos", "model", "role", "content", "type", "text", "logit_bias", "tools",
    "tool_choice", "functions", "function_call", "response_format", "suffix", "top_logprobs",
]  # fmt: skip
SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"])
TEXT = st.text(max_size=6) | st.builds(
    lambda a, s, b: a + s + b, st.text(max_size=3), SURROGATES, st.text(max_size=3)
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-2, VOCAB + 2)
    | st.integers()
    | st.integers(-(10**40), 10**40)
    | st.floats()  # nan and ±inf included
    | TEXT
    | st.sampled_from(["system", "user", "assistant", "text"])
)
KEYS_OR_TEXT = st.sampled_from(FIELDS) | TEXT
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS_OR_TEXT, inner, max_size=4),
    max_leaves=16,
)
BODIES = st.dictionaries(KEYS_OR_TEXT, VALUES, max_size=8) | VALUES


def _served(req: proto.OpenAIRequest) -> None:
    """What the front door does next with a parsed request: ValueError naming a field."""
    check = RequestValidator(vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN, tokenizer=TOKENIZER)
    try:
        check.prompt(req.prompt)
    except ValueError as e:
        assert str(e).startswith("prompt")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(BODIES)
def test_any_json_value_parses_or_is_a_bad_request(body):
    for parse in (
        lambda b: proto.parse_completion(b, VOCAB),
        lambda b: proto.parse_chat(b, VOCAB, TOKENIZER.apply_chat_template),
    ):
        try:
            req = parse(body)
        except proto.BadRequest as e:
            assert e.message and (e.param is None or e.message.startswith(e.param))
            continue
        _served(req)


@settings(max_examples=300, deadline=None)
@given(VALUES | st.binary(max_size=32))
def test_loads_returns_a_clean_value_or_is_a_bad_request(value):
    raw = value if isinstance(value, bytes) else json.dumps(value).encode()
    try:
        got = proto.loads(raw)
    except proto.BadRequest as e:
        assert e.message
        return
    # what loads lets through has no NaN, no inf and only encodable text
    assert json.loads(json.dumps(got, allow_nan=False)) == got
    json.dumps(got, ensure_ascii=False).encode("utf-8")


def test_every_chunk_of_a_stream_has_the_streams_created_time(open_door, monkeypatch):
    clock = iter(range(1_800_000_000, 1_900_000_000))
    monkeypatch.setattr(proto.time, "time", lambda: float(next(clock)))
    body = {**GOOD["chat"], "stream": True, "stream_options": {"include_usage": True}}
    _, _, streamed = http(open_door, PATHS["chat"], json.dumps(body).encode())
    events = [line.removeprefix("data: ") for line in streamed.split("\n\n") if line]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    assert len(chunks) >= 3 and len({c["created"] for c in chunks}) == 1, chunks


def test_stop_strings_without_a_tokenizer_are_refused(router):
    """A model served without a tokenizer has no text: a stop string could never match."""
    _, port = router
    bare = RouterView(
        vocab_size=VOCAB,
        max_model_len=MAX_MODEL_LEN,
        tokenizer=None,
        metrics=CollectorRegistry(),
        workers=lambda: (1, 1),
    )
    server = start_http(bare, port, "127.0.0.1", 0, "fake")
    base = f"http://127.0.0.1:{server.port}"
    try:
        status, _, reply = http(base, PATHS["c"], b'{"prompt": [1, 2], "stop": ["x"]}')
        assert status == 400 and reply["error"]["param"] == "stop", reply
        status, _, reply = http(base, PATHS["c"], b'{"prompt": [1, 2]}')
        assert status == 200, reply
    finally:
        server.close()
