"""The images of a batch's rows in a vision-language model's teacher-forced forward.

A Qwen2-VL forward over rows takes every row's images concatenated in row order (the vision features fill the image
tokens in row-major order) and multimodal position ids (3, N, L): each row's M-RoPE positions computed from its real
tokens (:func:`~tokengym.llm_envs.mrope_positions`) and placed where its attention mask is 1, 0 on padding. A row's
images are its trajectory's as the PromptTable records them (``trajectory_images``: its prompt's, then those its
multi-turn feedback showed; a later turn or a split episode's later part keeps them). The actors, :func:`~tokengym.transforms.sequence_log_probs` and the KL transform build them per forward from the rows
they are given, so a micro-batch's forward holds its own rows' images only.

A batch with images and a text-only model is refused (it would score the image tokens without the images), and so
are image tokens given to a vision-language model without their images.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDictBase

from tokengym.llm_envs import keys
from tokengym.llm_envs.devices import input_device
from tokengym.llm_envs.image_inputs import ImageInputs
from tokengym.llm_envs.prompt_table import PromptTable
from tokengym.llm_envs.vision import is_vision_model, mrope_positions
from tokengym.transforms._checks import get_prompts, require

__all__ = ["batch_has_images", "forward_inputs", "padded_row_images", "row_images"]

_TEXT_ONLY = ("{owner}: the batch's prompts have images (its PromptTable holds them) but the model {name} is text "
              "only, so it would score the image tokens without the images: score a batch with images with a "
              "vision-language model (Qwen2-VL, Qwen2.5-VL: the policy's, and as the KL reference too), or collect "
              "it without images")  # fmt: skip
_MISSING = ("{owner}: row {row} holds image tokens but no images were given for it, so {name} would score them without "
            "the images: pass each row's images (images=[table.images(group) for each row], or a batch whose "
            "PromptTable holds them)")  # fmt: skip


def row_images(table: PromptTable, groups: torch.Tensor, trajs: torch.Tensor) -> list[ImageInputs | None] | None:
    """Each row's images (its trajectory's, ``PromptTable.trajectory_images``: ``None`` for a row without), or
    ``None`` when ``table`` holds no images at all.

    Args:
        table: the batch's PromptTable.
        groups: int64 (N,) each row's group id.
        trajs: int64 (N,) each row's trajectory id.

    Example:
        >>> row_images(PromptTable(), torch.tensor([0, 1]), torch.tensor([0, 1])) is None
        True
    """
    if not table.has_images:
        return None
    pairs = zip(trajs.reshape(-1).tolist(), groups.reshape(-1).tolist(), strict=True)
    return [table.trajectory_images(t, g) for t, g in pairs]


def _table(td: TensorDictBase) -> PromptTable | None:
    try:
        return get_prompts(td, None, "image_rows")
    except KeyError:  # a layout without a PromptTable: no images to give
        return None


def batch_has_images(td: TensorDictBase) -> bool:
    """Whether the PromptTable ``td`` carries (``keys.PROMPTS``) holds images."""
    table = _table(td)
    return table is not None and table.has_images


def padded_row_images(padded: TensorDictBase, owner: str) -> list[ImageInputs | None] | None:
    """Each row's images in a padded layout (:func:`~tokengym.transforms.to_padded`, or a micro-batch's rows of one):
    its trajectory's (:func:`row_images`; ``keys.GROUP_ID`` and ``keys.TRAJ_ID`` read at its first generated column);
    ``None`` when its PromptTable holds no images.

    Raises:
        ValueError: a row with no generated token to read its ids from.
    """
    table = _table(padded)
    if table is None or not table.has_images:
        return None
    generated = require(padded, keys.ACTION_MASK, owner).reshape(padded.batch_size).bool()
    if not bool(generated.any(-1).all()):
        row = int((~generated.any(-1)).nonzero()[0])
        raise ValueError(f"{owner}: row {row} of the padded layout has no generated token, so its trajectory (and "
                         "its images) is unknown: drop rows without a response before to_padded")  # fmt: skip
    first = generated.int().argmax(-1)[:, None]  # the first generated column of each row: its step ids are there
    group, traj = (require(padded, key, owner).reshape(padded.batch_size).gather(1, first).squeeze(1)
                   for key in (keys.GROUP_ID, keys.TRAJ_ID))  # fmt: skip
    return row_images(table, group, traj)


def _row_positions(ids: torch.Tensor, images: ImageInputs | None, image_token_id: int, merge_size: int) -> torch.Tensor:
    """M-RoPE positions (3, n) of one unpadded row: :func:`mrope_positions` up to its last image token, the text after
    it counted on from there (what ``mrope_positions`` of the whole row gives, without walking the response)."""
    where = (ids == image_token_id).nonzero()
    end = int(where[-1]) + 1 if len(where) else 0
    grid = None if images is None else images.image_grid_thw
    head, delta = mrope_positions(ids[:end], grid, image_token_id=image_token_id, merge_size=merge_size)
    tail = torch.arange(end + delta, ids.numel() + delta).expand(3, -1)
    return torch.cat([head, tail], 1)


def _mrope_rows(model, tokens: torch.Tensor, real: torch.Tensor, images: Sequence[ImageInputs | None],
                owner: str) -> torch.Tensor:  # fmt: skip
    """Position ids (3, N, L) on the host: each row's M-RoPE positions where ``real``, 0 on padding."""
    config = model.config
    image_id, merge = int(config.image_token_id), int(config.vision_config.spatial_merge_size)
    text = (real.long().cumsum(-1) - 1).clamp(min=0) * real  # text rows: positions count the real tokens
    out = text.expand(3, -1, -1).clone()
    has_tokens = ((tokens == image_id) & real).any(-1).tolist()
    for row, (held, has) in enumerate(zip(images, has_tokens, strict=True)):
        if held is None and not has:
            continue
        try:
            out[:, row, real[row]] = _row_positions(tokens[row][real[row]], held, image_id, merge)
        except ValueError as err:
            raise ValueError(f"{owner}: row {row}'s tokens do not match the images of its prompt ({err})") from err
    return out


