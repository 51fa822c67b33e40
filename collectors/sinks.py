"""Where collected batches go: a TorchRL replay buffer (checked before it is written) or a queue."""

from __future__ import annotations

from tensordict import TensorDictBase

__all__ = ["check_extend", "check_sink", "extend_checked", "write_to_sink"]


def _layout(td: TensorDictBase, lead: int) -> dict:
    """Leaf key -> (dtype, shape without the ``lead`` leading dims); non-tensor leaves (prompt tables) left out."""
    out = {}
    for key, value in td.items(include_nested=True, leaves_only=True):
        shape = getattr(value, "shape", None)
        if shape is not None and hasattr(value, "dtype"):
            out[key] = (value.dtype, tuple(shape[lead:]))
    return out


def check_extend(buffer, batch: TensorDictBase) -> None:
    """Raise ``ValueError`` if ``batch`` cannot go into ``buffer``'s tensor storage as it is, before anything is
    written (TorchRL's own error comes from inside tensordict after the write cursor has moved, leaving rows of
    zeros in the buffer). Buffers with a ``ListStorage``, or still empty, take anything.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(8))
        >>> rb.extend(TensorDict({"a": torch.zeros(2, 3)}, [2, 3]))
        tensor([0, 1])
        >>> try:
        ...     extend_checked(rb, TensorDict({"a": torch.zeros(2, 5)}, [2, 5]))
        ... except ValueError as err:
        ...     print(str(err)[:97], len(rb))
        this batch does not fit the replay buffer's storage: 'a': float32 (5,) in the batch, float32 (3,) 2
    """
    from torchrl.data.replay_buffers.storages import TensorStorage

    storage = getattr(buffer, "storage", None)
    if not isinstance(storage, TensorStorage) or len(buffer) == 0:
        return
    ndim = getattr(storage, "ndim", 1)
    stored = storage.get(0)  # one stored element: its keys, dtypes and shapes
    have = _layout(stored, max(ndim - 1, 0)) if isinstance(stored, TensorDictBase) else None
    if have is None:
        return
    want = _layout(batch, ndim)
    problems = []
    for key in sorted(set(have) | set(want), key=str):
        a, b = want.get(key), have.get(key)
        if a != b:
            seen = "missing" if a is None else f"{str(a[0]).removeprefix('torch.')} {a[1]}"
            expected = "missing" if b is None else f"{str(b[0]).removeprefix('torch.')} {b[1]}"
            name = key if isinstance(key, str) else tuple(key)
            problems.append(f"{name!r}: {seen} in the batch, {expected} in the storage")
    if problems:
        raise ValueError(
            "this batch does not fit the replay buffer's storage: " + "; ".join(problems[:4])
            + ("; ..." if len(problems) > 4 else "")
            + " (nothing was written). TRAJECTORIES batches are max_new_tokens wide by default "
            "(CollectorOptions(is_fixed_width=True)); keep it, or use a ListStorage for batches of varying width"
        )


def extend_checked(buffer, batch: TensorDictBase):
    """``buffer.extend(batch)`` after :func:`check_extend`: a batch that does not fit leaves the buffer as it was."""
    check_extend(buffer, batch)
    return buffer.extend(batch)


def check_sink(sink) -> None:
    """Raise ``TypeError`` unless ``sink`` is ``None``, a replay buffer (``extend``) or a queue (``put``)."""
    if sink is not None and not (hasattr(sink, "extend") or hasattr(sink, "put")):
        raise TypeError(f"sink must be a ReplayBuffer (extend) or a queue (put), got {type(sink).__name__}")


def write_to_sink(sink, batch: TensorDictBase) -> None:
    """Put ``batch`` into a replay buffer (``extend``, checked first) or a queue (``put``)."""
    if hasattr(sink, "extend"):
        extend_checked(sink, batch)
    else:
        sink.put(batch)
