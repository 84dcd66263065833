"""Tokenizers and chat templates.

`Tokenizer` wraps a `tokenizers.Tokenizer` (from a checkpoint's tokenizer.json or built from
GGUF metadata); `ByteTokenizer` serves the random-weight presets (one token per UTF-8 byte).
Chat templates are the checkpoint's Jinja template, rendered in a sandbox; checkpoints without
one use `DEFAULT_CHAT_TEMPLATE` (ChatML: `<|im_start|>role\\ncontent<|im_end|>\\n`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from pdserve.config import ModelConfig

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise_exception(message: str) -> None:  # what chat templates call to refuse input
    raise ValueError(f"chat template: {message}")


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """The template compiled once (a compile took ~1 ms of the router's CPU per request);
    rendering a compiled template is thread-safe. Raises jinja2's TemplateError."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def render_chat(template: str, messages: list[dict[str, str]], **variables: Any) -> str:
    from jinja2 import TemplateError

    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}]: expected a dict with a 'role' string")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content: expected a string")
    try:
        return _compiled(template).render(
            messages=messages, add_generation_prompt=True, **variables
        )
    except TemplateError as e:
        raise ValueError(f"chat template: {e}") from None


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 is BOS, 257 EOS; larger ids decode to nothing."""

    bos_token_id = 256
    eos_token_id = 257

    def __init__(self, vocab_size: int) -> None:
        assert vocab_size >= 258
        self.vocab_size = vocab_size
        self.chat_template = DEFAULT_CHAT_TEMPLATE

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id, *text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return render_chat(self.chat_template, messages)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what generation needs to know about it."""

    def __init__(
        self,
        backend: Any,
        bos_token: str | None,
        eos_token: str | None,
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        self.backend = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        self.add_bos = add_bos and self.bos_token_id is not None
        self.chat_template = chat_template or DEFAULT_CHAT_TEMPLATE

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return render_chat(
            self.chat_template,
            messages,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config files
        return value.get("content")
    return value


def load_hf_tokenizer(path: Path, config: ModelConfig) -> Tokenizer | None:
    """tokenizer.json (+ tokenizer_config.json) of a checkpoint directory, if present."""
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer as Backend

    try:
        backend = Backend.from_file(str(file))
    except Exception as e:  # the tokenizers library raises plain Exception subclasses
        raise ValueError(f"model: cannot read {str(file)!r} ({e})") from None
    tk_cfg: dict[str, Any] = {}
    cfg_file = path / "tokenizer_config.json"
    if cfg_file.is_file():
        try:
            tk_cfg = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"model: {str(cfg_file)!r} is not valid JSON ({e})") from None
    bos = _token_text(tk_cfg.get("bos_token"))
    eos = _token_text(tk_cfg.get("eos_token"))
    if bos is None and config.bos_token_id is not None:
        bos = backend.id_to_token(config.bos_token_id)
    if eos is None and config.eos_token_ids:
        eos = backend.id_to_token(config.eos_token_ids[0])
    template = tk_cfg.get("chat_template")
    template_file = path / "chat_template.jinja"
    if template is None and template_file.is_file():
        template = template_file.read_text()
    # The tokenizer.json post-processor (if any) is bypassed; BOS is added explicitly.
    add_bos = bool(tk_cfg.get("add_bos_token", False))
    return Tokenizer(backend, bos, eos, add_bos, template if isinstance(template, str) else None)


def tokenizer_from_gguf_vocab(
    tokens: list[str],
    token_types: list[int],
    merges: list[str],
    pre: str | None,
    bos_id: int | None,
    eos_id: int | None,
    add_bos: bool,
    chat_template: str | None,
) -> Tokenizer:
    """Build a byte-level BPE tokenizer from GGUF `tokenizer.ggml.*` metadata (model 'gpt2')."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # SmolLM's pre-tokenizer splits every digit on its own before the GPT-2 split.
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    control = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind in zip(tokens, token_types)
        if kind == 3  # CONTROL, e.g. <|im_start|>
    ]
    backend.add_special_tokens(control)
    bos = tokens[bos_id] if bos_id is not None else None
    eos = tokens[eos_id] if eos_id is not None else None
    return Tokenizer(backend, bos, eos, add_bos, chat_template)