def forward_inputs(model, tokens: torch.Tensor, attention_mask: torch.Tensor,
                   images: Sequence[ImageInputs | None] | None = None, *, position_ids: torch.Tensor | None = None,
                   owner: str = "forward_inputs") -> dict[str, torch.Tensor]:  # fmt: skip
    """The keyword arguments of one forward of ``model`` over rows of token ids, on its input device.

    ``input_ids``, ``attention_mask`` (int64) and ``position_ids``: ``position_ids`` if given, else counted over the
    real tokens (left padding scores like none); for a vision-language model with images, the rows' M-RoPE positions
    (3, N, L) and ``pixel_values`` / ``image_grid_thw`` of the rows' images in row order.

    Args:
        model: a transformers causal LM, text-only or vision-language (Qwen2-VL, Qwen2.5-VL).
        tokens: int64 (N, L) token ids.
        attention_mask: bool or int (N, L), False/0 on padding.
        images: each row's images (``None`` for a row without), or ``None`` when the batch has none
            (:func:`row_images`).
        position_ids: int64 (N, L) position ids of text rows (ignored where rows have images).
        owner: who asks (named in errors).

    Raises:
        ValueError: images for a text-only model; a row's image tokens that its images do not match (or no images
            for a row with image tokens).

    Example:
        >>> from tokengym.testing import tiny_model, tiny_tokenizer
        >>> inputs = forward_inputs(tiny_model(tiny_tokenizer()), torch.tensor([[0, 5, 6]]), torch.tensor([[0, 1, 1]]))
        >>> sorted(inputs), inputs["position_ids"].tolist()
        (['attention_mask', 'input_ids', 'position_ids'], [[0, 0, 1]])
    """
    if images is not None and not is_vision_model(model):
        raise ValueError(_TEXT_ONLY.format(owner=owner, name=type(model).__name__))
    if images is not None and len(images) != tokens.shape[0]:
        raise ValueError(f"{owner}: {len(images)} rows of images for {tokens.shape[0]} rows of tokens")
    device = input_device(model)
    held = [x for x in images if x is not None] if images is not None else []
    extra: dict[str, torch.Tensor] = {}
    if is_vision_model(model):
        real, host = attention_mask.cpu().bool(), tokens.cpu()
        if not held:  # image tokens without images would be scored as text: a wrong answer, refused
            image_rows = ((host == int(model.config.image_token_id)) & real).any(-1)
            if bool(image_rows.any()):
                raise ValueError(_MISSING.format(owner=owner, row=int(image_rows.nonzero()[0]),
                                                 name=type(model).__name__))  # fmt: skip
        else:
            position_ids = _mrope_rows(model, host, real, images, owner)
            # ImageInputs.cat's tensors, without hashing every pixel again for a digest nobody reads here
            extra = dict(pixel_values=torch.cat([x.pixel_values for x in held]).to(device),
                         image_grid_thw=torch.cat([x.image_grid_thw for x in held]).to(device))  # fmt: skip
    attention_mask = attention_mask.to(device).long()
    if position_ids is None:
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return dict(input_ids=tokens.to(device), attention_mask=attention_mask, position_ids=position_ids.to(device),
                **extra)  # fmt: skip
