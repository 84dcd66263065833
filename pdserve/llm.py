"""`LLM`: the colocated offline engine (`from pdserve import LLM, SamplingParams`)."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.args import EngineArgs
from pdserve.engine.llm_engine import LLMEngine, Prompt
from pdserve.outputs import RequestOutput
from pdserve.progress import progress
from pdserve.sampling_params import SamplingParams

Conversation = list[dict[str, str]]


class LLM:
    """`LLM(model, **engine_args)`; model is a preset, a checkpoint directory or a .gguf file.

    Engine arguments: block_size, num_kv_blocks, kv_cache_memory (bytes), max_model_len,
    dtype, device, enable_prefix_caching, max_num_seqs, max_num_batched_tokens,
    attention_backend, seed.
    """

    def __init__(self, model: str, **engine_args) -> None:
        try:
            args = EngineArgs(**engine_args)
        except TypeError as e:
            raise ValueError(f"engine argument: {e}") from None
        self.engine = LLMEngine(model, args)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. Every prompt is validated before any runs."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} given for {len(prompts)} prompts")
        requests = [
            self.engine.make_request(p, sp, field=f"prompts[{i}]")
            for i, (p, sp) in enumerate(zip(prompts, params))
        ]
        for req in requests:
            self.engine.enqueue(req)
        outputs: dict[str, RequestOutput] = {}
        with progress(total=len(requests), disable=not use_tqdm, desc="generate") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    outputs[out.request_id] = out
                    bar.update(1)
        return [outputs[r.request_id] for r in requests]

    def render_chat(self, conversation: Conversation) -> str:
        if self.engine.tokenizer is None:
            raise ValueError("conversation: this model has no tokenizer or chat template")
        return self.engine.tokenizer.apply_chat_template(conversation)

    def chat(
        self,
        conversations: Conversation | Sequence[Conversation],
        params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate a reply."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # a single conversation
        prompts = [self.render_chat(list(c)) for c in conversations]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def check_integrity(self) -> None:
        self.engine.check_integrity()
