"""pdserve.bench.openai_load against a scripted OpenAI-compatible server: what it sends, what
it counts, how many requests it keeps in flight, and how it records a failure."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from aiohttp import web

from pdserve.bench.openai_load import prompt_texts, request_body, run_point

KEY = "sk-test"


class FakeServer:
    """Streams `chunks` content chunks per request (3 tokens each), then a usage chunk
    (unless `usage` is False), then [DONE]; 401 without the key."""

    def __init__(self, chunks: int = 4, usage: bool = True) -> None:
        self.chunks, self.usage = chunks, usage
        self.bodies: list[dict] = []
        self.in_flight = self.most_in_flight = 0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_post("/v1/completions", self.handle)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        ready.set()
        self.loop.run_forever()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        body = await request.json()
        self.bodies.append(body)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        chat = "messages" in body
        for i in range(self.chunks):
            await asyncio.sleep(0.01)
            choice = {"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "}
            await reply.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        if self.usage:
            use = {"prompt_tokens": 7, "completion_tokens": 3 * self.chunks}
            await reply.write(f"data: {json.dumps({'choices': [], 'usage': use})}\n\n".encode())
        await reply.write(b"data: [DONE]\n\n")
        self.in_flight -= 1
        return reply

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_counts_what_the_server_says_and_keeps_c_in_flight(server, api):
    texts = prompt_texts(6, seed=3)
    point = run_point(server.url, "m", 3, texts, max_tokens=12, api=api, api_key=KEY)
    assert point["requests"] == 6 and point["errors"] == 0
    assert point["output_tokens"] == 6 * 12 and point["prompt_tokens"] == 6 * 7
    assert server.most_in_flight == 3
    assert len(server.bodies) == 6
    for body in server.bodies:
        assert body["temperature"] == 0 and body["ignore_eos"] is True
        assert body["max_tokens"] == 12 and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert ("messages" in body) == (api == "chat")
    sent = sorted(
        b["messages"][0]["content"] if api == "chat" else b["prompt"] for b in server.bodies
    )
    assert sent == sorted(texts)
    for r in point["records"]:
        assert r["error"] is None and r["output_tokens"] == 12
        # four chunks 10 ms apart: the first after ~10 ms, TPOT = 30 ms over 11 tokens
        assert 0.005 < r["ttft_s"] < r["e2e_s"]
        assert 0.0 < r["tpot_s"] < r["e2e_s"] / 11
    assert point["throughput_tok_s"] == pytest.approx(72 / point["elapsed_s"])


def test_failures_are_recorded_not_dropped(server):
    point = run_point(server.url, "m", 2, prompt_texts(3, 0), 4, api_key="sk-wrong")
    assert point["requests"] == 3 and point["errors"] == 3 and point["output_tokens"] == 0
    assert all(r["error"].startswith("HTTP 401") for r in point["records"])
    assert server.bodies == []


def test_a_stream_without_usage_is_an_error():
    s = FakeServer(usage=False)
    try:
        point = run_point(s.url, "m", 1, prompt_texts(2, 0), 4, api_key=KEY)
    finally:
        s.close()
    assert point["errors"] == 2
    assert {r["error"] for r in point["records"]} == {"stream ended without a usage chunk"}


def test_prompts_are_seeded_and_distinct():
    assert prompt_texts(5, 1) == prompt_texts(5, 1)
    assert prompt_texts(5, 1) != prompt_texts(5, 2)
    assert len(set(prompt_texts(50, 0))) == 50
    with pytest.raises(ValueError, match="api"):
        request_body("embeddings", "m", "x", 4)
    with pytest.raises(ValueError, match="concurrency"):
        run_point("http://127.0.0.1:9", "m", 0, ["x"], 4)
