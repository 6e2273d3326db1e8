"""The engine's step cost, fitted online from measured steps: what the SLO check predicts TTFT with.

    seconds ≈ fixed + per_new_token · new_tokens + per_cached_token · cached_tokens

new_tokens are the tokens computed in the step (prompt chunks and one per decoding sequence);
cached_tokens are the KV entries attention reads (each scheduled sequence's context before the step).
This is the linear form that vLLM scheduling studies use; on a CPU and on a GPU alike it fits a step
within a few percent once the batch is past its smallest sizes.

Fitted by recursive least squares with a forgetting factor, so that the model follows a machine whose
speed drifts (other load, thermal limits) without storing past steps. Until `min_samples` steps are
seen, predictions come from the prior.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepRecord:
    """One engine step as measured by the engine thread."""

    new_tokens: int
    cached_tokens: int
    num_seqs: int
    seconds: float


@dataclass(frozen=True)
class StepCost:
    fixed_s: float
    per_new_token_s: float
    per_cached_token_s: float
    samples: int

    def predict(self, new_tokens: int, cached_tokens: int) -> float:
        return self.fixed_s + self.per_new_token_s * new_tokens + self.per_cached_token_s * cached_tokens


# A small model on a CPU: 20 ms a step, 0.5 ms a new token, 1 µs a cached token. Only used until the
# first steps have been measured; any sensible start works, the fit replaces it within min_samples.
DEFAULT_PRIOR = StepCost(0.02, 5e-4, 1e-6, 0)


class StepCostModel:
    def __init__(self, prior: StepCost = DEFAULT_PRIOR, forgetting: float = 0.995, min_samples: int = 8):
        if not 0.9 <= forgetting <= 1.0:
            raise ValueError(f"forgetting must be in [0.9, 1], got {forgetting}")
        self.prior = prior
        self.forgetting = forgetting
        self.min_samples = min_samples
        self._theta = np.array([prior.fixed_s, prior.per_new_token_s, prior.per_cached_token_s])
        # Features are scaled to O(1) so that one covariance serves values ~1 s and ~1e-6 s/token.
        self._scale = np.array([1.0, 1e-3, 1e-5])
        self._p = np.eye(3) * 1e3
        self._w = self._theta / self._scale
        self.samples = 0

    def observe(self, rec: StepRecord) -> None:
        if rec.seconds <= 0 or rec.new_tokens <= 0:
            return
        x = np.array([1.0, rec.new_tokens, rec.cached_tokens]) * self._scale
        px = self._p @ x
        gain = px / (self.forgetting + x @ px)
        self._w = self._w + gain * (rec.seconds - x @ self._w)
        self._p = (self._p - np.outer(gain, px)) / self.forgetting
        self.samples += 1

    def current(self) -> StepCost:
        """The fitted coefficients (negative ones, possible early in a fit, are clamped at 0)."""
        if self.samples < self.min_samples:
            return StepCost(self.prior.fixed_s, self.prior.per_new_token_s, self.prior.per_cached_token_s,
                            self.samples)
        theta = np.maximum(self._w * self._scale, 0.0)
        return StepCost(float(theta[0]), float(theta[1]), float(theta[2]), self.samples)

    def predict(self, new_tokens: int, cached_tokens: int) -> float:
        return self.current().predict(new_tokens, cached_tokens)
