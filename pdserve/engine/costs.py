"""What a preemption costs on this deployment, learned online from the worker's own steps
and spills; nothing here is a constant for one machine.

    observe_chunks(seconds, chunks)   after every engine step: its chunks and the runner's
                                      time (the model's, or the simulator's cost model's)
    observe_step(seconds, decode_seqs, prefill_tokens)   the same, counted
    step_s                    a decode step's time: an exponentially weighted mean (EWMA_ALPHA)
                              of the steps that computed no prompt tokens
    recompute_s_per_token     what one recomputed token adds to a step: from steps that mixed
                              prompt tokens in, each minus the decode-step mean of the moment,
                              summed and divided by their prompt tokens (each token weighs the
                              same; older ones fade with a half-life of HALF_LIFE_TOKENS);
                              None until one such step was seen
    park_s_per_block(tier)    spill + reload seconds per block, the mean over every move the
                              tier made so far (its TierStats), None until it moved a block

Why by tokens and not by steps: a victim computed again is a long context (its prompt and
everything it generated), and what that costs per token is what large chunks show. On a GPU a
few prompt tokens ride almost free in a decode step bound by memory bandwidth: a mean over
steps, most of them carrying a short prompt, read a 32B model's recompute on an H200 at
~3 us per token where a 2,048-token chunk costs ~80 (SIMULATED, the h200 roofline), which
made parking (~170 us per block of 16 tokens over PCIe) look slower than recomputing and
left the tiers out of cost-aware admission. By tokens, the long chunks count for what they
are. On a CPU a prompt token costs about the same in any chunk, and the two nearly agree.

A decode worker computes prompt tokens only when a preempted request is computed again (or a
prompt the router sent it whole, under conditional disaggregation), so
`recompute_s_per_token` may stay unknown; the cost-aware policy then treats parking as the
cheaper way to preempt (the deployment chose tiers), and learns otherwise from the first
recompute.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pdserve.engine.batch import ScheduledChunk

EWMA_ALPHA = 0.1
HALF_LIFE_TOKENS = 16384  # prompt tokens after which a mixed step's cost weighs half


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + EWMA_ALPHA * (new - old)


class PreemptionCosts:
    def __init__(self) -> None:
        self.step_s: float | None = None
        self.recompute_s_per_token: float | None = None
        self._extra_s = 0.0  # mixed steps' time over the decode mean, faded by tokens
        self._tokens = 0.0  # their prompt tokens, faded the same

    def observe_step(self, seconds: float, decode_seqs: int, prefill_tokens: int) -> None:
        if seconds <= 0:
            return
        if prefill_tokens == 0:
            if decode_seqs:
                self.step_s = _ewma(self.step_s, seconds)
            return
        if self.step_s is not None and decode_seqs:
            fade = 0.5 ** (prefill_tokens / HALF_LIFE_TOKENS)
            self._extra_s = fade * self._extra_s + max(0.0, seconds - self.step_s)
            self._tokens = fade * self._tokens + prefill_tokens
            self.recompute_s_per_token = self._extra_s / self._tokens

    def observe_chunks(self, seconds: float, chunks: Sequence[ScheduledChunk]) -> None:
        decode_seqs = prefill_tokens = 0
        for chunk in chunks:
            n = len(chunk.token_ids)
            if n == 1:
                decode_seqs += 1
            else:
                prefill_tokens += n
        self.observe_step(seconds, decode_seqs, prefill_tokens)

    @staticmethod
    def park_s_per_block(tier: Mapping) -> float | None:
        """Spill + reload seconds per block from one tier's stats (OffloadStats.tiers[name]),
        None when it has not moved a block both ways yet."""
        spilled, reloaded = tier["spilled_bytes"], tier["reloaded_bytes"]
        if not spilled or not reloaded:
            return None
        per_byte = tier["spill_s"] / spilled + tier["reload_s"] / reloaded
        return per_byte * tier["block_bytes"]
