"""Fitting a step-time model to measured steps: non-negative least squares on relative
error (step times span orders of magnitude, so each step weighs as its share of itself),
reweighted by the model's own prediction.

Weighting each step by 1/measured (plain relative least squares) biases the fit low: a step
measured slow by noise weighs less than one measured fast, so the fit follows the fast ones
(measured here: SmolLM2-135M's engine on 2 vCPU, 472 calibration steps, predicted/measured
0.97 over its own decode steps). Weights 1/predicted, a few rounds from the relative fit
(iteratively reweighted least squares, the gamma-regression weights), treat both errors
alike: 1.00 on the same steps.

    coefficients, report = fit_steps([(StepWork, seconds), ...])

The model is t = intercept + sum of coefficient x feature (pdserve/sim/cost.py FEATURES);
a coefficient that the data would make negative is dropped (set to 0) and the rest refit,
until all are >= 0, so the fitted cost never falls as work grows.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pdserve.sim.cost import FEATURES, FittedCost, StepWork
from pdserve.sim.profile import per_seq_term


def _matrix(samples: list[tuple[StepWork, float]]) -> tuple[np.ndarray, np.ndarray]:
    x = np.array([[1.0, *(w.feature(f) for f in FEATURES)] for w, _ in samples])
    y = np.array([t for _, t in samples])
    return x, y


REWEIGHTS = 4  # rounds of 1/predicted weights after the relative fit (converged by then)


def _nnls(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least squares with every coefficient >= 0: a coefficient the data would
    make negative is dropped and the rest refit."""
    active = [j for j in range(x.shape[1]) if np.any(x[:, j])]
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def fit_steps(
    samples: list[tuple[StepWork, float]], without: tuple[str, ...] = ()
) -> tuple[dict[str, float], dict]:
    """-> (coefficients, the fit's errors). `without`: features left out of the model (their
    columns zero, so they get no coefficient and the others take their share)."""
    unknown = sorted(set(without) - set(FEATURES))
    if unknown:
        raise ValueError(f"fit: unknown feature {unknown[0]!r} to leave out")
    if len(samples) < len(FEATURES) + 1:
        raise ValueError(f"fit: {len(samples)} steps are too few for {len(FEATURES) + 1} terms")
    x, y = _matrix(samples)
    names = ["intercept", *FEATURES]
    for feature in without:
        x[:, names.index(feature)] = 0.0  # _nnls leaves an all-zero column out
    coef = _nnls(x, y, 1.0 / np.maximum(y, 1e-9))
    for _ in range(REWEIGHTS):
        pred = x @ coef
        if not (pred > 0).all():
            break
        coef = _nnls(x, y, 1.0 / pred)
    coefficients = {n: float(c) for n, c in zip(names, coef) if c > 0}
    pred = np.array([FittedCost(coefficients).step_seconds(s) for s, _ in samples])
    rel = np.abs(pred - y) / y
    report = {
        "steps": len(samples),
        "median_abs_rel_error": float(np.median(rel)),
        "p90_abs_rel_error": float(np.quantile(rel, 0.9)),
        "max_abs_rel_error": float(rel.max()),
    }
    return coefficients, report


def measured_over(samples: list[tuple[StepWork, float]], coefficients: dict) -> dict | None:
    """How far steps measured now sit from fitted `coefficients`: the median over the steps
    of measured / predicted time, and how many steps (None without a step to compare)."""
    cost = FittedCost(coefficients)
    ratios = [s / p for w, s in samples if (p := cost.step_seconds(w)) > 0]
    if not ratios:
        return None
    return {"measured_over_profile": float(np.median(ratios)), "steps": len(ratios)}


SMALL, LARGE = 4, 8  # split_over's groups: batches of at most SMALL and of at least LARGE
MIN_BIN = 8  # steps a batch size needs before its median counts
MIN_GROUP = 10  # steps each group needs before split_over answers
MIN_SPREAD = 0.05  # how far apart the groups' per-sequence shares must lie


class _Bin(NamedTuple):
    """One batch size's steps: their median per-sequence share and median measured over
    predicted ratio, and every (ratio, share)."""

    share: float
    ratio: float
    rows: list[tuple[float, float]]


