"""The image inputs of a prompt for a vision-language model: what its processor made of the prompt's images
(``pixel_values`` and each image's patch grid), recorded once per prompt beside its token ids, never per step.

A prompt with images is its text plus a list of images (PIL images, arrays or file paths). The model's processor
renders it: each image placeholder of the text (Qwen2-VL's ``<|image_pad|>``, written by the chat template for a
``{"type": "image"}`` item) is expanded to as many image tokens as the image covers, and the images become
``pixel_values`` (patches x patch features) and ``image_grid_thw`` (one row per image). :func:`encode_with_images`
does that; :class:`ImageInputs` holds the result with a digest that identifies the images (two prompts with the same
text and different images have the same token ids: whatever keys prompts by their ids, a KV prefix store say, adds
the digest).

Example:
    >>> from PIL import Image
    >>> from tokengym.testing import tiny_vl_processor
    >>> processor = tiny_vl_processor()
    >>> text = "<|vision_start|><|image_pad|><|vision_end|>How many?"
    >>> ids, images = encode_with_images(processor, text, [Image.new("RGB", (32, 24))])
    >>> images.image_grid_thw.tolist(), images.num_images, int((ids == processor.image_token_id).sum())
    ([[1, 6, 8]], 1, 12)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from collections.abc import Sequence

import torch

from tokengym.llm_envs.vision import is_vision_model

__all__ = ["ImageInputs", "check_processor_fits", "encode_images_in_ids", "encode_with_images", "image_token_id",
           "load_image"]


@dataclasses.dataclass(frozen=True, eq=False)
class ImageInputs:
    """A prompt's images as its model's processor prepared them.

    Attributes:
        pixel_values: float (patches, features): every image's patches, image after image.
        image_grid_thw: int64 (images, 3): each image's patch grid (time, height, width), in the order the images
            appear in the token ids.
        digest: a hash of both (16 hex digits): equal images, equal digests; computed on first use (a prefix key, a
            cache's grouping), not for every concatenation a forward makes.
    """

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor

    @functools.cached_property
    def digest(self) -> str:
        digest = hashlib.blake2b(digest_size=8)
        digest.update(self.image_grid_thw.numpy().tobytes())
        digest.update(str(self.pixel_values.dtype).encode())
        digest.update(self.pixel_values.contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    @classmethod
    def of(cls, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> ImageInputs:
        """Image inputs from a processor's ``pixel_values`` and ``image_grid_thw`` (kept on the CPU).

        Raises:
            ValueError: a grid that is not (images, 3), or patches that do not add up to the grids.
        """
        pixel_values = torch.as_tensor(pixel_values).detach().cpu()
        grid = torch.as_tensor(image_grid_thw).detach().cpu().to(torch.int64)
        if grid.ndim != 2 or grid.shape[1] != 3 or pixel_values.ndim != 2:
            raise ValueError(f"image inputs need pixel_values (patches, features) and image_grid_thw (images, 3), got "
                             f"{tuple(pixel_values.shape)} and {tuple(grid.shape)}")  # fmt: skip
        if int(grid.prod(-1).sum()) != pixel_values.shape[0]:
            raise ValueError(f"image_grid_thw {grid.tolist()} covers {int(grid.prod(-1).sum())} patches but "
                             f"pixel_values holds {pixel_values.shape[0]}: pass both from one processor call")  # fmt: skip
        return cls(pixel_values, grid)

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    @property
    def nbytes(self) -> int:
        return self.pixel_values.numel() * self.pixel_values.element_size() + self.image_grid_thw.numel() * 8

    def tokens(self, merge_size: int) -> list[int]:
        """Image tokens of each image at ``merge_size`` (the vision config's ``spatial_merge_size``)."""
        return [int(t) * int(h) * int(w) // merge_size**2 for t, h, w in self.image_grid_thw.tolist()]

    def model_inputs(self, device=None, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """``pixel_values`` and ``image_grid_thw`` for a model's forward (on ``device``, pixels in ``dtype``)."""
        return {"pixel_values": self.pixel_values.to(device=device, dtype=dtype or self.pixel_values.dtype),
                "image_grid_thw": self.image_grid_thw.to(device)}  # fmt: skip

    @staticmethod
    def cat(items: Sequence[ImageInputs | None]) -> ImageInputs | None:
        """The images of several sequences in order (a batch's rows), or ``None`` when none has an image."""
        held = [x for x in items if x is not None]
        if not held:
            return None
        if len(held) == 1:
            return held[0]
        return ImageInputs.of(torch.cat([x.pixel_values for x in held]), torch.cat([x.image_grid_thw for x in held]))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only (``torch.load(weights_only=True)`` reads them)."""
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}

    @classmethod
    def from_state_dict(cls, state: dict) -> ImageInputs:
        return cls.of(state["pixel_values"], state["image_grid_thw"])

    def __repr__(self) -> str:
        return f"ImageInputs(images={self.num_images}, patches={self.pixel_values.shape[0]}, digest={self.digest})"


def load_image(image, *, index: int | None = None):
    """``image`` as an RGB PIL image: a PIL image, an (H, W, 3) uint8 array or tensor, or a file path.

    Raises:
        TypeError: another type. FileNotFoundError: a path that does not exist.
    """
    from PIL import Image

    where = "" if index is None else f"prompt item {index}: "
    if isinstance(image, Image.Image):
        return image if image.mode == "RGB" else image.convert("RGB")
    if isinstance(image, str | os.PathLike):
        if not os.path.exists(image):
            raise FileNotFoundError(f"{where}image file {str(image)!r} does not exist")
        with Image.open(image) as opened:
            return opened.convert("RGB")
    array = image.numpy() if isinstance(image, torch.Tensor) else image
    if hasattr(array, "shape") and hasattr(array, "dtype") and len(array.shape) in (2, 3):
        return Image.fromarray(array).convert("RGB")
    raise TypeError(f"{where}an image must be a PIL image, an (H, W, 3) uint8 array or a file path, got "
                    f"{type(image).__name__}")  # fmt: skip


def image_token_id(processor) -> int:
    """The id of the image placeholder token of ``processor`` (``processor.image_token_id``, or its tokenizer's id of
    ``processor.image_token``)."""
    value = getattr(processor, "image_token_id", None)
    if value is None and getattr(processor, "image_token", None) is not None:
        value = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    if value is None:
        raise TypeError(f"{type(processor).__name__} names no image token (image_token / image_token_id): pass a "
                        "vision-language model's processor (AutoProcessor.from_pretrained of the model)")  # fmt: skip
    return int(value)


def encode_with_images(processor, text: str, images: Sequence, *, index: int | None = None
                       ) -> tuple[torch.Tensor, ImageInputs | None]:  # fmt: skip
    """Token ids (1-D int64) of ``text`` with each image placeholder expanded by ``processor``, and the images'
    :class:`ImageInputs` (``None`` without images).

    Raises:
        ValueError: a number of placeholders in ``text`` other than the number of images (one placeholder per
            image: a ``{"type": "image"}`` item in a chat message, or the processor's ``image_token`` in a text).
    """
    where = "" if index is None else f"prompt item {index}: "
    token = getattr(processor, "image_token", None)
    if token is None:
        raise TypeError(f"{where}{type(processor).__name__} names no image_token: pass a vision-language model's "
                        "processor (AutoProcessor.from_pretrained of the model)")  # fmt: skip
    placeholders = text.count(token)
    if placeholders != len(images):
        raise ValueError(f"{where}the prompt has {placeholders} image placeholder(s) ({token!r}, one per "
                         f'{{"type": "image"}} item of its messages) and {len(images)} image(s): give one image per '
                         "placeholder, in order")  # fmt: skip
    pil = [load_image(x, index=index) for x in images]
    out = processor(text=[text], images=pil or None, return_tensors="pt")
    ids = torch.as_tensor(out["input_ids"][0], dtype=torch.int64)
    if not pil:
        return ids, None
    return ids, ImageInputs.of(out["pixel_values"], out["image_grid_thw"])


def check_processor_fits(processor, model_config) -> None:
    """Refuse a processor for a text-only model, or one whose image token or merge size is not the model's
    (``model_config`` None: nothing to check here; the policy checks its model)."""
    if processor is None or model_config is None:
        return
    if not is_vision_model(model_config):
        raise ValueError(f"the env has an image processor but its model ({type(model_config).__name__}) is text only: "
                         "use a vision-language model (Qwen2-VL, Qwen2.5-VL) or drop processor= and the images")  # fmt: skip
    want, have = int(model_config.image_token_id), image_token_id(processor)
    merge = getattr(getattr(processor, "image_processor", None), "merge_size", None)
    model_merge = getattr(model_config.vision_config, "spatial_merge_size", None)
    if want != have or (merge is not None and model_merge is not None and int(merge) != int(model_merge)):
        raise ValueError(f"the processor does not match the model: image token id {have} and merge size {merge}, the "
                         f"model's {want} and {model_merge}; load the processor from the model's directory")  # fmt: skip


def encode_images_in_ids(processor, ids: torch.Tensor, images: Sequence, *, where: str = ""
                         ) -> tuple[torch.Tensor, ImageInputs]:  # fmt: skip
    """Rendered ids holding one image placeholder per image (a chat template's rendering of ``{"type": "image"}``
    items) with each placeholder expanded to its image's tokens, and the images' :class:`ImageInputs`: what the
    processor makes of the same text and images.

    Raises:
        ValueError: a number of placeholders other than the number of images.
    """
    token = image_token_id(processor)
    at = (ids == token).nonzero().squeeze(-1).tolist()
    if len(at) != len(images):
        raise ValueError(f"{where}{len(at)} image placeholder(s) in the rendered feedback and {len(images)} image(s): "
                         'give one {"type": "image"} item (or placeholder) per image, in order')  # fmt: skip
    out = processor.image_processor(images=[load_image(x) for x in images], return_tensors="pt")
    inputs = ImageInputs.of(out["pixel_values"], out["image_grid_thw"])
    counts = inputs.tokens(int(processor.image_processor.merge_size))
    pieces, start = [], 0
    for i, n in zip(at, counts, strict=True):
        pieces += [ids[start:i], torch.full((n,), token, dtype=torch.int64)]
        start = i + 1
    pieces.append(ids[start:])
    return torch.cat(pieces), inputs
