"""SharedPrefixActor: :class:`PaddedSequenceActor`'s distributions from one forward over the prefix-shared layout.

The padded layout holds a GRPO group's prompt in each of its G rows; this actor reads the same padded TensorDict but
runs the model once over :func:`~tokengym.transforms.to_shared_prefix` (each shared prefix once, a 4-D block attention
mask) and answers in the padded (N, L) shape, so ``GRPOLoss``, ``ClipPPOLoss`` and ``WeightedLoss`` train on
``to_padded(batch)`` with their default keys, as with ``PaddedSequenceActor``. Its distribution
(``PackedCategorical``) normalizes the logits of the packed positions only and gathers log-probs and entropies
to (N, L): the vocabulary-sized work and memory follow the shared layout's tokens, not N * L. The reference's
log-probs on the same layout: ``SharedPrefixActor(ref_model).log_prob(padded)`` under ``torch.no_grad()``.

The block mask is dense: the masked blocks are still computed (SDPA with a boolean mask, eager attention with an
additive one), so attention costs ``M * S**2`` for ``M`` packs of ``S`` tokens against the padded layout's
``N * L**2``; the token-wise work (projections, MLPs, the output layer) is what sharing saves in full.

A batch with images (a vision-language model's) is refused: the packed layout carries no images or M-RoPE positions;
``PaddedSequenceActor`` scores it.
"""

from __future__ import annotations

import functools
import math

import torch
from tensordict import TensorDictBase

from tokengym.collectors.policies.sampling import processed_logits
from tokengym.collectors.policies.sequence_actor import (
    ChunkedCategorical,
    MaskedCategorical,
    PaddedSequenceActor,
)
from tokengym.llm_envs import keys
from tokengym.llm_envs.devices import check_same_device, input_device
from tokengym.transforms.image_rows import batch_has_images
from tokengym.transforms.shared_prefix import SharedPrefixLayout, to_shared_prefix
from tokengym.transforms.token_log_probs import TokenScorer, final_hidden_states

__all__ = ["PackedCategorical", "SharedPrefixActor"]

_BLOCK_MASK_ATTENTION = ("sdpa", "eager")  # attention implementations taking a 4-D mask (bool; additive float)
_IMAGES = ("{owner} packs the batch into one prefix-shared layout, which carries no images (pixel values, M-RoPE "
           "positions), but the batch's prompts have images: train it on the padded layout with "
           "PaddedSequenceActor(model) on to_padded(batch)")  # fmt: skip


