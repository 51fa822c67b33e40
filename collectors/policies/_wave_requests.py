"""What every wave backend asks of its engine and gets back, whatever the engine: per-request seeds, the sampling
checks that keep ``action_log_prob`` meaning the log-prob of the distribution sampled from, the budget check of a wave
and the :class:`~tokengym.llm_envs.waves.WaveResult` built from the token ids and log-probs an engine returns.

:class:`~tokengym.collectors.policies.WaveCore` uses these for every engine (vLLM in process, a fleet of vLLM or
SGLang servers), so a wave means the same on each.
"""

from __future__ import annotations

import itertools

import torch

from tokengym.collectors.policies.sampling import SamplingConfig
from tokengym.llm_envs.waves import WaveRequest, WaveResult

__all__ = ["SEED_STRIDE", "check_budgets", "check_greedy", "empty_result", "is_unmodified", "request_seeds",
           "wave_result"]  # fmt: skip

SEED_STRIDE = 1 << 32  # request seeds: policy seed * stride + request counter (distinct per request)
_SEED_RANGE = 1 << 63  # seeds stay within int64: a vLLM server refuses larger ones


def request_seeds(seed: int, first: int, n: int, *, greedy: bool) -> list[int | None]:
    """The seeds of requests ``first .. first + n - 1`` of a policy seeded with ``seed`` (``None`` when greedy),
    within int64.

    Example:
        >>> request_seeds(1, 5, 2, greedy=False) == [SEED_STRIDE + 5, SEED_STRIDE + 6]
        True
    """
    return [None if greedy else (seed * SEED_STRIDE + first + i) % _SEED_RANGE for i in range(n)]


def is_unmodified(s: SamplingConfig) -> bool:
    """True when the sampling leaves the model's distribution as it is (then processed == raw log-probs)."""
    return s.temperature == 1.0 and s.top_k == 0 and s.top_p == 1.0 and not s.banned_token_ids


def check_greedy(s: SamplingConfig) -> None:
    """vLLM's greedy path reports log-probs at temperature 1 over the whole vocabulary: refuse anything else."""
    if s.greedy and (s.temperature != 1.0 or s.top_k or s.top_p != 1.0):
        raise ValueError(
            f"vLLM's greedy decoding reports log-probs at temperature 1 over the whole vocabulary, so greedy with "
            f"temperature={s.temperature}, top_k={s.top_k}, top_p={s.top_p} would not mean what TransformersPolicy's "
            "action_log_prob means; use SamplingConfig(greedy=True) with temperature=1.0, top_k=0, top_p=1.0"
        )


def check_budgets(request: WaveRequest, max_model_len: int, *, where: str = "the engine") -> list[int]:
    """Each row's ``max_new_tokens`` (>= 1, prompt + budget within ``max_model_len``), as a list."""
    budgets = request.max_new_tokens.tolist()
    for i, (prompt, budget) in enumerate(zip(request.prompts, budgets, strict=True)):
        if budget < 1 or prompt.numel() + budget > max_model_len:
            slot = int(request.slots[i])
            raise ValueError(
                f"slot {slot}: a prompt of {prompt.numel()} tokens with {budget} new tokens does not fit {where}'s "
                f"max_model_len {max_model_len} (or the budget is < 1); build the env with max_length <= "
                f"{max_model_len} or {where} with a larger max_model_len"
            )
    return budgets


def empty_result(is_unmodified: bool, version: int) -> WaveResult:
    """The result of a wave with no rows."""
    empty = torch.zeros(0, 0)
    return WaveResult(
        empty.long(), torch.zeros(0, dtype=torch.int64), empty, empty if is_unmodified else None, version
    )


def wave_result(token_ids: list, log_probs: list, *, is_unmodified: bool, version: int,
                finished: list[bool] | None = None) -> WaveResult:  # fmt: skip
    """Rows of token ids and their log-probs (one per token) as a right-padded :class:`WaveResult`; ``finished``
    (one per row, ``None``: all): False for a row the engine stopped before its turn ended (an interrupt).

    Example:
        >>> r = wave_result([[5, 6], [7]], [[-0.5, -1.0], [-2.0]], is_unmodified=False, version=3)
        >>> r.actions.tolist(), r.lengths.tolist(), r.raw_log_probs, r.version
        ([[5, 6], [7, 0]], [2, 1], None, 3)
    """
    for ids, lps in zip(token_ids, log_probs, strict=True):
        if lps is None or len(lps) != len(ids):
            raise RuntimeError("the engine returned no log-prob per sampled token; the dialect asks for one per "
                               "token (was its log-prob field changed?)")
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64)
    n, T = len(token_ids), max(int(lengths.max()), 1)
    mask = torch.arange(T) < lengths[:, None]  # (n, T)
    actions = torch.zeros(n, T, dtype=torch.int64)
    actions[mask] = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.int64)
    out = torch.zeros(n, T)
    out[mask] = torch.tensor(list(itertools.chain.from_iterable(log_probs)), dtype=torch.float32)
    done = None if finished is None or all(finished) else torch.tensor(finished, dtype=torch.bool)
    return WaveResult(actions, lengths, out, out if is_unmodified else None, version, finished=done)
