"""The OpenAI-compatible HTTP front door, driven by the official `openai` package against a
launched cluster (real processes on 127.0.0.1), checked against the gRPC SDK."""

from __future__ import annotations

import json
import time
from http.client import HTTPConnection
from pathlib import Path

import openai
import pytest
from http_calls import http as http_call
from prometheus_client.parser import text_string_to_metric_families

from pdserve.client import Client
from pdserve.launch import Cluster
from pdserve.weights import resolve
from tests.test_cluster import wait_all_blocks_free
from tests.test_local_prefill import metric

PROMPTS = ["Hello there", "The capital of France is", "a", "1 2 3 4 5 6 7 8 9 10 11 12"]
GREEDY = {"max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def cluster():
    with Cluster(
        "tiny-llama",
        1,
        1,
        # room for test_overload's three holders at their expected peak (3 x 251 blocks of
        # 16): past it the decode worker admits only where no line waits, and a third
        # waiting at the router would free the queue slot the test fills
        worker_args=["--num-kv-blocks", "1024"],
        router_args=["--max-queue", "3"],
        http_port=0,
    ) as c:
        yield c


@pytest.fixture(scope="module")
def oai(cluster):
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused")


@pytest.fixture(scope="module")
def sdk(cluster):
    with Client(cluster.address) as client:
        yield client


def http(cluster, method: str, path: str, body: bytes | None = None):
    return http_call(f"http://{cluster.http_address}", path, body, method=method)


def test_completions_match_the_sdk(oai, sdk):
    for prompt in PROMPTS:
        want = sdk.generate(prompt, ignore_eos=True, **GREEDY)
        got = oai.completions.create(
            model="tiny-llama", prompt=prompt, extra_body={"ignore_eos": True}, **GREEDY
        )
        assert got.choices[0].text == want.text
        assert got.choices[0].finish_reason == "length"
        assert got.usage.prompt_tokens == want.prompt_tokens > 0
        assert got.usage.completion_tokens == len(want.token_ids) == 12
        assert got.usage.total_tokens == want.prompt_tokens + 12
    # token-id prompts too
    want = sdk.generate([5, 6, 7, 8], ignore_eos=True, **GREEDY)
    got = oai.completions.create(
        model="tiny-llama", prompt=[5, 6, 7, 8], extra_body={"ignore_eos": True}, **GREEDY
    )
    assert got.choices[0].text == want.text and got.usage.prompt_tokens == 4


def test_streamed_completion_equals_the_whole_one(oai):
    whole = oai.completions.create(model="tiny-llama", prompt=PROMPTS[1], **GREEDY)
    chunks = list(
        oai.completions.create(
            model="tiny-llama",
            prompt=PROMPTS[1],
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_chat_matches_the_sdk_on_the_rendered_template(oai, sdk):
    tokenizer = resolve("tiny-llama").tokenizer
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ]
    want = sdk.generate(tokenizer.apply_chat_template(messages), ignore_eos=True, **GREEDY)
    got = oai.chat.completions.create(
        model="tiny-llama", messages=messages, extra_body={"ignore_eos": True}, **GREEDY
    )
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == want.prompt_tokens
    assert got.usage.completion_tokens == 12
    stream = oai.chat.completions.create(
        model="tiny-llama",
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert chunks[-1].usage.completion_tokens == 12


def test_top_k_one_is_greedy_over_http(oai):
    greedy = oai.completions.create(model="tiny-llama", prompt=PROMPTS[1], **GREEDY)
    top1 = oai.completions.create(
        model="tiny-llama",
        prompt=PROMPTS[1],
        max_tokens=12,
        temperature=1.0,
        extra_body={"top_k": 1},
    )
    assert top1.choices[0].text == greedy.choices[0].text


def test_stop_strings_cut_the_text_before_them(oai, sdk):
    full = oai.completions.create(model="tiny-llama", prompt=PROMPTS[0], **GREEDY)
    text = full.choices[0].text
    # a character from the middle of the greedy output (not a replacement character)
    k = next(i for i in range(3, len(text)) if text[i] not in "\ufffd \n")
    stop = text[k]
    cut = oai.completions.create(model="tiny-llama", prompt=PROMPTS[0], stop=[stop], **GREEDY)
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    # usage counts the tokens up to the one that completed the stop string, none after
    ids = sdk.generate(PROMPTS[0], **GREEDY).token_ids
    tokenizer = resolve("tiny-llama").tokenizer
    used = next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n]))
    assert cut.usage.completion_tokens == used < full.usage.completion_tokens
    streamed = list(
        oai.completions.create(
            model="tiny-llama",
            prompt=PROMPTS[0],
            stop=stop,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text[: text.find(stop)]
    assert streamed[-1].usage.completion_tokens == used


BAD = [
    (b"{not json", None),
    (b"[1, 2]", None),
    (b'{"prompt": ""}', "prompt"),
    (b'{"prompt": 5}', "prompt"),
    (b'{"prompt": ["a", "b"]}', "prompt"),
    (b'{"prompt": [1, -3]}', "prompt"),
    (b'{"prompt": [1, 99999999]}', "prompt"),
    (b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": "x", "max_tokens": "ten"}', "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 1.5}', "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 1e40}', "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 99999999}', "max_tokens"),
    (b'{"prompt": "x", "temperature": "hot"}', "temperature"),
    (b'{"prompt": "x", "temperature": 2.5}', "temperature"),
    (b'{"prompt": "x", "temperature": true}', "temperature"),
    (b'{"prompt": "x", "top_p": 0}', "top_p"),
    (b'{"prompt": "x", "top_p": [1]}', "top_p"),
    (b'{"prompt": "x", "seed": "s"}', "seed"),
    (b'{"prompt": "x", "seed": 1e100}', "seed"),
    (b'{"prompt": "x", "n": 2}', "n"),
    (b'{"prompt": "x", "n": "1"}', "n"),
    (b'{"prompt": "x", "stop": 3}', "stop"),
    (b'{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', "stop"),
    (b'{"prompt": "x", "stop": [""]}', "stop"),
    (b'{"prompt": "x", "stream": "yes"}', "stream"),
    (b'{"prompt": "x", "stream_options": {"include_usage": true}}', "stream_options"),
    (b'{"prompt": "x", "stream": true, "stream_options": 1}', "stream_options"),
    (b'{"prompt": "x", "echo": true}', "echo"),
    (b'{"prompt": "x", "logprobs": 2}', "logprobs"),
    (b'{"prompt": "x", "logprobs": 0}', "logprobs"),  # the sampled tokens' logprobs
    (b'{"prompt": "x", "presence_penalty": 1}', "presence_penalty"),
    (b'{"prompt": "x", "model": 7}', "model"),
    (b'{"prompt": "x", "ignore_eos": "no"}', "ignore_eos"),
    (b'{"prompt": "x", "top_k": 0.5}', "top_k"),
    (b'{"prompt": "x", "temperature": NaN}', "temperature"),
    (b'{"prompt": "x", "temperature": 1e999}', "temperature"),
    (b'{"prompt": "x", "prompt": "y"}', "prompt"),
    (b'{"prompt": "\\ud800"}', "prompt"),
    (b"", None),
]

BAD_CHAT = [
    (b'{"messages": []}', "messages"),
    (b'{"messages": "hi"}', "messages"),
    (b'{"messages": [{"role": "wizard", "content": "x"}]}', "messages"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "messages"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "messages"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}', None),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 4096}', "max_tokens"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[b.decode()[:48] for b, _ in BAD])
def test_bad_completion_requests_are_400_naming_the_field(cluster, body, param):
    status, _, reply = http(cluster, "POST", "/v1/completions", body)
    assert status == 400, reply
    assert reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["message"]
    assert reply["error"]["param"] == param


@pytest.mark.parametrize("body,param", BAD_CHAT, ids=[b.decode()[:48] for b, _ in BAD_CHAT])
def test_bad_chat_requests_are_400(cluster, body, param):
    status, _, reply = http(cluster, "POST", "/v1/chat/completions", body)
    assert status == 400, reply
    if param is not None:
        assert reply["error"]["param"] == param


def test_wrong_routes_and_methods_are_json_errors(cluster):
    status, _, reply = http(cluster, "GET", "/v1/completions")
    assert status == 405 and "error" in reply
    status, _, reply = http(cluster, "GET", "/v1/nothing")
    assert status == 404 and "error" in reply


def test_models_health_and_metrics(cluster, oai):
    assert [m.id for m in oai.models.list().data] == ["tiny-llama"]
    status, _, reply = http(cluster, "GET", "/health")
    assert status == 200 and reply["status"] == "ok"

    oai.completions.create(model="tiny-llama", prompt="metrics", max_tokens=4, temperature=0)
    names = {
        "pdserve_router_ttft_seconds",
        "pdserve_router_tpot_seconds",
        "pdserve_router_kv_usage_ratio",  # from the decode worker's heartbeats
        "pdserve_router_transfer_seconds",
        "pdserve_router_transfer_bytes",
    }
    deadline = time.monotonic() + 10
    while True:  # poll: every series is there once a heartbeat has come
        status, _, body = http(cluster, "GET", "/metrics")
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(body)}
        if names <= set(families) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert names <= set(families), names - set(families)
    ttft = {s.name: s.value for s in families["pdserve_router_ttft_seconds"].samples}
    assert ttft["pdserve_router_ttft_seconds_count"] >= 1
    usage = families["pdserve_router_kv_usage_ratio"].samples
    assert usage and all(0 <= s.value <= 1 for s in usage)
    # the front door too never loads torch into the router (test_cluster checks gRPC)
    assert "libtorch" not in Path(f"/proc/{cluster.procs[0].pid}/maps").read_text()


def test_overload_is_429_with_retry_after(cluster, sdk):
    holders = [
        sdk.stream([6] * 8, max_tokens=4000, temperature=0, ignore_eos=True) for _ in range(3)
    ]
    try:
        started = time.monotonic()
        for h in holders:
            next(h)  # all three admitted: the router's queue (3) is full
        # all three decoding at once (none waited for another to end and free the queue)
        assert time.monotonic() - started < 3.0
        status, headers, reply = http(cluster, "POST", "/v1/completions", b'{"prompt": "x"}')
        assert status == 429, reply
        assert headers["Retry-After"] == "1"
        assert reply["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(
                base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0
            ).completions.create(model="tiny-llama", prompt="x", max_tokens=2)
    finally:
        for h in holders:
            h.close()


def test_no_workers_is_503_after_the_queue_timeout():
    with Cluster("tiny-llama", 0, 0, http_port=0, router_args=["--queue-timeout", "1"]) as lonely:
        status, _, reply = http(lonely, "GET", "/health")
        assert status == 503 and reply["status"] == "unavailable"
        started = time.monotonic()
        status, _, reply = http(lonely, "POST", "/v1/completions", b'{"prompt": "x"}')
        assert status == 503, reply
        assert "no prefill and no decode worker is registered" in reply["error"]["message"]
        assert time.monotonic() - started >= 1.0  # it waited in the queue first


def _router_metric(c, name: str, **labels: str) -> float:
    return metric(c.metrics["router-0"], name, **labels)


def _both_paths(c, sdk) -> None:
    """Against cluster `c`: the SDK's text whole and streamed over HTTP; a client that drops
    its streamed request mid-way, or its whole one while it decodes, aborts it on the
    workers (every block back, counted cancelled). Four HTTP requests."""
    cancelled = _router_metric(c, "pdserve_router_requests_total", outcome="cancelled")
    oai = openai.OpenAI(base_url=f"http://{c.http_address}/v1", api_key="unused", max_retries=0)
    want = sdk.generate(PROMPTS[1], ignore_eos=True, **GREEDY)
    whole = oai.completions.create(
        model="tiny-llama", prompt=PROMPTS[1], extra_body={"ignore_eos": True}, **GREEDY
    )
    streamed = oai.completions.create(
        model="tiny-llama", prompt=PROMPTS[1], stream=True, extra_body={"ignore_eos": True},
        **GREEDY,
    )  # fmt: skip
    assert whole.choices[0].text == want.text
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == want.text
    conn = _post(c, {"model": "tiny-llama", "prompt": "a", "max_tokens": 1000, "stream": True})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # streaming: then the client goes
    _drop(conn, c, sdk, cancelled + 1, "the dropped stream")
    # a whole (not streamed) request whose client goes while it decodes: aborted too, not
    # decoded to its end for nobody (the HTTP handler is cancelled when its client goes)
    conn = _post(c, {"model": "tiny-llama", "prompt": "a", "max_tokens": 4000, "ignore_eos": True})
    deadline = time.monotonic() + 30
    while all(w.free_blocks == w.total_blocks for w in sdk.workers()):
        assert time.monotonic() < deadline, "the whole request never started"
        time.sleep(0.05)
    _drop(conn, c, sdk, cancelled + 2, "the dropped whole request")


def _post(c, body: dict) -> HTTPConnection:
    """A completion request sent on a connection of its own (its answer not read yet)."""
    host, port = c.http_address.rsplit(":", 1)
    conn = HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                 {"Content-Type": "application/json"})  # fmt: skip
    return conn


