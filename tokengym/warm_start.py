"""A supervised warm start before RL: teacher-forced cross-entropy on each prompt's target answer.

A random-init or small model rarely writes a right answer, so its GRPO groups all score 0 and carry no signal. A few
hundred full-batch steps on the training problems' answers (the answer format, part of the answers) give RL a
model whose samples differ in reward. The demo and the reasoning-gym recipe start this way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tokengym.llm_envs import PromptSource, is_vision_model, mrope_positions
from tokengym.llm_envs.image_inputs import ImageInputs

__all__ = ["supervised_warm_start"]

_IGNORE = -100  # the label transformers' cross-entropy leaves out


def supervised_warm_start(model, tokenizer, targets: Sequence[Mapping], steps: int, *,
                          lr: float = 3e-3, processor=None) -> list[float]:  # fmt: skip
    """Train ``model`` for ``steps`` Adam steps on ``answer + eos`` after each prompt; returns each step's loss.

    Every step is one batch of all the targets, left-padded so that each answer ends at the last column; the loss
    is the mean cross-entropy over the answer tokens (and the eos) only. The model is left in eval mode.

    Args:
        model: a transformers causal LM (trained in place, on its own device).
        tokenizer: its tokenizer (``eos_token_id`` and ``pad_token_id`` set).
        targets: ``{"prompt": text or chat messages, "answer": text}`` each; chat messages are rendered with the
            tokenizer's chat template and its generation prompt, as :class:`~tokengym.llm_envs.PromptSource` renders
            them, so the model learns the answer after the prompt it will see. Only train problems: a held-out
            problem here is no longer held out.
        steps: optimizer steps (0: nothing happens).
        lr: Adam learning rate (a fresh optimizer).
        processor: a vision-language model's processor: targets may then carry ``images`` (as prompts do,
            :class:`~tokengym.llm_envs.PromptSource`), rendered and passed to the model with their multimodal positions.

    Raises:
        ValueError, TypeError: bad ``steps``, ``lr`` or ``targets`` (an item without ``prompt`` or ``answer``).

    Example:
        >>> from tokengym.testing import tiny_model, tiny_tokenizer
        >>> tok = tiny_tokenizer(); model = tiny_model(tok)
        >>> losses = supervised_warm_start(model, tok, [{"prompt": "1+1=", "answer": "2"}], steps=20)
        >>> len(losses), losses[-1] < losses[0] / 2
        (20, True)
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0 (0: no warm start), got {steps!r}")
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not lr > 0:
        raise ValueError(f"lr must be a number > 0, got {lr!r}")
    if steps == 0:
        return []
    ids, labels, attention, images = _batch(tokenizer, targets, processor)
    device = next(model.parameters()).device
    ids, labels, attention = ids.to(device), labels.to(device), attention.to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)  # left padding: each sequence's positions start at 0
    extra = {}
    if any(x is not None for x in images):
        positions, extra = _image_inputs(model, ids, attention, images)
    optim = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        out = model(input_ids=ids, attention_mask=attention, position_ids=positions, labels=labels, **extra)
        optim.zero_grad()
        out.loss.backward()
        optim.step()
        losses.append(out.loss.detach())
    model.eval()
    return torch.stack(losses).tolist()  # one host copy, not one per step


def _image_inputs(model, ids: torch.Tensor, attention: torch.Tensor, images: list) -> tuple[torch.Tensor, dict]:
    """M-RoPE positions (3, B, T) of left-padded rows and their images' model inputs."""
    if not is_vision_model(model):
        raise ValueError(f"targets with images need a vision-language model, got {type(model).__name__}")
    config = model.config
    positions = torch.zeros(3, *ids.shape, dtype=torch.int64)
    for row, held in enumerate(images):
        real = attention[row].bool().cpu()
        grid = None if held is None else held.image_grid_thw
        positions[:, row, real], _ = mrope_positions(ids[row].cpu()[real], grid, image_token_id=config.image_token_id,
                                                     merge_size=config.vision_config.spatial_merge_size)  # fmt: skip
    return positions.to(ids.device), ImageInputs.cat(images).model_inputs(ids.device)


def _batch(tokenizer, targets: Sequence[Mapping], processor=None) -> tuple:
    """Left-padded ``prompt + answer + eos`` ids (B, T), labels on the answer only (B, T), attention mask (B, T), and
    each row's images (``ImageInputs`` or ``None``)."""
    if isinstance(targets, str | bytes | Mapping) or not isinstance(targets, Sequence) or not targets:
        raise TypeError(f"targets must be a non-empty list of {{'prompt': ..., 'answer': ...}}, got {targets!r:.80}")
    rows, images = [], []
    source = None if processor is None else PromptSource(list(targets), tokenizer, processor=processor)
    for i, target in enumerate(targets):
        if not isinstance(target, Mapping) or "prompt" not in target or "answer" not in target:
            raise TypeError(f"target {i} must be a mapping with 'prompt' and 'answer', got {target!r:.80}")
        answer = tokenizer(str(target["answer"]), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if target.get("images") or target.get("image") is not None:
            if source is None:
                raise ValueError(f"target {i} carries images: pass processor= (the vision-language model's)")
            prompt, held = source.encode_with_images(target, i)
            rows.append((prompt.tolist(), answer))
            images.append(held)
            continue
        rows.append((_prompt_ids(tokenizer, target["prompt"], i), answer))
        images.append(None)
    width = max(len(a) + len(b) for a, b in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), _IGNORE)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (prompt, answer) in enumerate(rows):  # left-pad, so every answer ends at the last column
        seq = prompt + answer
        ids[i, width - len(seq) :] = torch.tensor(seq)
        labels[i, width - len(answer) :] = torch.tensor(answer)
        attention[i, width - len(seq) :] = 1
    return ids, labels, attention, images


def _prompt_ids(tokenizer, prompt, i: int) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"target {i}'s prompt is chat messages but the tokenizer has no chat template; give text")
        text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    raise TypeError(f"target {i}'s prompt must be text or chat messages, got {prompt!r:.80}")
