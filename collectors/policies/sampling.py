"""Token sampling: temperature, top-k, top-p, greedy, banned tokens; seeded and shared by every decode path.

Large vocabularies (more than ``_ONE_LEVEL_MAX`` tokens) with the common RL configuration (temperature,
maybe banned tokens, no top-k / top-p / greedy) take a path that reads the logits for a max and for one
``exp(x - max)`` into a reused buffer, then sums blocks of it: the draw is an exact inverse CDF in two
levels (a block of tokens by its mass, then a token inside it), so no float64 cumulative sum over the
whole vocabulary is built, banned tokens get weight 0 (the logits are never copied), and the chosen
token's log-prob comes from the same normalizer (closer to a float64 log-softmax than a float32 one).
Small vocabularies use one fused log-softmax and a float64 inverse CDF: there the per-op overhead, not
the arithmetic, is the cost.
"""

from __future__ import annotations

import dataclasses
import threading

import torch
from tensordict import TensorDictBase

from tokengym.llm_envs import keys

__all__ = ["SamplingConfig", "batch_sampling", "processed_logits", "sample_tokens"]

_BLOCK = 256
"""Tokens per block of the two-level draw; vocabularies up to ``_ONE_LEVEL_MAX`` use one level."""
_ONE_LEVEL_MAX = 8192
_BELOW_ONE = 1.0 - 2.0**-53  # the largest float64 below 1, as torch.rand draws: u * total < total for it


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen.

    ``action_log_prob`` is the log-prob of the chosen token under the distribution actually
    sampled from (after temperature, top-k, top-p and banned tokens). For ``greedy`` decoding that
    distribution is a point mass, which is useless in an importance ratio, so greedy reports the
    log-prob under the temperature-scaled, filtered distribution instead. ``raw_log_prob`` is always
    the log-prob under the unmodified model (temperature 1, no filtering).
    """

    temperature: float = 1.0
    """Divides the logits; must be > 0."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p; 1.0 keeps all."""
    greedy: bool = False
    """Take the most likely token instead of sampling."""
    banned_token_ids: tuple[int, ...] = ()
    """Tokens never chosen (e.g. EOS, to force fixed-length responses in benchmarks)."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}; use greedy=True for argmax decoding")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 keeps all tokens), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        ids = tuple(int(i) for i in self.banned_token_ids)
        if any(i < 0 for i in ids):
            raise ValueError(f"banned_token_ids must be token ids >= 0, got {min(ids)}")
        object.__setattr__(self, "banned_token_ids", ids)
        # not a field: one id tensor per device, built once instead of from the tuple every step
        object.__setattr__(self, "_banned_tensors", {})

    @property
    def is_filtered(self) -> bool:
        """True when top-k, top-p or greedy decoding reshape the distribution (the slower, general path)."""
        return self.greedy or self.top_k > 0 or self.top_p < 1.0

    def banned_ids(self, device: torch.device) -> torch.Tensor | None:
        """The banned ids as an int64 tensor on ``device`` (cached), or ``None`` when nothing is banned."""
        if not self.banned_token_ids:
            return None
        cache = self._banned_tensors  # type: ignore[attr-defined]
        if device not in cache:
            cache[device] = torch.tensor(self.banned_token_ids, dtype=torch.int64, device=device)
        return cache[device]


def batch_sampling(tensordict: TensorDictBase) -> SamplingConfig | None:
    """The sampling settings recorded with a collected batch (its PromptTable's, ``keys.PROMPTS``), or ``None``
    when it records none; a ``ValueError`` when the rows of a stacked batch record different settings.

    Example:
        >>> from tensordict import TensorDict
        >>> from tokengym.llm_envs import PromptTable
        >>> td = TensorDict({}, [2, 3])
        >>> td = td.set_non_tensor(keys.PROMPTS, PromptTable(pad_token_id=0, sampling=SamplingConfig(temperature=0.7)))
        >>> batch_sampling(td).temperature, batch_sampling(TensorDict({}, [2, 3]))
        (0.7, None)
    """
    try:
        tables = tensordict.get_non_tensor(keys.PROMPTS)
    except KeyError:
        return None
    records, stack = [], [tables]
    while stack:  # a batch stacked or sampled from a replay buffer holds one table per stored batch
        item = stack.pop()
        if isinstance(item, list | tuple):
            stack.extend(item)
        elif getattr(item, "sampling", None) is not None and item.sampling not in records:
            records.append(item.sampling)
    if len(records) > 1:
        raise ValueError(f"the batch mixes rows sampled with different settings {records}; score the rows of "
                         "each setting apart")  # fmt: skip
    return SamplingConfig(**records[0]) if records else None


def processed_logits(logits: torch.Tensor, config: SamplingConfig, *, in_place: bool = False) -> torch.Tensor:
    """The logits (..., V) of the distribution ``config`` samples from, whose log-softmax gives the log-probs the
    policies write as ``action_log_prob``: divided by the temperature, banned tokens and top-k / top-p at -inf.

    Differentiable (the sequence actors train through it); a new float32 tensor, or with ``in_place`` (float32
    logits the caller gave up: a training forward's (N, L, V) copy) the temperature divides them in place, one
    vocabulary-sized copy fewer.

    Example:
        >>> x = processed_logits(torch.tensor([[0.0, 2.0, 1.0]]), SamplingConfig(temperature=0.5, banned_token_ids=(2,)))
        >>> x.tolist()
        [[0.0, 4.0, -inf]]
    """
    if in_place and logits.dtype == torch.float32:
        x = logits if config.temperature == 1.0 else logits.div_(config.temperature)
    else:
        x = logits.float() / config.temperature  # a new tensor: the caller's logits stay as they are
    banned = config.banned_ids(x.device)
    if banned is None and not config.is_filtered:
        return x
    return _filter(x, config, banned)


def _filter(x: torch.Tensor, config: SamplingConfig, banned: torch.Tensor | None) -> torch.Tensor:
    """Banned tokens, top-k and top-p applied to temperature-scaled logits (..., V); returns a new tensor."""
    x = x.index_fill(-1, banned, -float("inf")) if banned is not None else x.clone()
    if 0 < config.top_k < x.shape[-1]:
        kth = x.topk(config.top_k, dim=-1).values[..., -1:]  # (B, 1)
        x.masked_fill_(x < kth, -float("inf"))
    if config.top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)  # (B, V)
        probs = sorted_x.softmax(-1)
        # drop a token once the mass before it already reaches top_p (the top token always stays)
        drop_sorted = probs.cumsum(-1) - probs >= config.top_p
        x.masked_fill_(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), -float("inf"))
    return x


def _uniforms(x: torch.Tensor, generator: torch.Generator | None, drawn: torch.Tensor | None) -> torch.Tensor:
    """One float64 uniform (B, 1) per row: ``drawn`` when given (a copy: the draw scales it in place), else from
    ``generator``."""
    if drawn is not None:
        return drawn.clone()
    return torch.rand(x.shape[0], 1, dtype=torch.float64, generator=generator, device=x.device)


def _draw_small(
    x: torch.Tensor, generator: torch.Generator | None, drawn: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact inverse-CDF draw (B, 1) from logits (B, V) of a small vocabulary, and the log-probs (B, V).

    Few, fused ops: the per-op overhead, not the arithmetic, is the cost at this size. One float64
    uniform per row; the CDF is accumulated in float64 so ``u * total < total`` holds strictly and
    ``right=True`` skips zero-probability tokens (their intervals are empty).
    """
    logp = x.log_softmax(-1)  # (B, V)
    cdf = logp.exp().double().cumsum(-1)
    u = _uniforms(x, generator, drawn)
    return torch.searchsorted(cdf, u.mul_(cdf[:, -1:]), right=True).clamp_(max=x.shape[-1] - 1), logp


_SCRATCH = threading.local()


def _scratch(like: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A (B, V') float buffer reused across calls of this thread: a fresh one per step is a large
    allocation, which glibc maps and page-faults anew each time (10-20% of a step at a 151k vocabulary)."""
    if like.is_cuda and torch.cuda.is_current_stream_capturing():
        # a CUDA graph being captured: a buffer of the graph's own pool (a shared one could be replaced and freed
        # while the graph still writes it)
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    buf = getattr(_SCRATCH, "weights", None)
    if buf is None or buf.shape != shape or buf.dtype != like.dtype or buf.device != like.device:
        # an ordinary tensor even when first drawn under torch.inference_mode(): an inference tensor would refuse
        # the in-place writes of a later draw outside it (a policy after a user's inference-mode loop)
        with torch.inference_mode(False):
            buf = _SCRATCH.weights = torch.empty(shape, dtype=like.dtype, device=like.device)
    return buf


def _draw_large(
    x: torch.Tensor, m: torch.Tensor, banned: torch.Tensor | None, generator: torch.Generator | None,
    drawn: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact two-level inverse-CDF draw (B, 1) from logits (B, V) with row max ``m`` (B, 1); returns it and
    ``log(sum(exp(x - m)))`` (B, 1) over the allowed tokens.

    The weights ``exp(x - m)`` (banned ones 0) are split into blocks of ``_BLOCK`` tokens; one float64
    uniform per row picks a block by its mass (float64 cumsum over the block sums), then a token inside
    it (float64 cumsum over the block), so the float64 work is O(V / _BLOCK + _BLOCK) per row.
    """
    B, V = x.shape
    weights = _scratch(x, (B, -(-V // _BLOCK) * _BLOCK))  # right-padded with zero weights
    torch.sub(x, m, out=weights[:, :V]).exp_()
    weights[:, V:].zero_()
    if banned is not None:
        weights.index_fill_(-1, banned, 0.0)
    blocks = weights.view(B, -1, _BLOCK)  # (B, V' / block, block)
    sums = blocks.sum(-1).double()  # (B, V' / block)
    cdf = torch.cat([sums.new_zeros(B, 1), sums.cumsum_(-1)], 1)  # leading 0: cdf[b] is the mass before b
    total = cdf[:, -1:]
    target = _uniforms(x, generator, drawn).mul_(total)
    b = torch.searchsorted(cdf, target, right=True).sub_(1).clamp_(max=cdf.shape[1] - 2)  # (B, 1)
    lo, hi = cdf.gather(1, b), cdf.gather(1, b + 1)
    inner = blocks.gather(1, b[:, :, None].expand(-1, 1, _BLOCK)).squeeze(1).double().cumsum_(-1)  # (B, block)
    # the same uniform, rescaled into the block's own float64 cumsum (its rounding differs from the block
    # sum); kept below 1 so the target stays strictly below the block total and never hits a zero weight
    target = ((target - lo) / (hi - lo)).clamp_(max=_BELOW_ONE).mul_(inner[:, -1:])
    j = torch.searchsorted(inner, target, right=True).clamp_(max=_BLOCK - 1)
    return b * _BLOCK + j, total.log()


def sample_tokens(
    logits: torch.Tensor,
    config: SamplingConfig,
    generator: torch.Generator | None,
    *,
    with_raw_log_prob: bool = True,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Choose one token per row of ``logits`` (B, V).

    Args:
        logits: next-token logits (B, V); never modified.
        config: the :class:`SamplingConfig`.
        generator: the seeded generator every draw comes from (one float64 uniform per row), on the logits'
            device (:func:`~tokengym.llm_envs.devices.seeded_generator`).
        with_raw_log_prob: also compute the log-prob under the unmodified model; ``False`` returns
            ``None`` in its place and saves a pass over the vocabulary when a filter or a temperature is set.
        uniforms: the float64 uniforms (B, 1) of this draw, drawn beforehand (``uniforms.uniform_(generator=...)``
            draws what ``torch.rand`` would: a captured decode step draws them outside its graph); default: drawn
            here from ``generator``.

    Returns:
        ``(action, action_log_prob, raw_log_prob)``, each of shape (B,) (``raw_log_prob`` may be ``None``).

    Example:
        >>> logits = torch.tensor([[0.0, 5.0, 1.0]])
        >>> a, lp, raw = sample_tokens(logits, SamplingConfig(greedy=True), None)
        >>> a.tolist(), round(lp.item(), 3) == round(raw.item(), 3)
        ([1], True)
        >>> a, lp, raw = sample_tokens(logits, SamplingConfig(banned_token_ids=(1,)), torch.Generator().manual_seed(0))
        >>> a.item() != 1, torch.allclose(lp, torch.tensor([0.0, -float("inf"), 1.0]).log_softmax(-1)[a])
        (True, True)
    """
    if generator is not None and generator.device.type != logits.device.type:
        raise ValueError(f"sample_tokens: the generator is on {generator.device} but the logits are on {logits.device}; "
                         "draw with a generator on the logits' device: "
                         "tokengym.llm_envs.devices.seeded_generator(logits.device, seed)")  # fmt: skip
    raw_logits = logits.float()  # (B, V) float32 whatever the model's dtype: log-probs are float32
    x = raw_logits if config.temperature == 1.0 else raw_logits / config.temperature  # (B, V)
    banned = config.banned_ids(x.device)
    banned_x = None
    is_large = x.shape[-1] > _ONE_LEVEL_MAX
    if config.is_filtered or (banned is not None and not is_large):
        x = _filter(x, config, banned)  # a copy with banned / filtered tokens at -inf (cheap at small V)
    elif banned is not None:
        banned_x = x.index_select(-1, banned)  # (B, n): large V bans in weight space, no copy of the logits
    if config.greedy:
        action = x.argmax(-1, keepdim=True)  # (B, 1)
        logp = x.gather(-1, action) - x.logsumexp(-1, keepdim=True)
    elif is_large:
        m = _max_allowed(x, banned, banned_x)  # (B, 1)
        action, log_total = _draw_large(x, m, None if banned_x is None else banned, generator, uniforms)
        lse = m + log_total.float()
        logp = x.gather(-1, action) - lse
    else:
        action, logp_all = _draw_small(x, generator, uniforms)
        logp = logp_all.gather(-1, action)
    action, logp = action.squeeze(-1), logp.squeeze(-1)
    if not with_raw_log_prob:
        return action, logp, None
    if x is raw_logits:  # temperature 1, no filter
        if banned_x is None:  # nothing reshaped the distribution: the raw log-prob is the same number
            return action, logp, logp.clone()
        # only bans, large V: add the banned tokens' mass back to the normalizer
        return action, logp, logp + lse.squeeze(-1) - torch.logaddexp(lse.squeeze(-1), banned_x.logsumexp(-1))
    raw = raw_logits.gather(-1, action[:, None]).squeeze(-1) - raw_logits.logsumexp(-1)
    return action, logp, raw


def _max_allowed(x: torch.Tensor, banned: torch.Tensor | None, banned_x: torch.Tensor | None) -> torch.Tensor:
    """Max (B, 1) of each row over the tokens that may be drawn, so the largest weight is exactly 1.

    ``banned_x`` holds the banned logits (B, n); only rows whose max is a banned token (rare) are
    recomputed on a masked copy (on the CPU; an accelerator takes every row's masked max rather than wait for a
    host read of which rows need it).
    """
    m = x.amax(-1, keepdim=True)
    if banned_x is None:
        return m
    if x.device.type != "cpu":  # no host read on an accelerator: the masked max of every row, one pass
        return x.index_fill(-1, banned, -float("inf")).amax(-1, keepdim=True)
    hit = (banned_x.amax(-1, keepdim=True) >= m).squeeze(-1)
    if bool(hit.any()):
        m = m.clone()
        m[hit] = x[hit].index_fill(-1, banned, -float("inf")).amax(-1, keepdim=True)
    return m
