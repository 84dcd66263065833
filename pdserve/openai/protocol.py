"""OpenAI request bodies -> one plain `OpenAIRequest`, and the response bodies back.

Validation raises `BadRequest(param, message)` for anything wrong; the server answers 400
with the field named. Fields this server does not know are ignored (load tools send extras
such as `user`); known fields are checked for type and range, and options it cannot honour
(`n` > 1, `echo`, `logprobs`, `best_of` > 1, non-zero penalties, `min_p`, `logit_bias`,
tools and functions (and tool calls in a history), a `response_format` other than text,
`suffix`, `top_logprobs`) are refused rather than silently dropped (empty or default values
of them are accepted).
`ignore_eos` and `top_k` are accepted as the vLLM extensions that `vllm bench serve` uses.

The body itself is read by `pdserve.openai.strict_json.loads` (re-exported here).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

from pdserve.openai.strict_json import BadRequest, loads, show

__all__ = ["BadRequest", "OpenAIRequest", "loads", "parse_chat", "parse_completion"]

MAX_STOP = 4
MAX_STOP_CHARS = 512  # each stop string; held-back text is checked against every prefix
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


# -- requests --------------------------------------------------------------------------------


@dataclass
class OpenAIRequest:
    chat: bool
    prompt: str | list[int]  # text (templated for chat) or token ids
    max_tokens: int | None  # None: fill the context (chat without a limit)
    sampling: dict = field(default_factory=dict)  # SamplingParams keywords besides max_tokens
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise BadRequest(name, f"{name}: expected an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise BadRequest(name, f"{name}: must be in [{lo}, {hi}], got {show(v)}")
    return v


def _num(body: dict, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_num(v):
        raise BadRequest(name, f"{name}: expected a number, got {type(v).__name__}")
    if not (lo < v if lo_open else lo <= v) or not v <= hi:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise BadRequest(name, f"{name}: must be in {interval}, got {show(v)}")
    return float(v)


def _bool(body: dict, name: str, parent: str | None = None) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        where = f"{parent}.{name}" if parent else name
        raise BadRequest(parent or name, f"{where}: expected true or false, got {show(v)}")
    return v


def _refuse_unsupported(body: dict, chat: bool) -> None:
    if _int(body, "n", 1, INT32_MAX) not in (None, 1):
        raise BadRequest("n", "n: only n=1 is supported")
    if _int(body, "best_of", 1, INT32_MAX) not in (None, 1):
        raise BadRequest("best_of", "best_of: only best_of=1 is supported")
    if _bool(body, "echo"):
        raise BadRequest("echo", "echo: not supported")
    # chat's logprobs is a switch (off: false); a completion's a count, where 0 still asks
    # for the sampled tokens' log probabilities
    logprobs = body.get("logprobs")
    if not (logprobs is None or logprobs is False or (chat and logprobs == 0)):
        raise BadRequest("logprobs", "logprobs: not supported")
    for name in ("presence_penalty", "frequency_penalty"):
        if _num(body, name, -2.0, 2.0) not in (None, 0.0):
            raise BadRequest(name, f"{name}: only 0 is supported")
    if _num(body, "repetition_penalty", 0.0, math.inf, lo_open=True) not in (None, 1.0):
        raise BadRequest("repetition_penalty", "repetition_penalty: only 1 is supported")
    if _num(body, "min_p", 0.0, 1.0) not in (None, 0.0):
        raise BadRequest("min_p", "min_p: only 0 is supported")
    # options that would change what comes back: refused unless empty or their default
    # (clients such as LangChain send `logit_bias: {}` and `tools: []` for nothing)
    for name in ("logit_bias", "tools", "functions", "suffix", "top_logprobs"):
        if body.get(name) not in (None, {}, [], "", 0, False):
            raise BadRequest(name, f"{name}: not supported")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise BadRequest("tool_choice", "tool_choice: not supported (no tools)")
    if body.get("function_call") not in (None, "none", "auto"):
        raise BadRequest("function_call", "function_call: not supported (no functions)")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise BadRequest("response_format", "response_format: only {'type': 'text'} is supported")


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop", "stop: expected a non-empty string or a list of them")
    if len(stops) > MAX_STOP:
        raise BadRequest("stop", f"stop: at most {MAX_STOP} sequences, got {len(stops)}")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise BadRequest("stop", f"stop: each sequence is at most {MAX_STOP_CHARS} characters")
    return stops


def _common(body: dict, chat: bool, prompt, vocab_size: int) -> OpenAIRequest:
    _refuse_unsupported(body, chat)
    max_tokens = _int(body, "max_tokens", 1, INT32_MAX)
    if chat and max_tokens is None:
        max_tokens = _int(body, "max_completion_tokens", 1, INT32_MAX)
    if not chat and max_tokens is None:
        max_tokens = DEFAULT_COMPLETION_TOKENS
    sampling: dict = {}
    temperature = _num(body, "temperature", 0.0, 2.0)
    if temperature is not None:
        sampling["temperature"] = temperature
    top_p = _num(body, "top_p", 0.0, 1.0, lo_open=True)
    if top_p is not None:
        sampling["top_p"] = top_p
    top_k = _int(body, "top_k", -1, INT32_MAX)  # 0 and -1: no top-k
    if top_k is not None:
        sampling["top_k"] = top_k
    seed = _int(body, "seed", -INT64_MAX, INT64_MAX)
    if seed is not None:
        sampling["seed"] = seed
    if _bool(body, "ignore_eos"):
        sampling["ignore_eos"] = True
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("stream_options", "stream_options: expected an object")
    include_usage = _bool(options or {}, "include_usage", parent="stream_options")
    stream = _bool(body, "stream")
    if include_usage and not stream:
        raise BadRequest("stream_options", "stream_options: only allowed when stream is true")
    if isinstance(prompt, list) and any(not 0 <= t < vocab_size for t in prompt):
        raise BadRequest("prompt", f"prompt: token ids must be in [0, {vocab_size})")
    return OpenAIRequest(
        chat=chat,
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=_stop(body),
        stream=stream,
        include_usage=include_usage,
    )


def _check_model(body: dict) -> None:
    """Any model name is accepted (this server serves one model; /v1/models names it)."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise BadRequest("model", f"model: expected a string, got {type(model).__name__}")