class SharedPrefixActor(PaddedSequenceActor):
    """The policy as ``GRPOLoss`` / ``ClipPPOLoss`` see it on a padded layout, computed on the prefix-shared layout.

    Takes what :class:`~tokengym.collectors.policies.PaddedSequenceActor` takes (the padded layout of
    :func:`~tokengym.transforms.to_padded`) and gives what it gives (``get_dist``: a
    :class:`~tokengym.collectors.policies.MaskedCategorical` over (N, L, V) whose column ``j`` scores token ``j``,
    masked by ``keys.ACTION_MASK``, kept packed; ``forward``: ``keys.LOGITS`` (N, L, V); ``log_prob``: (N, L)), to
    float tolerance, from one forward over :func:`~tokengym.transforms.to_shared_prefix`. Columns with no token before
    them (a row's first token, padding) hold logits 0, a uniform distribution (``PaddedSequenceActor`` holds what the
    model computed at the padding there): the losses' masks leave them out, but a loss's unmasked diagnostics
    (``GRPOLoss``'s logged ``entropy``) differ there. Same sampling settings (the batch's) and device rules as
    ``PaddedSequenceActor``. :meth:`hidden_states` gives a value head its inputs from the same forward.

    The model's attention must take a 4-D mask: ``"sdpa"`` (a boolean mask) or ``"eager"`` (an additive one), read
    from ``model.config._attn_implementation``; set it with ``model.set_attn_implementation("sdpa")``.

    Args:
        model: the transformers causal LM being trained (or the reference, for its log-probs).
        temperature: the sampling temperature; ``None`` (default) takes the batch's (1.0 if it records none).
        use_unfiltered: score a batch sampled with top-k / top-p without the filter instead of refusing it.
        min_shared: rows sharing this many first tokens share a pack; ``None`` (default): rows sharing their prompt
            (see :func:`~tokengym.transforms.to_shared_prefix`).
        chunk_size: generated positions whose logits ``get_dist`` and ``log_prob`` hold at once
            (:class:`~tokengym.collectors.policies.ChunkedCategorical`); None: about 128 MiB of float32 logits.
        full_logits: keep the packed positions' whole logits (``PackedCategorical``: the path before chunking).

    Example:
        >>> from torchrl.objectives.llm import GRPOLoss
        >>> from tokengym.testing import make_trajectory_batch, tiny_model, tiny_tokenizer
        >>> from tokengym.transforms import GroupAdvantage, to_padded
        >>> model = tiny_model(tiny_tokenizer())
        >>> padded = to_padded(GroupAdvantage("grpo")(make_trajectory_batch([3, 2, 4, 1], group_size=2)))
        >>> out = GRPOLoss(SharedPrefixActor(model), entropy_bonus=False)(padded)
        >>> out.loss_objective.shape
        torch.Size([])
        >>> with torch.no_grad():  # the padded layout's log-probs, each group's prompt computed once
        ...     diff = SharedPrefixActor(model).log_prob(padded) - PaddedSequenceActor(model).log_prob(padded)
        >>> bool(diff.abs().max() < 1e-5)
        True
    """

    def __init__(self, model, *, temperature: float | None = None, use_unfiltered: bool = False,
                 min_shared: int | None = None, chunk_size: int | None = None, full_logits: bool = False) -> None:  # fmt: skip
        super().__init__(model, temperature=temperature, use_unfiltered=use_unfiltered, chunk_size=chunk_size,
                         full_logits=full_logits)  # fmt: skip
        self.min_shared = min_shared

    def layout(self, tensordict: TensorDictBase) -> SharedPrefixLayout:
        """The prefix-shared layout this actor runs ``tensordict`` on.

        Raises:
            ValueError: a batch whose prompts have images (score it with ``PaddedSequenceActor``).
        """
        if batch_has_images(tensordict):
            raise ValueError(_IMAGES.format(owner=type(self).__name__))
        return to_shared_prefix(tensordict, min_shared=self.min_shared)

    def mask_dtype(self) -> torch.dtype:
        """The block mask's dtype for the model's attention: bool (SDPA) or the model's float dtype (eager)."""
        implementation = getattr(self.model.config, "_attn_implementation", None) or "eager"
        if implementation not in _BLOCK_MASK_ATTENTION:
            raise ValueError(f"{type(self).__name__} gives the model a 4-D block attention mask, which its "
                             f"{implementation!r} attention does not take; call model.set_attn_implementation('sdpa') "
                             "(or 'eager'), or train on the padded layout with PaddedSequenceActor")  # fmt: skip
        return torch.bool if implementation == "sdpa" else getattr(self.model, "dtype", torch.float32)

    def _packed(self, tensordict: TensorDictBase, **kwargs):
        """The model's output on the shared layout of ``tensordict``, and the layout on the model's output device."""
        device = input_device(self.model)
        layout = self.layout(tensordict).to(device)
        out = self.model(input_ids=layout.tokens, attention_mask=layout.attention_mask(self.mask_dtype()),
                         position_ids=layout.position_ids, use_cache=False, **kwargs)  # fmt: skip
        return out, layout.to(out.logits.device)

    def packed_logits(self, tensordict: TensorDictBase) -> tuple[torch.Tensor, SharedPrefixLayout]:
        """The logits (M * S, V) float32 of every packed position, the batch's sampling settings applied, and the
        layout (flat packed indices), on the model's output device."""
        config = self.scoring(tensordict)
        out, layout = self._packed(tensordict)
        flat = out.logits.flatten(0, 1)
        return processed_logits(flat.float(), config, in_place=flat.dtype != torch.float32), layout

    def padded_logits(self, tensordict: TensorDictBase) -> torch.Tensor:
        """Logits (N, L, V) float32 where column ``j`` scores token ``j`` (0 where no token precedes it), the batch's
        sampling settings applied; on the model's output device."""
        logits, layout = self.packed_logits(tensordict)
        return _scatter(logits, layout.predictor)

    def hidden_states(self, tensordict: TensorDictBase) -> torch.Tensor:
        """The last hidden states (N, L, H) float32 in which each padded column's token is chosen (the state a value
        head reads: the one the logits of column ``j`` come from; 0 where no token precedes it), from the same one
        forward over the shared layout; on the model's output device."""
        out, layout = self._packed(tensordict, output_hidden_states=True)
        return _scatter(out.hidden_states[-1].flatten(0, 1), layout.predictor)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        home = tensordict.get(keys.TOKENS).device
        check_same_device(type(self).__name__, home, input_device(self.model))
        tensordict.set(keys.LOGITS, self.padded_logits(tensordict).to(home))
        return tensordict

    def chunked_dist(self, tensordict: TensorDictBase) -> ChunkedCategorical | None:
        """The distribution over the generated columns kept as the last hidden states of the shared layout's packed
        positions, scored in chunks (:class:`~tokengym.collectors.policies.ChunkedCategorical`); None for
        ``full_logits`` or a model that does not expose its decoder and output layer. On the model's output device."""
        if self.full_logits:
            return None
        config = self.scoring(tensordict)
        device = input_device(self.model)
        layout = self.layout(tensordict).to(device)
        split = final_hidden_states(self.model, input_ids=layout.tokens, position_ids=layout.position_ids,
                                    attention_mask=layout.attention_mask(self.mask_dtype()))  # fmt: skip
        if split is None:
            return None
        hidden, head, softcap = split  # (M, S, H)
        generated = tensordict.get(keys.ACTION_MASK).to(hidden.device)
        predictor = layout.predictor.to(hidden.device)
        scorer = TokenScorer(hidden.flatten(0, 1), head, temperature=config.temperature, softcap=softcap,
                             banned=config.banned_ids(hidden.device), chunk_size=self.chunk_size)  # fmt: skip
        return ChunkedCategorical(scorer, torch.where(generated, predictor, -1), generated)

    def get_dist(self, tensordict: TensorDictBase, logits_key=keys.LOGITS) -> MaskedCategorical:
        """The distribution over (N, L, V) a loss reads: a ``ChunkedCategorical`` (no vocabulary-sized tensor beyond one
        chunk), or with ``full_logits`` a ``PackedCategorical`` (``logits_key`` is not read: nothing is written)."""
        check_same_device(type(self).__name__, tensordict.get(keys.TOKENS).device, input_device(self.model))
        dist = self.chunked_dist(tensordict)
        if dist is not None:
            return dist
        logits, layout = self.packed_logits(tensordict)
        return PackedCategorical(logits, layout.predictor, tensordict.get(keys.ACTION_MASK).to(logits.device))

    def log_prob(self, tensordict: TensorDictBase) -> torch.Tensor:
        """Log-prob (N, L) of each generated token (0 where ``keys.ACTION_MASK`` is False), as
        ``PaddedSequenceActor.log_prob`` gives it; on the batch's device, from a batch on any device. With the reference
        model: the reference log-probs on the shared layout (call it under ``torch.no_grad()``)."""
        tokens, generated = tensordict.get(keys.TOKENS), tensordict.get(keys.ACTION_MASK)
        dist = self.chunked_dist(tensordict)
        if dist is None:
            logits, layout = self.packed_logits(tensordict)
            dist = PackedCategorical(logits, layout.predictor, generated.to(logits.device))
        lp = dist.log_prob(tokens.to(dist.index.device)).to(tokens.device)
        return torch.where(generated, lp, torch.zeros_like(lp))


