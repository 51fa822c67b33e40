"""Offline tiny models and tokenizers (re-exported from :mod:`tokengym.llm_envs.testing`)."""

from tokengym.llm_envs.testing import (  # noqa: F401
    CHAT_TEMPLATE,
    FAMILIES,
    SIZES,
    tiny_model,
    tiny_reward_model,
    tiny_tokenizer,
)

__all__ = ["CHAT_TEMPLATE", "FAMILIES", "SIZES", "tiny_model", "tiny_reward_model", "tiny_tokenizer"]
