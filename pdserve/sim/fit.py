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


def fit_steps(samples: list[tuple[StepWork, float]]) -> tuple[dict[str, float], dict]:
    if len(samples) < len(FEATURES) + 1:
        raise ValueError(f"fit: {len(samples)} steps are too few for {len(FEATURES) + 1} terms")
    x, y = _matrix(samples)
    names = ["intercept", *FEATURES]
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
MIN_GROUP = 10  # steps each group needs before split_over answers


def split_over(samples: list[tuple[StepWork, float]], coefficients: dict) -> dict | None:
    """Two factors that take fitted `coefficients` to steps measured now: `base` for the
    intercept and the context and prefill terms (what a step costs whatever its batch:
    reading the weights and the KV), `per_seq` for the terms per sequence
    (pdserve/sim/profile.py per_seq_term). One factor over all terms assumes a machine's
    speed moves the same way at every batch size; on the 2-vCPU VM it did not (steps of
    batch 1-4 at 0.78-0.80 of a day-old profile's time, of batch 12 at 0.85-0.92, in the
    same probes: docs/simulator.md).

    A step's measured / predicted time is base x (1 - s) + per_seq x s, s the share of its
    predicted time in the per-sequence terms. Two groups of steps, small batches (<= SMALL)
    and large ones (>= LARGE), each give its median ratio and its median share, and the two
    equations give the two factors. Medians, not a least-squares fit: the steps around a
    prefill turn run long whatever their batch, and a few of them moved a fit's per_seq
    from 0.9 to 1.5 between probes of the same cluster a minute apart. None when either
    group has fewer than MIN_GROUP steps, the shares do not differ, or either factor would
    not be positive (one factor then)."""
    base = FittedCost({k: v for k, v in coefficients.items() if not per_seq_term(k)})
    grows = FittedCost({k: v for k, v in coefficients.items() if per_seq_term(k)})
    groups = []
    for keep in (lambda n: n <= SMALL, lambda n: n >= LARGE):
        rows = [
            (t / (b + g), g / (b + g))
            for w, t in samples
            if keep(w.seqs) and (b := base.step_seconds(w)) + (g := grows.step_seconds(w)) > 0
        ]
        if len(rows) < MIN_GROUP:
            return None
        ratios, shares = zip(*rows)
        groups.append((float(np.median(ratios)), float(np.median(shares)), len(rows)))
    (r_small, s_small, n_small), (r_large, s_large, n_large) = groups
    if s_large - s_small < 1e-3:
        return None
    per_seq_minus_base = (r_large - r_small) / (s_large - s_small)
    factor = r_small - s_small * per_seq_minus_base
    per_seq = factor + per_seq_minus_base
    if not (factor > 0 and per_seq > 0):
        return None
    return {
        "base": factor,
        "per_seq": per_seq,
        "small": {"measured_over_profile": r_small, "per_seq_share": s_small, "steps": n_small},
        "large": {"measured_over_profile": r_large, "per_seq_share": s_large, "steps": n_large},
    }