class PackedCategorical(MaskedCategorical):
    """A :class:`MaskedCategorical` over (N, L, V) kept packed: the normalized logits (T, V) of the packed positions
    and, per padded column, the packed index that scores it (-1: uniform). ``log_prob`` and ``entropy`` work on the
    packed rows and gather (N, L) values, so the vocabulary-sized work and memory are the shared layout's T rows, not
    N * L; ``logits`` and ``probs`` build the (N, L, V) tensors only when read."""

    def __init__(self, logits: torch.Tensor, index: torch.Tensor, mask: torch.Tensor) -> None:
        torch.distributions.Distribution.__init__(self, index.shape, validate_args=False)  # no (N, L, V) logits
        self.packed, self.index, self.mask = logits.log_softmax(-1), index, mask
        self.has = index >= 0
        self._num_events = logits.shape[-1]
        self.uniform = -math.log(logits.shape[-1])

    def _per_column(self, packed_values: torch.Tensor, uniform: float) -> torch.Tensor:
        return torch.where(self.has, packed_values, uniform)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        picked = self.packed[self.index.clamp(min=0), value.long().clamp(min=0)]
        return self._per_column(picked, self.uniform)

    def entropy(self) -> torch.Tensor:
        p_log_p = self.packed.clamp(min=torch.finfo(self.packed.dtype).min) * self.packed.exp()
        return self._per_column(-p_log_p.sum(-1)[self.index.clamp(min=0)], -self.uniform)

    @functools.cached_property
    def logits(self) -> torch.Tensor:
        return _scatter(self.packed, self.index).masked_fill_(~self.has[..., None], self.uniform)


def _scatter(flat: torch.Tensor, predictor: torch.Tensor) -> torch.Tensor:
    """(N, L, D) float32: the rows of ``flat`` (M * S, D) at each padded column's flat packed index, 0 where it is -1."""
    has = predictor >= 0
    out = flat.new_zeros((*predictor.shape, flat.shape[-1]), dtype=torch.float32)
    out[has] = flat[predictor[has]].float()
    return out
