"""`LLM`: the colocated offline engine (`from pdserve import LLM, SamplingParams`)."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.config import DEFAULT_PREEMPTION
from pdserve.engine.admission import DEFAULT_ADMISSION, DEFAULT_MARGIN, check_admission
from pdserve.engine.args import EngineArgs
from pdserve.engine.build import build_engine
from pdserve.engine.gate import AdmissionGate, make_admission
from pdserve.engine.output import EngineStats, FinishedRequest
from pdserve.outputs import RequestOutput
from pdserve.progress import progress
from pdserve.sampling_params import SamplingParams
from pdserve.validation import Prompt

Conversation = list[dict[str, str]]


class LLM:
    """`LLM(model, **engine_args)`; model is a preset, a checkpoint directory or a .gguf file.

    Engine arguments: see pdserve.engine.args.EngineArgs (block_size, num_kv_blocks,
    kv_cache_memory, max_model_len, dtype, device, enable_prefix_caching, prefix_offload,
    preemption and the spill tier sizes, max_num_seqs, max_num_batched_tokens,
    attention_backend, seed, tensor_parallel_size: the model sharded over that many
    processes, this one rank 0, see docs/tensor-parallel.md).

    Requests wait in front of the engine until `admission` lets them in (greedy | kv-aware |
    cost-aware, pdserve/engine/admission.py); given no flags the colocated engine runs what a
    decode worker runs: cost-aware admission, preemption parking KV in the tiers (preemption
    "tiered"; pass preemption="recompute" for today's engines' behaviour).
    """

    def __init__(
        self,
        model: str,
        admission: str = DEFAULT_ADMISSION,
        admission_margin: float = DEFAULT_MARGIN,
        **engine_args,
    ) -> None:
        check_admission(admission, admission_margin)  # before the model loads
        engine_args.setdefault("preemption", DEFAULT_PREEMPTION)
        try:
            args = EngineArgs(**engine_args)
        except TypeError as e:
            raise ValueError(f"engine argument: {e}") from None
        self.core, self.source = build_engine(model, args)
        self.gate = AdmissionGate(self.core, make_admission(admission, self.core, admission_margin))

    @property
    def tokenizer(self):
        return self.source.tokenizer

    @property
    def model_config(self):
        return self.core.model_config

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
            self.core.make_request(p, sp, field=f"prompts[{i}]")
            for i, (p, sp) in enumerate(zip(prompts, params))
        ]
        for req in requests:
            self.gate.offer(req)
        outputs: dict[str, RequestOutput] = {}
        with progress(total=len(requests), disable=not use_tqdm, desc="generate") as bar:
            while self.gate.busy:
                for done in self.gate.step().finished:
                    outputs[done.request_id] = self._output(done)
                    bar.update(1)
        return [outputs[r.request_id] for r in requests]

    def _output(self, done: FinishedRequest) -> RequestOutput:
        tok = self.source.tokenizer
        return RequestOutput(
            request_id=done.request_id,
            prompt_token_ids=done.prompt_token_ids,
            token_ids=done.output_token_ids,
            text=tok.decode(done.output_token_ids) if tok is not None else "",
            finish_reason=done.finish_reason,
            metrics=done.metrics,
            logprobs=done.logprobs,
        )

    def render_chat(self, conversation: Conversation) -> str:
        if self.tokenizer is None:
            raise ValueError("conversation: this model has no tokenizer or chat template")
        return self.tokenizer.apply_chat_template(conversation)

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

    def stats(self) -> EngineStats:
        """Preemptions, recomputed tokens, spilled/reloaded bytes (`.spilled_bytes`), the
        pool and every tier."""
        return self.core.stats()

    def memory(self):
        """Per rank (one, or tensor_parallel_size): weight, packed-weight and KV pool bytes."""
        return self.core.memory()

    def check_integrity(self) -> None:
        self.core.check_integrity()

    def close(self) -> None:
        """Release the spill tiers (the disk tier's directory goes with them)."""
        self.core.close()
