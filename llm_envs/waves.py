"""Whole-wave generation: what an env asks a generation backend for, and what the backend returns.

A wave continues every live slot of a :class:`~tokengym.llm_envs.TokenEnv` until its turn ends.
The env builds a :class:`WaveRequest` (:meth:`TokenEnv.wave_request`), a backend (``model.generate``,
vLLM...) answers with a :class:`WaveResult`, and :meth:`TokenEnv.unroll` turns the result into the
same token-level steps that stepping one token at a time gives: the env alone decides termination
and rewards, whatever the backend stopped on.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["WaveRequest", "WaveResult"]


@dataclasses.dataclass(frozen=True)
class WaveRequest:
    """The sequences a wave continues.

    Attributes:
        slots: int64 (n,) env slots in this wave (the live ones).
        prompts: n 1-D int64 tensors: each slot's full token history so far (prompt, earlier turns and
            env feedback), the context the backend continues. Not re-tokenized anywhere.
        max_new_tokens: int64 (n,) tokens each slot may still add (response budget and context left).
        eos_token_ids: ids that end a turn.
        stop_strings: strings that end a turn.
        min_finished: the backend may stop the wave once this many rows have ended their turn (an end id or their
            budget) and return the others unfinished (``WaveResult.finished``): long tails go on in the next wave
            instead of holding the finished slots idle (``CollectorOptions(over_sampling=True)``); ``None``: every
            row runs to its turn's end.
    """

    slots: torch.Tensor
    prompts: list[torch.Tensor]
    max_new_tokens: torch.Tensor
    eos_token_ids: tuple[int, ...]
    stop_strings: tuple[str, ...] = ()
    min_finished: int | None = None

    def __len__(self) -> int:
        return len(self.prompts)


@dataclasses.dataclass(frozen=True)
class WaveResult:
    """Tokens a backend generated for a :class:`WaveRequest`, row ``i`` for ``request.prompts[i]``.

    A backend interrupted mid-wave (a weight update published while it generated: partial rollouts) marks the
    rows it did not finish: the env writes their tokens and keeps their slots open, and the next wave continues
    each from its tokens so far (the env still ends a row's turn on an end id, a stop string or a budget it holds).

    Attributes:
        actions: int64 (n, T) generated ids; entries at or past ``lengths[i]`` are ignored.
        lengths: int64 (n,) tokens generated per row (>= 1 for every finished row; >= 0 for an unfinished one).
        log_probs: float32 (n, T) log-prob of each token under the distribution it was sampled from
            (``keys.ACTION_LOG_PROB``).
        raw_log_probs: float32 (n, T) log-prob under the unmodified model (``keys.RAW_LOG_PROB``), or
            ``None`` when the backend does not give it.
        version: policy version the wave was generated under.
        finished: bool (n,): False where the backend stopped the row before its turn ended (interrupted);
            ``None``: every row finished its turn.
        versions: int64 (n, T) the policy version of each token (``keys.POLICY_VERSION``), for a backend whose
            weights changed inside the wave; ``None``: every token has ``version``.
    """

    actions: torch.Tensor
    lengths: torch.Tensor
    log_probs: torch.Tensor
    raw_log_probs: torch.Tensor | None = None
    version: int = 0
    finished: torch.Tensor | None = None
    versions: torch.Tensor | None = None
