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
