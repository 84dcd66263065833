"""How many prompt tokens a prefill batch may take when the worker computes in turns.

On a CPU node whose workers share the cores (pdserve/serving/cpu_lease.py), a prefill batch
holds every core for its whole forward pass and the decode workers' steps wait for it: a
batch of eight 256-token SmolLM2 prompts took 2.6 s on 2 cores (docs/benchmarks.md), so a
request that is decoding then sees gaps of seconds between two tokens, several times over
while a burst of prompts is worked through (a short request's TPOT is set by them).
Bounding the batch by *time* bounds that gap, the way chunked prefill's token budget does
inside one engine, on any machine: the worker learns its seconds per prompt token from the
batches it ran and sizes the next batch so that its turn lasts about `turn_s`.

    budget = TurnBudget(turn_s=0.25, cap_tokens=2048)
    tokens = budget.tokens()          # before a batch is formed
    budget.observe(tokens, seconds)   # after its forward pass

Tokens are the batch's prompt tokens, cached prefixes included (the units the batcher
counts), so the rate is per batched token. Until a batch has been measured (the first
pass of a worker's life is not: it pays one-time costs) the budget is one prompt (a batch
always takes at least one). A lone prompt longer than a turn buys is computed a part per
turn (`part`: at least a block each; its KV stays in its blocks between
the parts, the last part samples and pushes), once a rate is known. The total work is the
same either way: the prompts are computed in more, shorter turns, with decode steps
between them.
"""

from __future__ import annotations

import math

# weight of the newest batch in the running rate (a burst's batches differ in size and in
# their prompts' lengths; a few batches settle it)
SMOOTHING = 0.3


class TurnBudget:
    def __init__(self, turn_s: float, cap_tokens: int) -> None:
        if not (math.isfinite(turn_s) and turn_s > 0):
            raise ValueError(f"turn_s: must be a finite number > 0, got {turn_s}")
        if cap_tokens < 1:
            raise ValueError(f"cap_tokens: must be >= 1, got {cap_tokens}")
        self.turn_s = turn_s
        self.cap = cap_tokens
        self.s_per_token: float | None = None  # learned from the batches run
        self._warm = False  # the first pass was seen (and not learned from)

    def tokens(self) -> int:
        """The next batch's token budget: what `turn_s` buys at the learned rate, at most
        the configured cap; 1 (one prompt) before anything was measured."""
        if self.s_per_token is None:
            return 1
        return max(1, min(self.cap, int(self.turn_s / self.s_per_token)))

    def part(self, left: int, floor: int) -> int:
        """How much of a lone prompt with `left` tokens still to compute one turn takes
        (what `tokens()` says: at most the cap, so a prompt longer than the batch budget is
        split whatever the turn; at least `floor`), or 0: the rest fits one turn, or no
        rate is known yet (a prompt goes whole until one is)."""
        if self.s_per_token is None:
            return 0
        budget = max(floor, self.tokens())
        return budget if left > budget else 0

    def observe(self, tokens: int, seconds: float) -> None:
        """A batch of `tokens` prompt tokens took `seconds` of forward pass. The first pass
        of a worker's life is not learned from: it pays one-time costs (allocation, kernel
        set-up), tens of times a later pass's, and a rate learned from it cut every prompt
        into blocks until the smoothing caught up."""
        if tokens <= 0 or seconds <= 0:
            return
        if not self._warm:
            self._warm = True
            return
        rate = seconds / tokens
        if self.s_per_token is None:
            self.s_per_token = rate
        else:
            self.s_per_token += SMOOTHING * (rate - self.s_per_token)
