"""Offline tiny vision-language models: a random Qwen2-VL (or Qwen2.5-VL) and its processor, built from
:func:`~tokengym.llm_envs.tiny_models.tiny_tokenizer` with Qwen's vision tokens added. Nothing is downloaded.

The processor is Qwen2-VL's with its image processor alone (:class:`ImageOnlyQwen2VLProcessor`): transformers'
``Qwen2VLProcessor`` also needs a video processor, which needs torchvision, which this CPU stack does not install.
Images are cut into patches of 4 x 4 pixels and merged 2 x 2, so each image token covers 8 x 8 pixels: a 32 x 24 image
is 12 image tokens. The model's text part has hidden size 64, 2 layers and head size 32 (what vLLM's CPU attention
takes); its vision tower one block. About 230k parameters, under 1 MB saved.

Example:
    >>> from PIL import Image
    >>> tok = tiny_vl_tokenizer(); processor = tiny_vl_processor(tok); model = tiny_vl_model(tok)
    >>> text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
    ...     {"type": "text", "text": "1+1="}]}], add_generation_prompt=True, tokenize=False)
    >>> inputs = processor(text=[text], images=[Image.new("RGB", (32, 24))], return_tensors="pt")
    >>> inputs["image_grid_thw"].tolist(), int((inputs["input_ids"] == model.config.image_token_id).sum())
    ([[1, 6, 8]], 12)
"""

from __future__ import annotations

import torch
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    Qwen2VLProcessor,
)

from tokengym.llm_envs.tiny_models import tiny_tokenizer

__all__ = ["VISION_TOKENS", "VL_CHAT_TEMPLATE", "ImageOnlyQwen2VLProcessor", "tiny_vl_model", "tiny_vl_processor",
           "tiny_vl_tokenizer"]  # fmt: skip

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# tiny_tokenizer's chat template, where a message's content may be a list of {"type": "image"} / {"type": "text"} items
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' }}"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
PATCH, TEMPORAL_PATCH, MERGE = 4, 2, 2  # pixels per patch side, frames per patch, patches merged per token side
FAMILIES = ("qwen2_vl", "qwen2_5_vl")


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` without its video processor (which needs torchvision): images and text only. It saves
    and loads with ``save_pretrained`` / ``ImageOnlyQwen2VLProcessor.from_pretrained(path)``; ``AutoProcessor`` asks
    for the video processor and does not know it."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def tiny_vl_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """:func:`~tokengym.llm_envs.tiny_models.tiny_tokenizer` with Qwen's four vision tokens (ids ``vocab_size`` to
    ``vocab_size + 3``) and a chat template that renders ``{"type": "image"}`` items."""
    tok = tiny_tokenizer(vocab_size)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = VL_CHAT_TEMPLATE
    return tok


def tiny_vl_processor(tokenizer: PreTrainedTokenizerFast | None = None, *, min_side: int = 16,
                      max_side: int = 64) -> ImageOnlyQwen2VLProcessor:  # fmt: skip
    """The processor of :func:`tiny_vl_model`: Qwen2-VL's PIL image processor (patches of 4 pixels, merged 2 x 2)
    resizing each image to multiples of 8 pixels with an area between ``min_side * min_side`` and
    ``max_side * max_side`` pixels."""
    tokenizer = tokenizer or tiny_vl_tokenizer()
    images = Qwen2VLImageProcessorPil(patch_size=PATCH, temporal_patch_size=TEMPORAL_PATCH, merge_size=MERGE,
                                      min_pixels=min_side * min_side, max_pixels=max_side * max_side)  # fmt: skip
    return ImageOnlyQwen2VLProcessor(image_processor=images, tokenizer=tokenizer, chat_template=VL_CHAT_TEMPLATE)


def _config(tok: PreTrainedTokenizerFast, family: str, hidden: int, layers: int):
    heads = max(1, hidden // 32)  # head size 32: vLLM's CPU attention takes 32 and up
    half = hidden // heads // 2  # M-RoPE's three sections (time, height, width) split half the head's dimensions
    mrope = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    text = {"vocab_size": len(tok), "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 1,
            "max_position_embeddings": 2048, "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
            "bos_token_id": tok.bos_token_id,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope}}  # fmt: skip
    ids = {"image_token_id": tok.convert_tokens_to_ids("<|image_pad|>"),
           "video_token_id": tok.convert_tokens_to_ids("<|video_pad|>"),
           "vision_start_token_id": tok.convert_tokens_to_ids("<|vision_start|>"),
           "vision_end_token_id": tok.convert_tokens_to_ids("<|vision_end|>")}  # fmt: skip
    common = {"patch_size": PATCH, "temporal_patch_size": TEMPORAL_PATCH, "spatial_merge_size": MERGE, "num_heads": 2}
    if family == "qwen2_vl":
        vision = {"depth": 1, "embed_dim": 64, "hidden_size": hidden, "mlp_ratio": 2, **common}
        return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    from transformers import Qwen2_5_VLConfig

    vision = {"depth": 1, "hidden_size": 64, "out_hidden_size": hidden, "intermediate_size": 128,
              "window_size": 2 * PATCH * MERGE, "fullatt_block_indexes": [0], **common}  # fmt: skip
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)


def tiny_vl_model(tokenizer: PreTrainedTokenizerFast | None = None, *, family: str = "qwen2_vl", seed: int = 0,
                  hidden_size: int = 64, num_layers: int = 2) -> PreTrainedModel:  # fmt: skip
    """A random-init Qwen2-VL (``family="qwen2_5_vl"``: Qwen2.5-VL) whose vocabulary matches ``tokenizer`` (default
    :func:`tiny_vl_tokenizer`), in eval mode, float32.

    Raises:
        ValueError: an unknown family, or a tokenizer without the vision tokens.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    tokenizer = tokenizer or tiny_vl_tokenizer()
    missing = [t for t in VISION_TOKENS if t not in tokenizer.get_vocab()]
    if missing:
        raise ValueError(f"tiny_vl_model needs a tokenizer with the vision tokens, missing {missing}: use "
                         "tiny_vl_tokenizer()")  # fmt: skip
    config = _config(tokenizer, family, hidden_size, num_layers)
    if family == "qwen2_vl":
        cls = Qwen2VLForConditionalGeneration
    else:
        from transformers import Qwen2_5_VLForConditionalGeneration as cls
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = cls(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval()
