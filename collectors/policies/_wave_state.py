"""What a wave policy checkpoints, written once for every wave backend: its seed and the requests it has sent.

Request ``i`` of a policy seeded with ``seed`` samples with ``request_seeds(seed, i)``, so a run is reproducible
and a resumed run draws what the uninterrupted one would have. A wave's requests are counted once the wave has
come back (a failed wave is sent again with the same seeds). Engines' and servers' prefix caches are caches:
they are not saved. :class:`~tokengym.collectors.policies.VLLMPolicy` and :class:`~tokengym.collectors.policies.VLLMServerPolicy`
each hold one :class:`RequestSeeds`.
"""

from __future__ import annotations

from tokengym.collectors.policies._wave_requests import request_seeds

__all__ = ["RequestSeeds"]


class RequestSeeds:
    """The per-request sampling seeds of a wave policy, and their part of its collection state.

    Args:
        seed: the policy's seed (an int >= 0).

    Example:
        >>> seeds = RequestSeeds(1)
        >>> seeds.next(2, greedy=False) == request_seeds(1, 0, 2, greedy=False)
        True
        >>> seeds.advance(2); seeds.collection_state(version=3)
        {'seed': 1, 'requests': 2, 'version': 3}
    """

    def __init__(self, seed: int) -> None:
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        self.seed, self.requests = seed, 0

    def next(self, n: int, *, greedy: bool) -> list[int | None]:
        """Seeds of the next ``n`` requests (``None`` when greedy); :meth:`advance` counts them once sent."""
        return request_seeds(self.seed, self.requests, n, greedy=greedy)

    def advance(self, n: int) -> None:
        """Count ``n`` requests that came back."""
        self.requests += n

    def reseed(self, seed: int) -> None:
        """Restart the request seeds from ``seed`` (the policy's ``set_seed``)."""
        self.seed, self.requests = int(seed), 0

    def collection_state(self, *, version: int) -> dict:
        """Seed, request counter and the policy's ``version``: a wave policy's whole collection state."""
        return {"seed": self.seed, "requests": self.requests, "version": int(version)}

    def load_collection_state(self, state: dict) -> int:
        """Restore :meth:`collection_state`; returns the version to give the policy back."""
        self.seed, self.requests = int(state["seed"]), int(state["requests"])
        return int(state["version"])
