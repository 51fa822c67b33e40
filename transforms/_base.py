"""The base of the batch transforms: a torchrl Transform that also processes a collected batch."""

from __future__ import annotations

from tensordict import TensorDictBase
from torchrl.envs import Transform

from tokengym.transforms._checks import check_batch


class BatchTransform(Transform):
    """A ``torchrl.envs.Transform`` whose ``forward``/``__call__`` processes a collected ``[N, T]`` batch.

    Use an instance as a collector ``postproc`` or call it on a batch. Subclasses list the keys they
    read in ``in_keys``, write in ``out_keys``, and implement :meth:`transform_batch`. Inside a
    ``TransformedEnv`` a batch transform leaves steps unchanged unless it overrides ``_step``.
    """

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Check the batch holds ``in_keys`` and apply the transform in place; return it."""
        check_batch(tensordict, type(self).__name__, self.in_keys)
        return self.transform_batch(tensordict)

    def transform_batch(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Apply the transform to a checked ``[N, T]`` batch (in place) and return it; subclasses implement it."""
        raise NotImplementedError

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        return next_tensordict

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        return tensordict_reset