def parse_completion(body, vocab_size: int) -> OpenAIRequest:
    """POST /v1/completions: `prompt` is a string, token ids, or a one-element list of either."""
    if not isinstance(body, dict):
        raise BadRequest(None, "the request body must be a JSON object")
    _check_model(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt", "prompt: must not be empty")
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        pass
    elif isinstance(prompt, list) and not prompt:
        raise BadRequest("prompt", "prompt: must not be empty")
    elif prompt is None:
        raise BadRequest("prompt", "prompt: required")
    else:
        raise BadRequest(
            "prompt", "prompt: expected a string or a list of token ids (batches of one only)"
        )
    return _common(body, False, prompt, vocab_size)


def messages_of(body: dict) -> list[dict[str, str]]:
    """`messages` -> [{"role", "content"[, "name"]}] with text content (text parts joined
    by newlines)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "messages: expected a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest("messages", f"messages[{i}]: expected an object")
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise BadRequest("messages", f"messages[{i}].role: unknown role {show(role)}")
        # an assistant turn's tool or function calls: refused as `tools` is (this server has
        # none), rather than the turn rendered as if it had said nothing (empty values pass)
        for name in ("tool_calls", "function_call"):
            if m.get(name) not in (None, [], {}):
                raise BadRequest(
                    "messages", f"messages[{i}].{name}: not supported (no tools or functions)"
                )
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise BadRequest(
                        "messages", f"messages[{i}].content[{j}]: only text parts are supported"
                    )
                if not isinstance(part.get("text"), str):
                    raise BadRequest("messages", f"messages[{i}].content[{j}].text: not a string")
                parts.append(part["text"])
            content = "\n".join(parts)  # as vLLM joins them (its chat_utils)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise BadRequest("messages", f"messages[{i}].content: expected a string")
        # OpenAI's newer name for the system role; checkpoints' templates know "system"
        # (Llama-3 would render a "developer" header, Mistral's refuse it)
        message = {"role": "system" if role == "developer" else role, "content": content}
        name = m.get("name")
        if name is not None:  # a participant's name: the chat template may render it
            if not isinstance(name, str):
                raise BadRequest("messages", f"messages[{i}].name: expected a string")
            message["name"] = name
        out.append(message)
    return out


def parse_chat(body, vocab_size: int, render) -> OpenAIRequest:
    """POST /v1/chat/completions; `render(messages) -> str` applies the chat template."""
    if not isinstance(body, dict):
        raise BadRequest(None, "the request body must be a JSON object")
    _check_model(body)
    messages = messages_of(body)
    try:
        prompt = render(messages)
    except ValueError as e:
        raise BadRequest("messages", f"messages: {e}") from None
    return _common(body, True, prompt, vocab_size)


# -- responses -----------------------------------------------------------------------------


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    rid: str, model: str, chat: bool, text: str, finish: str, use: dict, extra: dict
) -> dict:
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish,
            "logprobs": None,
        }
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": use,
        "pdserve": extra,
    }


def chunk_body(
    rid: str, model: str, chat: bool, text: str | None, finish: str | None, created: int = 0
) -> dict:
    """One streamed chunk: `text` None with a finish reason is the closing chunk; for chat,
    text "" with no finish opens the assistant message."""
    if chat:
        delta: dict = {}
        if text == "" and finish is None:
            delta = {"role": "assistant", "content": ""}
        elif text:
            delta = {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": [choice],
    }


def usage_chunk(rid: str, model: str, chat: bool, use: dict, created: int = 0) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": [],
        "usage": use,
    }


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
