"""The peak of the KV demand the held requests are expected to make, counting that they end.

kv-aware admission projects every held request to its expected final length and adds them
up, as if all of them reached it at once. They do not: while one grows, others finish and
free their blocks. In a steady state where a finished request is replaced at once, a held
request is on average half-way through its life, so that sum is about twice the KV the
pool ever holds (the length-biased mean E[L^2] / E[L] against E[L^2] / 2 E[L]); the
simulated H200 reasoning runs showed it: kv-aware kept the pool 66% full, greedy 98%.

Here each held request r (T_r tokens held, g_r generated, at most M_r) is alive after t
more steps with the probability that the observed output lengths give,

    S_r(t) = #{observed l: min(l, M_r) > g_r + t} / #{observed l > g_r}

(when nothing observed outlived g_r, or nothing was observed yet: alive until M_r, the cap),
and then holds blocks(T_r + t). The expected demand over the next steps is

    U(t) = sum_r blocks(T_r + t) * S_r(t)        (blocks an earlier request lists: once)

and admission reads its peak over t (on a grid), U(0) being what is held now, with the
standard deviation of the demand at that peak (each request alive or not independently:
sum_r blocks(T_r + t*)^2 S_r (1 - S_r)). Arrays, so that a check over a thousand held
requests takes well under a millisecond.

Approximations (each can only under-count, by a little): a block an earlier request lists is
left out of the later one's term at every horizon, also once the earlier one has likely
ended; and U is read on a grid (denser near now, plus the step before each request's cap or
longest observed length, a spread of 48 of them past 48 requests), so a peak just before an
intermediate observed length may be read a few steps early.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.engine.length_estimator import OutputLengthEstimator
from pdserve.engine.output import HeldRequest

GRID = 48  # horizons looked at: t_max (k / GRID)^2, denser near now, and requests' ends


@dataclass(frozen=True)
class PeakDemand:
    blocks: float  # max over t of U(t)
    sd_blocks: float  # its standard deviation at that t
    horizon: int  # the t (steps from now) of the peak
    worst_blocks: int  # every request at its cap at once: no demand can exceed it


def peak_demand(
    held: Sequence[HeldRequest],
    counted: Sequence[int],
    estimator: OutputLengthEstimator,
    block_size: int,
) -> PeakDemand:
    """U's peak for `held`; `counted[i]`: how many of held[i]'s blocks an earlier one lists."""
    if not held:
        return PeakDemand(0.0, 0.0, 0, 0)
    tokens = np.fromiter((h.tokens for h in held), np.int64, len(held))
    gen = np.fromiter((h.generated for h in held), np.int64, len(held))
    cap = np.fromiter((h.max_tokens for h in held), np.int64, len(held))
    shared = np.asarray(counted, dtype=np.int64)
    left = np.maximum(cap - gen, 0)  # steps to the cap
    lengths = estimator.sorted_lengths()
    # observed lengths that outlived each request's g (none: it runs to its cap)
    outlived = lengths.size - np.searchsorted(lengths, gen, side="right")
    known = outlived > 0
    # the farthest horizon anyone may live to: an explained request ends by the longest
    # length observed, an unexplained one at its cap
    ends = np.where(known, np.minimum(left, (lengths[-1] if lengths.size else 0) - gen), left)
    t_max = int(ends.max())
    # a request holds the most just before it ends: those steps are looked at too (a
    # spread of them when there are many)
    last = np.maximum(ends - 1, 0)
    if last.size > GRID:
        last = np.quantile(last, np.linspace(0, 1, GRID)).astype(np.int64)
    grid = (t_max * (np.arange(GRID + 1) / GRID) ** 2).astype(np.int64)
    t = np.unique(np.concatenate([grid, last]))  # from 0, ascending
    alive = np.ones((len(held), t.size))
    if known.any():
        later = lengths.size - np.searchsorted(lengths, gen[:, None] + t[None, :], side="right")
        share = later / np.maximum(outlived, 1)[:, None]
        alive = np.where(known[:, None], share, alive)
    alive = np.where(t[None, :] < left[:, None], alive, 0.0)
    alive[:, 0] = 1.0  # held now, whatever its cap says
    blocks = -(-(tokens[:, None] + t[None, :]) // block_size) - shared[:, None]
    blocks = np.maximum(blocks, 0)
    demand = (blocks * alive).sum(axis=0)
    k = int(np.argmax(demand))
    var = float((blocks[:, k] ** 2 * alive[:, k] * (1 - alive[:, k])).sum())
    worst = int(np.maximum(-(-(tokens + left) // block_size) - shared, 0).sum())
    # float sums of like terms can land a hair above a whole number (26.000000000000004)
    peak = round(float(demand[k]), 9)
    return PeakDemand(peak, var**0.5, int(t[k]), worst)
