"""Model answers a verifier raised on: they score 0, are counted (``reward_errors`` in the metrics) and logged once."""

from __future__ import annotations

import logging

__all__ = ["REWARD_ERRORS", "RewardErrors"]

REWARD_ERRORS = "reward_errors"  # the count of model answers a verifier raised on (they score 0)
_log = logging.getLogger("tokengym.rewards")


class RewardErrors:
    """Counts model answers a verifier raised on (they score 0) and logs the first one per name.

    A model's output is never bad input (DESIGN.md "Bad input"): :attr:`counts` (``{"reward_errors": n}``)
    reaches the collector's metrics through ``env.prompt_counts``.
    """

    def __init__(self) -> None:
        self.counts = {REWARD_ERRORS: 0}
        self.warned: set[str] = set()

    def record(self, name: str, answer: str, err: Exception) -> None:
        """Count ``answer``, which made verifier ``name`` raise ``err``; warn the first time for ``name``."""
        self.counts[REWARD_ERRORS] += 1
        if name in self.warned:
            return
        self.warned.add(name)
        _log.warning(
            "%s: the verifier raised %s: %.200s on the answer %.200r; such answers score 0 and are counted in "
            "the metrics as %r (only the first of %s is logged)",
            name, type(err).__name__, err, answer, REWARD_ERRORS, name,
        )  # fmt: skip
