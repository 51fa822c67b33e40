"""What a policy does differently for a vision-language model: its env must render images with a processor that
matches the model, its decode is the dynamic one, the vision placeholders are never sampled, and its KV cache asks
the env for each refilled slot's images."""

from __future__ import annotations

import dataclasses

from tokengym.llm_envs.image_inputs import check_processor_fits
from tokengym.llm_envs.vision import is_vision_model

__all__ = ["check_vision", "slot_images", "with_banned"]


def check_vision(model, env, decode: str, *, role: str = "the policy's model") -> bool:
    """Whether ``model`` takes images (then its policy passes them); a ``ValueError`` for an env with images and a
    text-only model, a processor that does not match the model, or a decode mode without images."""
    processor = getattr(env, "processor", None)
    if not is_vision_model(model):
        if processor is not None:
            raise ValueError(f"the env renders images (processor={type(processor).__name__}) but {role} "
                             f"{type(model).__name__} is text only: use a vision-language model (Qwen2-VL, Qwen2.5-VL) "
                             "or an env without processor= and images")  # fmt: skip
        return False
    if processor is not None:
        check_processor_fits(processor, model.config)
    if decode != "dynamic":
        raise ValueError(f"decode={decode!r} does not take a vision-language model yet (its static cache has no "
                         "multimodal positions): use decode='dynamic'")  # fmt: skip
    return True


def with_banned(sampling, ids: list[int]):
    """``sampling`` (a ``SamplingConfig``) with ``ids`` added to its banned tokens."""
    banned = tuple(sorted({*sampling.banned_token_ids, *ids}))
    return sampling if banned == tuple(sampling.banned_token_ids) else dataclasses.replace(sampling, banned_token_ids=banned)


def slot_images(env):
    """``images(slot)``: the images the env's ``slot`` holds so far (its prompt's, then its feedback's), or ``None``."""
    return env.slot_images
