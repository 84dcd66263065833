"""LLMEngine: requests in, one step at a time, finished outputs out.

step():  batch = scheduler.schedule()  ->  runner.execute(batch)  ->  scheduler.update(...)
"""

from __future__ import annotations

import itertools
import time

import torch

from pdserve.attention import get_attention_backend
from pdserve.engine.args import EngineArgs
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler
from pdserve.kv import BlockAllocator, KVCache
from pdserve.kv.prefix_offload import PrefixOffload, is_prefix_key
from pdserve.models import build_model
from pdserve.outputs import RequestMetrics, RequestOutput
from pdserve.sampling_params import SamplingParams
from pdserve.weights import resolve

Prompt = str | list[int]


class LLMEngine:
    def __init__(self, model: str, args: EngineArgs | None = None) -> None:
        args = args or EngineArgs()
        self.args = args
        self.source = resolve(model)
        self.model_config = self.source.config
        self.tokenizer = self.source.tokenizer
        self.device = args.resolve_device()
        self.dtype = args.resolve_dtype(self.device)
        self.scheduler_config = args.scheduler_config(self.model_config)
        backend = get_attention_backend(args.attention_backend, self.device)
        self.model = build_model(self.model_config, self.dtype, self.device, self.source.weights())
        self.cache_config = args.cache_config(self.model_config, self.dtype, self.device)
        cc = self.cache_config
        self.allocator = BlockAllocator(cc.num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.kv_cache = KVCache(
            self.model_config, cc.num_blocks, cc.block_size, self.dtype, self.device
        )
        tiers = args.preemption != "recompute" or args.prefix_offload
        self.spiller = self._spiller(args) if tiers else None
        self.prefixes = PrefixOffload(self.spiller, self.allocator) if args.prefix_offload else None
        self.scheduler = Scheduler(
            self.scheduler_config, self.allocator, self.spiller, self.prefixes
        )
        self.runner = ModelRunner(self.model, self.kv_cache, backend, self.device, args.seed)
        self._ids = itertools.count()

    def _spiller(self, args: EngineArgs):
        from pdserve.kv.spill import KVSpiller
        from transfer.tiers import CXLTier, DiskTier, MemoryTier, TieredStore

        blocks = self.cache_config.num_blocks
        block_bytes = self.kv_cache.nbytes // blocks
        host = args.spill_host_blocks if args.spill_host_blocks is not None else 4 * blocks
        tiers = [MemoryTier(host, block_bytes)]
        if args.preemption == "tiered":
            cxl = args.spill_cxl_blocks if args.spill_cxl_blocks is not None else 4 * blocks
            disk = args.spill_disk_blocks if args.spill_disk_blocks is not None else 64 * blocks
            tiers.append(
                CXLTier(
                    cxl,
                    block_bytes,
                    path=args.cxl_path,
                    bandwidth_gb_s=args.cxl_bandwidth_gb_s,
                    latency_us=args.cxl_latency_us,
                )
            )
            tiers.append(DiskTier(disk, block_bytes, root=args.spill_dir))
        return KVSpiller(self.kv_cache, TieredStore(tiers))

    def close(self) -> None:
        """Release the spill tiers (the disk tier's directory goes with them)."""
        if self.spiller is not None:
            self.spiller.close()
            self.spiller = None

    # -- requests -------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt, field: str = "prompt") -> list[int]:
        """Validate a prompt and return its token ids (ValueError naming `field`)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{field}: empty prompt")
            if self.tokenizer is None:
                raise ValueError(f"{field}: this model has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"{field}: expected a string or a list of token ids")
        if not prompt:
            raise ValueError(f"{field}: empty prompt")
        vocab = self.model_config.vocab_size
        for i, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(
                    f"{field}[{i}]: token id {t!r} is outside the vocabulary [0, {vocab})"
                )
        return list(prompt)

    def make_request(
        self, prompt: Prompt, params: SamplingParams, field: str = "prompt"
    ) -> Request:
        """Validate everything about a request without touching engine state."""
        if not isinstance(params, SamplingParams):
            raise ValueError("params: expected SamplingParams")
        token_ids = self.tokenize(prompt, field)
        max_len = self.scheduler_config.max_model_len
        if len(token_ids) + params.max_tokens > max_len:
            raise ValueError(
                f"max_tokens: prompt length {len(token_ids)} + max_tokens {params.max_tokens} "
                f"exceeds max_model_len {max_len}"
            )
        needed = self.allocator.blocks_needed(len(token_ids) + params.max_tokens)
        if needed > self.cache_config.num_blocks:
            raise ValueError(
                f"max_tokens: prompt length {len(token_ids)} + max_tokens {params.max_tokens} "
                f"needs {needed} KV blocks but the pool has {self.cache_config.num_blocks}"
            )
        for t in params.stop_token_ids:
            if t >= self.model_config.vocab_size:
                raise ValueError(f"stop_token_ids: {t} is outside the vocabulary")
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= set(self.model_config.eos_token_ids)
            if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
                stop.add(self.tokenizer.eos_token_id)
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        return Request(
            request_id=str(next(self._ids)),
            token_ids=token_ids,
            num_prompt_tokens=len(token_ids),
            params=params,
            metrics=RequestMetrics(arrival_time=time.monotonic(), prompt_tokens=len(token_ids)),
            stop_ids=frozenset(stop),
            max_total_tokens=len(token_ids) + params.max_tokens,
            generator=generator,
        )

    def add_request(self, prompt: Prompt, params: SamplingParams) -> str:
        req = self.make_request(prompt, params)
        self.enqueue(req)
        return req.request_id

    def enqueue(self, req: Request) -> None:
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id) is not None

    # -- stepping -------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch.empty:
            if self.scheduler.waiting or self.scheduler.swapped:
                raise RuntimeError("scheduler made no progress with requests waiting")
            return []
        self.kv_cache.copy_blocks(batch.copies)
        tokens, logprobs = self.runner.execute(batch.chunks)
        finished = self.scheduler.update(batch, tokens, logprobs)
        return [self.to_output(r) for r in finished]

    def to_output(self, req: Request) -> RequestOutput:
        out_ids = req.output_token_ids
        text = self.tokenizer.decode(out_ids) if self.tokenizer is not None else ""
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.token_ids[: req.num_prompt_tokens],
            token_ids=list(out_ids),
            text=text,
            finish_reason=req.status.value,
            metrics=req.metrics,
            logprobs=req.logprobs,
        )

    def check_integrity(self) -> None:
        self.allocator.check_integrity(self.scheduler.block_owners())
        if self.spiller is not None:
            self.spiller.store.check_integrity()
            parked = {r.request_id for r in self.scheduler.swapped}
            spilled = {k for k in self.spiller.store.where if not is_prefix_key(k)}
            assert spilled == parked, "spilled KV without its request"
        if self.prefixes is not None:
            self.prefixes.check_integrity()
            assert self.prefixes.held_blocks == len(self.spiller.store.where) - len(parked)
