"""`pdserve bench openai`: one load generator for any OpenAI-compatible server (pdserve's HTTP
front door, vLLM's api_server, ...), so that two servers are measured by the same client.

At each concurrency c, `requests` streaming requests (default 2c) go out through c closed-
loop workers: each sends its next request when its last one ended. A request is a chat
completion (`--api chat`, the server applies its chat template) or a completion of the same
text (`--api completions`), greedy, `max_tokens` outputs with EOS ignored (vLLM's
`ignore_eos` extension, which pdserve accepts too), `stream_options.include_usage` so that
the server says how many prompt and output tokens it counted. Timings are the client's:
TTFT = first content chunk - sent, TPOT = (last chunk - first chunk) / (output tokens - 1),
throughput = output tokens of the point / its wall time. A request that failed (HTTP status,
a broken stream, the deadline) is recorded with its error and counted, never dropped.

Prompts are English text made from a seeded word list (every request its own text, so that
no prefix cache serves one side more than the other), the same texts for every server given
the same seed.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

from pdserve.bench.report import machine_info
from pdserve.bench.serve import Sample, summarize
from pdserve.bench.slo import SLO
from pdserve.progress import progress

CONCURRENCIES = (1, 16, 32)
DEADLINE_S = 600.0  # one request, sent to last byte
APIS = ("chat", "completions")
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her which this are be an "
    "river city light morning garden window story letter music winter summer mountain road "
    "station market harbor teacher painter doctor farmer sailor engine bridge village forest "
    "history science language number weather journey silence memory question answer reason "
    "quietly slowly carefully later again often never always together alone suddenly"
)
_WORDS = tuple(_WORD_TEXT.split())


def prompt_texts(n: int, seed: int, words: tuple[int, int] = (24, 48)) -> list[str]:
    """n seeded prompts: an instruction and a run of words (24-48 by default)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(*words)))
        out.append(f"Request {seed}-{i}. Continue this text with a long story: {body}")
    return out


def request_body(api: str, model: str, text: str, max_tokens: int) -> dict:
    if api not in APIS:
        raise ValueError(f"api: expected one of {', '.join(APIS)}, got {api!r}")
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if api == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


def _content(chunk: dict) -> str:
    """The text a streamed chunk carries (chat: delta.content; completions: text)."""
    text = ""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        text += (delta.get("content") or "") if delta is not None else choice.get("text") or ""
    return text


async def stream_one(session, url: str, body: dict, headers: dict) -> Sample:
    """One streaming request -> its Sample (output_tokens from the server's usage chunk; a
    stream without one is an error: the count could not be checked)."""
    import aiohttp

    sample = Sample(prompt_tokens=0)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    start = time.perf_counter()
    first = last = None
    usage = None
    try:
        async with session.post(
            url.rstrip("/") + path,
            json=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=DEADLINE_S),
        ) as reply:
            if reply.status != 200:
                detail = (await reply.text())[:200]
                sample.error = f"HTTP {reply.status}: {detail}"
                return sample
            async for raw in reply.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if _content(chunk):
                    now = time.perf_counter()
                    first = first or now
                    last = now
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        sample.error = f"{type(e).__name__}: {e}"
        return sample
    sample.e2e_s = time.perf_counter() - start
    if usage is None:
        sample.error = "stream ended without a usage chunk"
        return sample
    sample.prompt_tokens = int(usage.get("prompt_tokens", 0))
    sample.output_tokens = int(usage.get("completion_tokens", 0))
    sample.sent_at, sample.first_at = start, first or start
    sample.end_at = last or sample.first_at
    sample.ttft_s = sample.first_at - start
    if sample.output_tokens > 1 and first is not None:
        sample.tpot_s = (last - first) / (sample.output_tokens - 1)
    return sample


async def drive(
    url: str,
    bodies: list[dict],
    concurrency: int,
    api_key: str | None = None,
    desc: str = "bench openai",
) -> tuple[list[Sample], float]:
    """The bodies through `concurrency` closed-loop workers -> (samples in body order, s)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    samples: list[Sample | None] = [None] * len(bodies)
    queue = list(enumerate(bodies))
    connector = aiohttp.TCPConnector(limit=concurrency)
    with progress(total=len(bodies), desc=desc, unit="req") as bar:
        async with aiohttp.ClientSession(connector=connector) as session:

            async def worker() -> None:
                while queue:
                    i, body = queue.pop(0)
                    samples[i] = await stream_one(session, url, body, headers)
                    bar.update(1)

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            elapsed = time.perf_counter() - start
    return samples, elapsed


def run_point(
    url: str,
    model: str,
    concurrency: int,
    texts: list[str],
    max_tokens: int,
    api: str = "chat",
    api_key: str | None = None,
    slo: SLO | None = None,
    desc: str = "bench openai",
) -> dict:
    """One concurrency point -> summarize()'s figures plus the per-request records."""
    if concurrency < 1 or max_tokens < 1 or not texts:
        raise ValueError("concurrency and max_tokens must be >= 1, and there must be requests")
    bodies = [request_body(api, model, t, max_tokens) for t in texts]
    samples, elapsed = asyncio.run(drive(url, bodies, concurrency, api_key, desc))
    point = summarize(samples, elapsed, slo)
    del point["stages"], point["router_overhead_per_token_s"]  # server-side: pdserve's gRPC only
    point["concurrency"] = concurrency
    point["prompt_tokens"] = sum(s.prompt_tokens for s in samples)
    point["records"] = [s.record() for s in samples]
    return point


def bench_openai(
    url: str,
    model: str,
    concurrencies: tuple[int, ...] = CONCURRENCIES,
    max_tokens: int = 128,
    requests: int | None = None,
    api: str = "chat",
    api_key: str | None = None,
    seed: int = 0,
    slo: SLO | None = None,
) -> dict:
    """`requests` per point (None: 2c, at least 4); fresh prompts at every point."""
    points = []
    for c in concurrencies:
        n = requests or max(4, 2 * c)
        texts = prompt_texts(n, seed + c)
        points.append(run_point(url, model, c, texts, max_tokens, api, api_key, slo))
    return {
        "benchmark": "openai",
        "url": url,
        "model": model,
        "api": api,
        "max_tokens": max_tokens,
        "seed": seed,
        "machine": machine_info(),
        "points": points,
    }


def point_row(name: str, p: dict) -> str:
    ms = 1e3
    return (
        f"{name:<10} {p['concurrency']:>4} {p['requests']:>5} {p['errors']:>4} "
        f"{p['throughput_tok_s']:>8.1f} {p['ttft_s']['p50'] * ms:>9.1f} "
        f"{p['ttft_s']['p99'] * ms:>9.1f} {p['tpot_s']['p50'] * ms:>9.1f} "
        f"{p['tpot_s']['p99'] * ms:>9.1f}"
    )


HEADER = (
    f"{'server':<10} {'c':>4} {'reqs':>5} {'errs':>4} {'tok/s':>8} {'TTFT p50':>9} "
    f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}   (ms)"
)


def format_table(report: dict) -> str:
    lines = [f"openai: {report['model']} at {report['url']} ({report['api']})", HEADER]
    lines += [point_row("server", p) for p in report["points"]]
    return "\n".join(lines)