def _drop(conn: HTTPConnection, c, sdk, cancelled: float, what: str) -> None:
    """The client goes: every block comes back and the router has counted `cancelled`."""
    conn.sock.close()
    conn.close()
    wait_all_blocks_free(sdk, timeout_s=30)
    deadline = time.monotonic() + 30
    while _router_metric(c, "pdserve_router_requests_total", outcome="cancelled") < cancelled:
        assert time.monotonic() < deadline, f"{what} was not counted cancelled"
        time.sleep(0.1)


def test_the_front_door_in_the_routers_process_serves_the_sdks_tokens_and_frees_a_dropped_stream(
    cluster, sdk
):
    """The default: the front door calls the router's Generate in its own process."""
    before = _router_metric(cluster, "pdserve_router_http_in_process_total")
    _both_paths(cluster, sdk)
    assert _router_metric(cluster, "pdserve_router_http_in_process_total") == before + 4


def test_the_front_door_over_grpc_serves_the_same():
    """--no-http-in-process: the front door calls its router over a loopback gRPC call."""
    with (
        Cluster(
            "tiny-llama",
            1,
            1,
            worker_args=["--num-kv-blocks", "512"],
            router_args=["--no-http-in-process"],
            http_port=0,
        ) as c,
        Client(c.address) as sdk,
    ):
        _both_paths(c, sdk)
        assert _router_metric(c, "pdserve_router_http_in_process_total") == 0
