"""Online latency model: predicted batch run time t = a + b * padded_tokens, one fit per model.

Workers report each batch's run time; the coordinator feeds them here. The fit is an exponentially
weighted least squares (recent batches count more, so the model follows a device that warms up or a
neighbour that steals cycles). Until a model has two distinct observations the prior is used.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class _Fit:
    # exponentially weighted sums of 1, x, y, x*x, x*y
    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    n: int = 0


class LatencyModel:
    """Predicts seconds to run a batch of ``padded_tokens`` for ``model``."""

    def __init__(
        self,
        prior_base_s: float = 0.002,
        prior_per_token_s: float = 1e-4,
        decay: float = 0.98,
    ) -> None:
        if not 0 < decay <= 1:
            raise ValueError("decay must be in (0, 1]")
        self._prior = (prior_base_s, prior_per_token_s)
        self.decay = decay
        self._fits: dict[str, _Fit] = {}
        # Each model's coefficients until its next observation (the priors are fixed at construction):
        # the policy predicts once per queue per poll.
        self._coefficients: dict[str, tuple[float, float]] = {}

    @property
    def prior_base_s(self) -> float:
        return self._prior[0]

    @property
    def prior_per_token_s(self) -> float:
        return self._prior[1]

    def observe(self, model: str, padded_tokens: int, run_s: float) -> None:
        if run_s < 0 or padded_tokens < 0:
            return
        fit = self._fits.setdefault(model, _Fit())
        d = self.decay
        x, y = float(padded_tokens), float(run_s)
        fit.w = fit.w * d + 1.0
        fit.sx = fit.sx * d + x
        fit.sy = fit.sy * d + y
        fit.sxx = fit.sxx * d + x * x
        fit.sxy = fit.sxy * d + x * y
        fit.n += 1
        self._coefficients.pop(model, None)

    def observed(self, model: str) -> bool:
        """Whether ``model`` has had a batch's run time observed (else its predictions are the prior's)."""
        fit = self._fits.get(model)
        return fit is not None and fit.n > 0

    def coefficients(self, model: str) -> tuple[float, float]:
        """(base seconds, seconds per padded token) currently used for ``model``."""
        cached = self._coefficients.get(model)
        if cached is None:
            cached = self._coefficients[model] = self._fitted(model)
        return cached

    def _fitted(self, model: str) -> tuple[float, float]:
        fit = self._fits.get(model)
        if fit is None or fit.n == 0:
            return self._prior
        mean_x = fit.sx / fit.w
        mean_y = fit.sy / fit.w
        var_x = fit.sxx / fit.w - mean_x * mean_x
        if fit.n < 2 or var_x <= 1e-9 * max(1.0, mean_x * mean_x):
            # One batch shape seen so far: keep the prior's slope, move the level to the data.
            slope = self.prior_per_token_s
        else:
            slope = max(0.0, (fit.sxy / fit.w - mean_x * mean_y) / var_x)
        base = max(0.0, mean_y - slope * mean_x)
        return base, slope

    def predict(self, model: str, padded_tokens: int) -> float:
        base, slope = self.coefficients(model)
        return base + slope * padded_tokens