def _centroid(group: dict[int, _Bin]) -> tuple[float, float]:
    """A group's batch sizes' (median share, median ratio), weighted by their steps."""
    weight = np.array([len(b.rows) for b in group.values()], dtype=float)
    share = np.array([b.share for b in group.values()])
    ratio = np.array([b.ratio for b in group.values()])
    return float(weight @ share / weight.sum()), float(weight @ ratio / weight.sum())


def split_over(samples: list[tuple[StepWork, float]], coefficients: dict) -> dict | None:
    """Two factors that take fitted `coefficients` to steps measured now: `base` for the
    intercept and the context and prefill terms, `per_seq` for the terms per sequence
    (pdserve/sim/profile.py per_seq_term: one row of every GEMM, one sampled token, the
    slope past each knee). One factor over all terms assumes a machine's speed moves the
    same way at every batch size; on the 2-vCPU VM it did not (steps of batch 1-4 at
    0.78-0.80 of a day-old profile's time, of batch 12 at 0.85-0.92, in the same probes:
    docs/simulator.md). `decode_context` grows with the batch too, but it is the KV's read,
    a memory cost like the weights' (the intercept), so it sits with them: its factor is
    measured where the probe's contexts are long, at the small batches.

    A step's measured / predicted time is base x (1 - s) + per_seq x s, s the share of its
    predicted time in the per-sequence terms. Each batch size with MIN_BIN steps gives its
    median ratio at its median share (medians: a step around a prefill turn runs long
    whatever its batch, and a few of them moved a least-squares fit's per_seq from 0.9 to
    1.5 between probes of the same cluster a minute apart); the small batches' (<= SMALL)
    points and the large ones' (>= LARGE), each averaged weighted by their steps, are two
    points of a line whose value at share 0 is base and at share 1 per_seq. Per batch
    size, not per group: a group's median ratio and median share would come from
    different steps when it mixes batch sizes. Two points, not a fit through every batch
    size: the large batches' ratio is what the comparison's loaded points need, and a fit
    weighted by steps follows the many small batches and misses it. per_seq is the line
    carried out to share 1 from shares of 0.03-0.3, so its own figure is noisy (1.16-1.47
    over four probes of one 1P1D a minute apart); the ratio it gives at the large batches
    is the measured one. None when either group has fewer than MIN_GROUP steps in
    such batch sizes, their shares lie less than MIN_SPREAD apart, or either factor would
    not be positive (one factor then)."""
    base = FittedCost({k: v for k, v in coefficients.items() if not per_seq_term(k)})
    grows = FittedCost({k: v for k, v in coefficients.items() if per_seq_term(k)})
    bins: dict[int, list[tuple[float, float]]] = {}
    for w, t in samples:
        b, g = base.step_seconds(w), grows.step_seconds(w)
        if b + g > 0 and (w.seqs <= SMALL or w.seqs >= LARGE):
            bins.setdefault(w.seqs, []).append((t / (b + g), g / (b + g)))
    points = {
        n: _Bin(
            float(np.median([s for _, s in rows])), float(np.median([r for r, _ in rows])), rows
        )
        for n, rows in bins.items()
        if len(rows) >= MIN_BIN
    }
    small = {n: b for n, b in points.items() if n <= SMALL}
    large = {n: b for n, b in points.items() if n >= LARGE}
    if min(sum(len(b.rows) for b in g.values()) for g in (small, large)) < MIN_GROUP:
        return None
    if min(b.share for b in large.values()) - max(b.share for b in small.values()) < MIN_SPREAD:
        return None
    (s_small, r_small), (s_large, r_large) = (_centroid(small), _centroid(large))
    slope = (r_large - r_small) / (s_large - s_small)  # per_seq - base
    factor = r_small - s_small * slope
    per_seq = factor + slope
    if not (factor > 0 and per_seq > 0):
        return None

    def summary(group: dict[int, _Bin]) -> dict:
        rows = [row for b in group.values() for row in b.rows]
        return {
            "measured_over_profile": float(np.median([r for r, _ in rows])),
            "batches": sorted(group),
            "steps": len(rows),
        }

    return {
        "base": float(factor),
        "per_seq": float(per_seq),
        "small": summary(small),
        "large": summary(large),
    }
