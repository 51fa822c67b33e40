"""What a token-level env needs to know about a vision-language model: which ids are its vision tokens, and the
multimodal rotary positions (Qwen2-VL's M-RoPE) of a sequence of text and images.

Qwen2-VL gives each token three positions (time, height, width). A text token's three are equal and count up by one;
an image's tokens sit on the image's grid (the same time, their row and column), starting after the text before it;
the text after an image starts one past the largest position used. So a sequence with images ends at a position
smaller than its length, by the sequence's *rope delta* (negative): a token generated later at length ``n`` has the
position ``n + delta`` in all three sections. :func:`mrope_positions` computes both from the ids and the images'
grids alone (no model call), as ``get_rope_index`` of transformers' Qwen2-VL and Qwen2.5-VL does for images.

Example:
    >>> ids = torch.tensor([5, 6, 9, 9, 9, 9, 7])  # two text tokens, a 2 x 2 image (id 9), one text token
    >>> positions, delta = mrope_positions(ids, torch.tensor([[1, 4, 4]]), image_token_id=9, merge_size=2)
    >>> positions.tolist(), delta
    ([[0, 1, 2, 2, 2, 2, 4], [0, 1, 2, 2, 3, 3, 4], [0, 1, 2, 3, 2, 3, 4]], -2)
"""

from __future__ import annotations

import torch

__all__ = ["is_vision_model", "mrope_positions", "text_config", "vision_token_ids"]

_TOKEN_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def is_vision_model(model_or_config) -> bool:
    """Whether a model (or its config) takes images: a vision tower's config and an image token id."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "vision_config", None) is not None and getattr(config, "image_token_id", None) is not None


def text_config(config):
    """The config of a model's language part (a vision-language config keeps its vocabulary size and context length
    there); a text model's config itself."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def vision_token_ids(model_or_config) -> list[int]:
    """The ids of a vision-language model's vision tokens (image and video pads, vision start and end): placeholders
    the processor writes, never a token to sample. Empty for a text model."""
    config = getattr(model_or_config, "config", model_or_config)
    if not is_vision_model(config):
        return []
    return sorted({int(v) for v in (getattr(config, name, None) for name in _TOKEN_FIELDS) if v is not None})


def mrope_positions(ids: torch.Tensor, image_grid_thw: torch.Tensor | None, *, image_token_id: int,
                    merge_size: int) -> tuple[torch.Tensor, int]:  # fmt: skip
    """M-RoPE positions (3, L) of one unpadded sequence ``ids`` (L,) and its rope delta (the next token's position
    minus its index).

    Args:
        ids: the token ids, each image's placeholder expanded to its ``t * h * w / merge_size ** 2`` image tokens (what the
            processor writes).
        image_grid_thw: (images, 3) int: each image's patch grid (time, height, width) in the order the images appear
            in ``ids``; None or empty for a text-only sequence.
        image_token_id: the id of an image token.
        merge_size: patches merged per token side (the vision config's ``spatial_merge_size``).

    Raises:
        ValueError: image tokens that do not match the grids (count, or a run of tokens of another size).
    """
    ids = ids.reshape(-1).cpu()
    grids = [] if image_grid_thw is None else [tuple(int(x) for x in g) for g in image_grid_thw.reshape(-1, 3).tolist()]
    is_image = ids == image_token_id
    n = ids.numel()
    # runs of text or image tokens: their starts, from one comparison (no per-token Python)
    starts = [0, *((is_image[1:] != is_image[:-1]).nonzero().squeeze(-1) + 1).tolist()] if n else []
    parts: list[torch.Tensor] = []
    start, at = 0, 0  # next position; next grid
    for k, i in enumerate(starts):
        j = starts[k + 1] if k + 1 < len(starts) else n
        if not bool(is_image[i]):
            parts.append(torch.arange(start, start + j - i).expand(3, -1))
            start += j - i
            continue
        while i < j:  # an image run may hold several images back to back
            if at >= len(grids):
                raise ValueError(f"mrope_positions: more images in the ids than the {len(grids)} grid(s) given; pass "
                                 "each image's image_grid_thw, in order")  # fmt: skip
            t, h, w = grids[at][0], grids[at][1] // merge_size, grids[at][2] // merge_size
            size = t * h * w
            if i + size > j or (i + size < j and at + 1 >= len(grids)):
                raise ValueError(f"mrope_positions: image {at} has a {grids[at]} grid, {size} tokens at merge size "
                                 f"{merge_size}, but its run in the ids holds {j - i}: ids and grids from different "
                                 "images, or a merge size not the model's")  # fmt: skip
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
            parts.append(grid.reshape(3, -1) + start)
            start += max(t, h, w)
            i += size
            at += 1
    if at != len(grids):
        raise ValueError(f"mrope_positions: {len(grids)} image grid(s) given but {at} image(s) in the ids")
    positions = torch.cat(parts, 1) if parts else torch.zeros(3, 0, dtype=torch.int64)
    return positions, start - n
