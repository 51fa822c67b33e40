"""What the partial-rollout benchmarks share (imported by name: benchmarks/conftest.py puts this folder on sys.path):
the contestants and the weights a trainer that takes no time publishes after each batch."""

from __future__ import annotations

import torch

CONTESTANTS = {  # name -> (partial_rollouts, in_flight, publish)
    "partial rollouts": (True, "continue", True),
    "interrupted, in_flight='drop'": (True, "drop", True),
    "update at the wave's end": (False, "continue", True),
    "no updates": (True, "continue", False),
}


def moved_weights(model, step: int) -> dict:
    """``model``'s weights moved a little (seeded by ``step``): what the trainer publishes after batch ``step``."""
    gen = torch.Generator().manual_seed(step)
    return {k: v + torch.randn(v.shape, generator=gen) * 1e-3 if v.is_floating_point() else v
            for k, v in model.state_dict().items()}  # fmt: skip
