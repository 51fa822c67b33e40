"""SequenceActor: the policy as TorchRL losses see it, scoring whole trajectories in one teacher-forced forward.

Both actors score with the sampling settings the batch records (its PromptTable's, written by the collector
from the policy's ``SamplingConfig``): the temperature divides the logits and banned tokens get probability 0,
so on the first on-policy step the ratio against ``action_log_prob`` is 1. A ``temperature`` passed to an actor
that differs from the batch's, or a batch sampled with top-k / top-p, raises a ``ValueError`` naming the fix.

Devices: the model runs where it is (the inputs go to its input embedding's device). What a loss reads (``forward``,
``get_dist``: logits over the vocabulary) is computed for a batch on the model's device; a host batch with a model on
an accelerator raises a ``ValueError`` naming the fix (``batch.to(device)``, ``train(..., device=)``). ``log_prob``
takes a batch on any device and answers on the batch's device (what ``MismatchCorrection`` compares).

Vision-language models (Qwen2-VL): a batch whose PromptTable holds images is scored with them, each forward with the
images of the rows it holds (a micro-batch's own) and their M-RoPE position ids
(``tokengym.transforms.image_rows.forward_inputs``); with a text-only model it raises a ``ValueError``.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

from tokengym.collectors.policies.sampling import SamplingConfig, batch_sampling, processed_logits
from tokengym.llm_envs import keys
from tokengym.llm_envs.devices import check_same_device, input_device
from tokengym.transforms.image_rows import forward_inputs, padded_row_images
from tokengym.transforms.sequences import SequenceLayout, sequence_layout
from tokengym.transforms.token_log_probs import TokenScorer, final_hidden_states

__all__ = ["ChunkedCategorical", "MaskedCategorical", "PaddedSequenceActor", "SequenceActor"]

_TEMPERATURE_MISMATCH = (
    "{owner}(temperature={mine}) scores the batch at temperature {mine}, but its policy sampled it at temperature "
    "{theirs} (recorded in the batch's PromptTable): the PPO ratio against action_log_prob would not be 1 on-policy. "
    "Pass temperature={theirs}, or leave temperature=None to take the batch's"
)
_FILTERED = (
    "{owner} scores a batch with its temperature and banned tokens, but the batch was sampled with top_k={top_k}, "
    "top_p={top_p}: a sampled token outside the trainer's top-k / top-p set would get log-prob -inf. Sample with "
    "SamplingConfig(top_k=0, top_p=1.0) for training, or pass use_unfiltered=True to score without the filter (the "
    "ratio is then not 1 on-policy: correct the gap with tokengym.transforms.MismatchCorrection)"
)


def _check_chunking(chunk_size: int | None, full_logits: bool) -> None:
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int (positions whose logits are held at once) or None (about "
                         f"128 MiB of float32 logits per chunk), got {chunk_size!r}")  # fmt: skip
    if not isinstance(full_logits, bool):
        raise TypeError(f"full_logits must be a bool, got {type(full_logits).__name__} {full_logits!r}")


def _check_temperature(temperature: float | None) -> None:
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, int | float)
                                    or not temperature > 0):  # fmt: skip
        raise ValueError(f"temperature must be > 0 (the sampling temperature) or None (the batch's), got {temperature!r}")


def _scoring(owner: str, temperature: float | None, use_unfiltered: bool, tensordict: TensorDictBase) -> SamplingConfig:
    """The settings an actor scores ``tensordict`` with: the batch's temperature and banned tokens (a batch that records
    none: ``temperature`` or 1.0), or a ``ValueError`` on a mismatch."""
    recorded = batch_sampling(tensordict)
    if recorded is None:
        return SamplingConfig(temperature=1.0 if temperature is None else float(temperature))
    if temperature is not None and float(temperature) != recorded.temperature:
        raise ValueError(_TEMPERATURE_MISMATCH.format(owner=owner, mine=temperature, theirs=recorded.temperature))
    if (recorded.top_k or recorded.top_p < 1.0) and not use_unfiltered:
        raise ValueError(_FILTERED.format(owner=owner, top_k=recorded.top_k, top_p=recorded.top_p))
    return SamplingConfig(temperature=recorded.temperature, banned_token_ids=recorded.banned_token_ids)


class SequenceActor(TensorDictModuleBase):
    """Gives ``ClipPPOLoss`` (and friends) the current policy's distribution over every collected step.

    Reads a TRAJECTORIES batch (N, T) and its prompt table (``keys.PROMPTS``), runs the model once
    on left-padded prompt + response (N, P + T), and returns a categorical distribution over the
    vocabulary per step (kept as hidden states, scored a chunk of positions at a time: :class:`ChunkedCategorical`);
    no step ever copies its context. It scores with the batch's sampling settings
    (module docstring), so the ratio against ``action_log_prob`` is a real importance ratio. A padding
    step (``keys.MASK`` False) is a point mass on its recorded action (log-prob 0, what the collector records
    there): ratio 1, no gradient, no entropy, whatever mask the loss applies.

    Args:
        model: the transformers causal LM being trained.
        pad_token_id: id used to pad prompts and responses; ``None`` takes the batch's PromptTable's (the
            env tokenizer's, recorded by the collector) and raises a ``ValueError`` when it records none.
        temperature: the sampling temperature; ``None`` (default) takes the batch's (1.0 for a batch that
            records none). One that differs from the batch's raises a ``ValueError``.
        use_unfiltered: score a batch sampled with top-k / top-p without the filter instead of refusing it.
        chunk_size: positions whose logits ``get_dist`` and ``log_prob`` hold at once (:class:`ChunkedCategorical`);
            None: about 128 MiB of float32 logits (512 MiB on a GPU).
        full_logits: build the whole (N, T, V) float32 logits instead (the path before chunking; for comparison).

    Example:
        >>> from tokengym.testing import make_trajectory_batch, tiny_model, tiny_tokenizer
        >>> batch = make_trajectory_batch([3, 1])  # its PromptTable records no sampling settings
        >>> actor = SequenceActor(tiny_model(tiny_tokenizer()))
        >>> lp = actor.log_prob(batch)
        >>> lp.shape, lp[1, 1:].tolist()  # padding steps: a point mass on their action
        (torch.Size([2, 3]), [0.0, 0.0])
    """

    in_keys = [keys.ACTION, keys.GROUP_ID, keys.TRAJ_ID, keys.MASK, keys.PROMPTS]
    out_keys = [keys.LOGITS]

    def __init__(self, model, *, pad_token_id: int | None = None, temperature: float | None = None,
                 use_unfiltered: bool = False, chunk_size: int | None = None, full_logits: bool = False) -> None:  # fmt: skip
        super().__init__()
        _check_temperature(temperature)
        _check_chunking(chunk_size, full_logits)
        self.model, self.pad_token_id, self.temperature = model, pad_token_id, temperature
        self.use_unfiltered, self.chunk_size, self.full_logits = bool(use_unfiltered), chunk_size, full_logits

    def scoring(self, tensordict: TensorDictBase) -> SamplingConfig:
        """The sampling settings this actor scores ``tensordict`` with (temperature and banned tokens)."""
        return _scoring(type(self).__name__, self.temperature, self.use_unfiltered, tensordict)

    def logits(self, tensordict: TensorDictBase) -> torch.Tensor:
        """Logits (N, T, V) of each step's token distribution, the batch's sampling settings applied."""
        config = self.scoring(tensordict)
        layout = sequence_layout(tensordict, pad_id=self.pad_token_id)
        out = self.model(**self._inputs(layout), use_cache=False)
        device = out.logits.device  # the model's output device
        # step t is predicted at the column before its token (multi-turn: feedback sits in between)
        columns = layout.columns.to(device)
        index = (columns - 1)[..., None].expand(*columns.shape, out.logits.shape[-1])
        logits = processed_logits(out.logits.gather(1, index).float(), config, in_place=True)  # (N, T, V) float32
        mask = tensordict.get(keys.MASK, None)
        if mask is not None and not bool(mask.all()):  # padding: a point mass on the recorded action
            pad = ~mask.reshape(logits.shape[:-1]).bool().to(device)
            logits = logits.masked_fill(pad[..., None], -float("inf"))
            rows, cols = pad.nonzero(as_tuple=True)
            logits[rows, cols, tensordict.get(keys.ACTION).to(device)[rows, cols]] = 0.0
        return logits

    def _inputs(self, layout: SequenceLayout) -> dict[str, torch.Tensor]:
        """The model's inputs for the rows of ``layout`` (their images and M-RoPE positions for a vision model)."""
        return forward_inputs(self.model, layout.tokens, layout.attention_mask, layout.images,
                              owner=type(self).__name__)  # fmt: skip

    def _loss_logits(self, tensordict: TensorDictBase) -> torch.Tensor:
        """:meth:`logits` for a loss: on the batch's device, which must be the model's (no host copy of (N, T, V))."""
        home = tensordict.get(keys.ACTION).device
        check_same_device(type(self).__name__, home, input_device(self.model))
        return self.logits(tensordict).to(home)

    def chunked_dist(self, tensordict: TensorDictBase) -> ChunkedCategorical | None:
        """The per-step distribution (N, T) kept as the model's last hidden states, scored in chunks of
        ``chunk_size`` positions (see :class:`ChunkedCategorical`); None for ``full_logits`` or a model that does not
        expose its decoder and output layer. On the model's output device."""
        if self.full_logits:
            return None
        config = self.scoring(tensordict)
        layout = sequence_layout(tensordict, pad_id=self.pad_token_id)
        split = final_hidden_states(self.model, **self._inputs(layout))
        if split is None:
            return None
        hidden, head, softcap = split  # (N, P + T, H)
        columns = layout.columns.to(hidden.device)
        # step t is predicted at the column before its token; padding steps are scored by no row (a point mass)
        rows = torch.arange(columns.shape[0], device=hidden.device)[:, None] * hidden.shape[1] + columns - 1
        mask = tensordict.get(keys.MASK, None)
        valid = torch.ones_like(rows, dtype=torch.bool) if mask is None else mask.reshape(rows.shape).to(hidden.device)
        scorer = TokenScorer(hidden.flatten(0, 1), head, temperature=config.temperature, softcap=softcap,
                             banned=config.banned_ids(hidden.device), chunk_size=self.chunk_size)  # fmt: skip
        return ChunkedCategorical(scorer, torch.where(valid, rows, -1), valid)

    def log_prob(self, tensordict: TensorDictBase) -> torch.Tensor:
        """Log-prob (N, T) of each step's action under the model (0 on padding): the trainer's log-probs that
        :class:`~tokengym.transforms.MismatchCorrection` compares with the sampler's (call it under ``torch.no_grad()``)."""
        action = tensordict.get(keys.ACTION)
        dist = self.chunked_dist(tensordict)
        if dist is not None:
            return dist.log_prob(action.to(dist.index.device)).to(action.device)
        logits = self.logits(tensordict)
        return logits.log_softmax(-1).gather(-1, action.to(logits.device)[..., None]).squeeze(-1).to(action.device)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Writes ``keys.LOGITS`` (N, T, V) float32: the whole logits (a loss's ``get_dist`` does not build them)."""
        tensordict.set(keys.LOGITS, self._loss_logits(tensordict))
        return tensordict

    def get_dist(self, tensordict: TensorDictBase) -> torch.distributions.Categorical:
        """The per-step distribution (what ``ClipPPOLoss`` calls): a :class:`ChunkedCategorical` that never holds
        (N, T, V) logits, or with ``full_logits`` (or a model without a separate output layer) a ``Categorical``."""
        home = tensordict.get(keys.ACTION).device
        check_same_device(type(self).__name__, home, input_device(self.model))
        dist = self.chunked_dist(tensordict)
        return dist if dist is not None else torch.distributions.Categorical(logits=self._loss_logits(tensordict))


class MaskedCategorical(torch.distributions.Categorical):
    """A categorical over every column of a padded layout, with the boolean loss mask TorchRL's LLM losses read."""

    def __init__(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        super().__init__(logits=logits, validate_args=False)
        self.mask = mask


class ChunkedCategorical(MaskedCategorical):
    """A categorical per column of an (N, L) layout kept as the model's last hidden states: ``log_prob`` and
    ``entropy`` apply the output layer to the scored columns only, a chunk at a time, in float32, each chunk
    recomputed in backward (:class:`~tokengym.transforms.TokenScorer`), so no (N, L, V) tensor is built. A column that
    no hidden row scores (``index`` -1: a prompt token, padding) has log-prob 0 and entropy 0, a point mass; the
    losses' masks leave those columns out. Each of ``log_prob`` and ``entropy`` runs the output layer over the scored
    columns once (an entropy bonus costs a second pass); ``logits`` is refused (build the actor with
    ``full_logits=True`` for a distribution that holds them).

    Args:
        scorer: the hidden states and output layer.
        index: int64 (N, L): the hidden row that scores each column, -1 for none.
        mask: bool (N, L): the loss mask TorchRL's LLM losses read (``keys.ACTION_MASK``).
    """

    def __init__(self, scorer: TokenScorer, index: torch.Tensor, mask: torch.Tensor) -> None:
        torch.distributions.Distribution.__init__(self, index.shape, validate_args=False)  # no (N, L, V) logits
        self.scorer, self.index, self.mask = scorer, index, mask
        self.has = index >= 0
        self.rows = index[self.has]
        self._num_events = getattr(scorer.head, "out_features", None) or scorer.head.weight.shape[0]

    def _per_column(self, scored: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.index.shape, dtype=torch.float32, device=self.index.device)
        out[self.has] = scored.to(out.device)
        return out

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        return self._per_column(self.scorer.log_probs(self.rows, value.to(self.index.device)[self.has].long()))

    def entropy(self) -> torch.Tensor:
        return self._per_column(self.scorer.entropies(self.rows))

    @property
    def logits(self) -> torch.Tensor:  # (N, L, V): what the chunks avoid
        raise NotImplementedError(
            "ChunkedCategorical keeps no (N, L, V) logits (that is its point): read log_prob(tokens) / entropy(), or "
            "build the actor with full_logits=True for a distribution that holds them"
        )


class PaddedSequenceActor(TensorDictModuleBase):
    """The policy as ``torchrl.objectives.llm.GRPOLoss`` sees it, on the padded layout of
    :func:`~tokengym.transforms.to_padded` (``keys.TOKENS`` = ``("tokens", "full")``).

    ``get_dist`` returns a distribution over the whole (N, L) sequence whose column ``j`` scores
    token ``j`` and whose ``mask`` is ``keys.ACTION_MASK`` (the generated tokens), so ``GRPOLoss``
    runs on ``to_padded(batch)`` with its default keys. It holds the model's last hidden states and applies the
    output layer to the generated columns a chunk at a time (:class:`ChunkedCategorical`): memory grows with the
    tokens, never with (N, L, V). It scores with the sampling settings the layout's
    PromptTable records (``to_padded`` keeps it), as :class:`SequenceActor` does.

    Args:
        model: the transformers causal LM being trained.
        temperature: the sampling temperature; ``None`` (default) takes the batch's (1.0 if it records none).
        use_unfiltered: score a batch sampled with top-k / top-p without the filter instead of refusing it.
        chunk_size: generated positions whose logits ``get_dist`` and ``log_prob`` hold at once
            (:class:`ChunkedCategorical`); None: about 128 MiB of float32 logits (512 MiB on a GPU).
        full_logits: build the whole (N, L, V) float32 logits instead (the path before chunking; for comparison).

    Example:
        >>> from torchrl.objectives.llm import GRPOLoss
        >>> from tokengym.testing import make_trajectory_batch, tiny_model, tiny_tokenizer
        >>> from tokengym.transforms import GroupAdvantage, to_padded
        >>> model = tiny_model(tiny_tokenizer())
        >>> batch = GroupAdvantage("grpo")(make_trajectory_batch([3, 2, 4, 1], group_size=2))
        >>> out = GRPOLoss(PaddedSequenceActor(model), entropy_bonus=False)(to_padded(batch))
        >>> out.loss_objective.shape
        torch.Size([])
    """

    in_keys = [keys.TOKENS, keys.ATTENTION_MASK, keys.ACTION_MASK, keys.POSITION_IDS, keys.PROMPTS]
    out_keys = [keys.LOGITS]

    def __init__(self, model, *, temperature: float | None = None, use_unfiltered: bool = False,
                 chunk_size: int | None = None, full_logits: bool = False) -> None:  # fmt: skip
        super().__init__()
        _check_temperature(temperature)
        _check_chunking(chunk_size, full_logits)
        self.model, self.temperature, self.use_unfiltered = model, temperature, bool(use_unfiltered)
        self.chunk_size, self.full_logits = chunk_size, full_logits

    def scoring(self, tensordict: TensorDictBase) -> SamplingConfig:
        """The sampling settings this actor scores ``tensordict`` with (temperature and banned tokens)."""
        return _scoring(type(self).__name__, self.temperature, self.use_unfiltered, tensordict)

    def _inputs(self, tensordict: TensorDictBase) -> dict[str, torch.Tensor]:
        """The model's inputs for the rows of the padded layout: its position ids, or for rows with images (a
        vision-language model) their images and M-RoPE positions."""
        return forward_inputs(self.model, tensordict.get(keys.TOKENS), tensordict.get(keys.ATTENTION_MASK),
                              padded_row_images(tensordict, type(self).__name__),
                              position_ids=tensordict.get(keys.POSITION_IDS), owner=type(self).__name__)  # fmt: skip

    def _logits(self, tensordict: TensorDictBase) -> torch.Tensor:
        """Logits (N, L, V) where column ``j`` scores token ``j``, on the model's output device."""
        config = self.scoring(tensordict)
        out = self.model(**self._inputs(tensordict), use_cache=False)
        # the logits at column j-1 predict token j: shifted right so that column j scores token j, into one float32
        # (N, L, V) tensor (the dtype cast in the same copy: no float32 copy of the model's logits beside it)
        shifted = out.logits.new_zeros(out.logits.shape, dtype=torch.float32)
        shifted[:, 1:] = out.logits[:, :-1]
        return processed_logits(shifted, config, in_place=True)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        home = tensordict.get(keys.TOKENS).device
        check_same_device(type(self).__name__, home, input_device(self.model))
        tensordict.set(keys.LOGITS, self._logits(tensordict).to(home))
        return tensordict

    def chunked_dist(self, tensordict: TensorDictBase) -> ChunkedCategorical | None:
        """The distribution over the generated columns kept as the model's last hidden states, scored in chunks of
        ``chunk_size`` positions (:class:`ChunkedCategorical`); None for ``full_logits`` or a model that does not
        expose its decoder and output layer. On the model's output device."""
        if self.full_logits:
            return None
        config = self.scoring(tensordict)
        split = final_hidden_states(self.model, **self._inputs(tensordict))
        if split is None:
            return None
        hidden, head, softcap = split  # (N, L, H)
        generated = tensordict.get(keys.ACTION_MASK).to(hidden.device)
        n, width = generated.shape
        # column j is scored from the hidden state at j - 1 (column 0 has none)
        rows = torch.arange(n * width, device=hidden.device).reshape(n, width) - 1
        scored = generated.clone()
        scored[:, 0] = False
        scorer = TokenScorer(hidden.flatten(0, 1), head, temperature=config.temperature, softcap=softcap,
                             banned=config.banned_ids(hidden.device), chunk_size=self.chunk_size)  # fmt: skip
        return ChunkedCategorical(scorer, torch.where(scored, rows, -1), generated)

    def log_prob(self, tensordict: TensorDictBase) -> torch.Tensor:
        """Log-prob (N, L) of each generated token (0 where ``keys.ACTION_MASK`` is False): the trainer's log-probs
        that :class:`~tokengym.transforms.MismatchCorrection` compares with the sampler's (call it under ``torch.no_grad()``).
        On the batch's device, from a batch on any device."""
        tokens, generated = tensordict.get(keys.TOKENS), tensordict.get(keys.ACTION_MASK)
        dist = self.chunked_dist(tensordict)
        if dist is not None:
            lp = dist.log_prob(tokens.to(dist.index.device)).to(tokens.device)
        else:
            logits = self._logits(tensordict)
            lp = logits.log_softmax(-1).gather(-1, tokens.to(logits.device)[..., None]).squeeze(-1).to(tokens.device)
        return torch.where(generated, lp, torch.zeros_like(lp))

    def get_dist(self, tensordict: TensorDictBase, logits_key=keys.LOGITS) -> MaskedCategorical:
        """The distribution ``GRPOLoss`` reads: a :class:`ChunkedCategorical` (no (N, L, V) logits), or with
        ``full_logits`` (or a model without a separate output layer) a :class:`MaskedCategorical` over ``logits_key``."""
        check_same_device(type(self).__name__, tensordict.get(keys.TOKENS).device, input_device(self.model))
        dist = self.chunked_dist(tensordict)
        if dist is not None:
            return dist
        td = self(tensordict.copy())
        return MaskedCategorical(td.get(logits_key), td.get(keys.ACTION_MASK))
