"""Fitting a step-time model to measured steps: non-negative least squares on relative
error (step times span orders of magnitude, so each step weighs as its share of itself).

    coefficients, report = fit_steps([(StepWork, seconds), ...])

The model is t = intercept + sum of coefficient x feature (pdserve/sim/cost.py FEATURES);
a coefficient that the data would make negative is dropped (set to 0) and the rest refit,
until all are >= 0, so the fitted cost never falls as work grows.
"""

from __future__ import annotations

import numpy as np

from pdserve.sim.cost import FEATURES, FittedCost, StepWork


def _matrix(samples: list[tuple[StepWork, float]]) -> tuple[np.ndarray, np.ndarray]:
    x = np.array([[1.0, *(w.feature(f) for f in FEATURES)] for w, _ in samples])
    y = np.array([t for _, t in samples])
    return x, y


def fit_steps(samples: list[tuple[StepWork, float]]) -> tuple[dict[str, float], dict]:
    if len(samples) < len(FEATURES) + 1:
        raise ValueError(f"fit: {len(samples)} steps are too few for {len(FEATURES) + 1} terms")
    x, y = _matrix(samples)
    names = ["intercept", *FEATURES]
    active = [j for j in range(x.shape[1]) if np.any(x[:, j])]
    w = 1.0 / np.maximum(y, 1e-9)
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
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
