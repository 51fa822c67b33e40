"""The iterator every collector hands out: an exception ends one ``next()`` only."""

from __future__ import annotations

from collections.abc import Callable

from tensordict import TensorDictBase

__all__ = ["BatchIterator"]


class BatchIterator:
    """The iterator of a collector: each ``next()`` is one call of ``next_batch``.

    Not a generator: a generator ends at its first exception, so a :class:`~tokengym.llm_envs.PromptError`
    (or a reward function's error) caught around ``next(it)`` would leave ``it`` exhausted. Here an exception
    ends that one call; the next ``next(it)`` goes on from what the collector had recorded. ``next_batch``
    returning ``None`` ends the iteration (budget or prompts exhausted).

    Args:
        next_batch: the collector's next batch, or ``None`` when it is done.
        has_sink: the collector writes its batches to a sink: ``next()`` gives ``None`` for each.
        on_batch: called after each batch (a progress bar, say).
        on_end: called once when ``next_batch`` gives ``None``.

    Example:
        >>> batches = iter([1, 2])
        >>> it = BatchIterator(lambda: next(batches, None))
        >>> list(it), next(it, "done")
        ([1, 2], 'done')
    """

    def __init__(self, next_batch: Callable[[], TensorDictBase | None], *, has_sink: bool = False,
                 on_batch: Callable[[], None] | None = None, on_end: Callable[[], None] | None = None) -> None:  # fmt: skip
        self.next_batch, self.has_sink, self.on_batch, self.on_end = next_batch, has_sink, on_batch, on_end
        self.is_done = False
        # the last batch stays referenced while the next one is collected (as a generator's frame kept it):
        # freed first, its memory goes back to the OS and the next wave's tensors fault it in again (measured:
        # the wave ceiling's unroll took 2x as long at B=256, T=1024)
        self.previous: TensorDictBase | None = None

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> TensorDictBase | None:
        if self.is_done:
            raise StopIteration
        batch = self.next_batch()  # an exception ends this call only: the collector keeps what it recorded
        if batch is None:
            self.is_done, self.previous = True, None
            if self.on_end is not None:
                self.on_end()
            raise StopIteration
        self.previous = batch
        if self.on_batch is not None:
            self.on_batch()
        return None if self.has_sink else batch
