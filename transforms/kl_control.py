"""KL coefficient controllers: a constant one and the adaptive one of Ziegler et al. (2019).

The KL a controller is fed is the mean over sequences of the summed per-token KL of each sequence,
and ``n_steps`` counts the sequences in the batch (as in Ziegler et al., where one step is one
episode). :class:`~tokengym.transforms.KLRewardTransform` calls :meth:`update` once per collected
batch it processes, so no manual call is needed.
"""

from __future__ import annotations

from tokengym.transforms._checks import check_number

__all__ = ["KLController", "ConstantKLController", "AdaptiveKLController"]


class KLController:
    """Base class: holds ``beta`` (the KL coefficient) and the last KL it was fed."""

    def __init__(self, beta: float) -> None:
        self.beta = check_number("beta", beta, low=0.0, fix="Use beta=0.0 to turn the KL penalty off.")
        self.last_kl: float = float("nan")

    def update(self, kl: float, n_steps: int) -> float:
        """Feed the mean summed-per-sequence KL of a batch of ``n_steps`` sequences; return the new beta."""
        kl = check_number("kl", kl)
        if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 0:
            raise ValueError(f"n_steps must be an int >= 0 (sequences in the batch), got {n_steps!r}")
        self._update(kl, n_steps)
        self.last_kl = kl
        return self.beta

    def _update(self, kl: float, n_steps: int) -> None:
        """Subclasses adapt ``self.beta`` here."""

    def metrics(self) -> dict[str, float]:
        """``{"beta": ..., "kl": ...}`` (kl is NaN before the first update)."""
        return {"beta": self.beta, "kl": self.last_kl}

    def state_dict(self) -> dict:
        """The controller's state (beta and the last KL)."""
        return {"beta": self.beta, "last_kl": self.last_kl}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state from :meth:`state_dict`."""
        if not isinstance(state, dict) or "beta" not in state:
            raise KeyError(f"{type(self).__name__}.load_state_dict needs a dict with 'beta', got {state!r:.80}")
        self.beta = check_number("beta", state["beta"], low=0.0)
        self.last_kl = float(state.get("last_kl", float("nan")))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(beta={self.beta:.4g})"


class ConstantKLController(KLController):
    """A fixed KL coefficient; :meth:`update` only records the KL.

    Args:
        beta: the KL coefficient (>= 0).

    Example:
        >>> ctl = ConstantKLController(0.1)
        >>> ctl.update(kl=3.0, n_steps=8), ctl.metrics()
        (0.1, {'beta': 0.1, 'kl': 3.0})
    """


class AdaptiveKLController(KLController):
    """Adaptive KL coefficient (Ziegler et al. 2019): steers the KL toward ``target``.

    ``e = clip(KL / target - 1, -0.2, 0.2)`` and ``beta <- beta * (1 + e * min(n_steps / horizon, 1))``,
    where KL is the mean over sequences of summed per-token KL and ``n_steps`` the number of sequences.
    Ziegler et al. (and OpenRLHF, LightRFT) use ``n_steps / horizon`` uncapped; tokengym caps it at 1
    by default so that one batch larger than ``horizon`` moves beta by at most 20% and beta stays
    positive (uncapped, ``n_steps > 5 * horizon`` with a KL below target would make it <= 0).
    ``use_cap=False`` gives the uncapped formula, and raises ValueError on an update that would make
    beta <= 0.

    Args:
        beta: initial coefficient (> 0; a zero beta could never grow).
        target: target KL per sequence (> 0).
        horizon: number of sequences over which beta may change by about ``e`` (> 0).
        use_cap: cap ``n_steps / horizon`` at 1 (default); False for Ziegler et al.'s uncapped formula.

    Example:
        >>> ctl = AdaptiveKLController(0.1, target=6.0, horizon=10_000)
        >>> round(ctl.update(kl=12.0, n_steps=1000), 4)  # KL above target: beta grows by 2%
        0.102
        >>> round(ctl.update(kl=12.0, n_steps=20_000), 4)  # n_steps / horizon = 2, capped at 1: +20%
        0.1224
        >>> round(AdaptiveKLController(0.1, target=6.0, horizon=10_000, use_cap=False).update(12.0, 20_000), 4)
        0.14
    """

    def __init__(self, beta: float, *, target: float, horizon: int | float, use_cap: bool = True) -> None:
        super().__init__(beta)
        check_number("beta", beta, low=0.0, low_open=True,
                     fix="An adaptive controller multiplies beta, so it must start > 0.")  # fmt: skip
        self.target = check_number("target", target, low=0.0, low_open=True,
                                   fix="Use ConstantKLController for a fixed coefficient.")  # fmt: skip
        self.horizon = check_number("horizon", horizon, low=0.0, low_open=True,
                                    fix="Ziegler et al. use horizon=10000 (sequences).")  # fmt: skip
        if not isinstance(use_cap, bool):
            raise TypeError(f"use_cap must be a bool, got {type(use_cap).__name__} {use_cap!r}")
        self.use_cap = use_cap

    def _update(self, kl: float, n_steps: int) -> None:
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        fraction = n_steps / self.horizon
        factor = 1.0 + error * (min(fraction, 1.0) if self.use_cap else fraction)
        if factor <= 0.0:
            raise ValueError(
                f"AdaptiveKLController: n_steps / horizon = {n_steps} / {self.horizon} with KL error {error:.3g} "
                f"would make beta {self.beta * factor:.3g} <= 0 (uncapped formula); use use_cap=True or a larger "
                "horizon"
            )
        self.beta *= factor

    def state_dict(self) -> dict:
        """Beta, the last KL, target, horizon and use_cap."""
        return {**super().state_dict(), "target": self.target, "horizon": self.horizon, "use_cap": self.use_cap}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state from :meth:`state_dict`."""
        super().load_state_dict(state)
        self.target = check_number("target", state.get("target", self.target), low=0.0, low_open=True)
        self.horizon = check_number("horizon", state.get("horizon", self.horizon), low=0.0, low_open=True)
        self.use_cap = bool(state.get("use_cap", self.use_cap))

    def __repr__(self) -> str:
        return (f"AdaptiveKLController(beta={self.beta:.4g}, target={self.target}, horizon={self.horizon}, "
                f"use_cap={self.use_cap})")  # fmt: skip
