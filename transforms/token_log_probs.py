"""Log-probs of chosen tokens from a causal LM's final hidden states, the LM head applied per chunk of tokens.

A loss over a 151,936-token vocabulary must not hold ``(N, L, V)`` float32 logits: at 64 rows of 4,096 tokens they
take 160 GB. :class:`TokenScorer` keeps the final hidden states ``(R, H)`` and scores only the positions asked for,
``chunk_size`` of them at a time: the LM head, the temperature, the banned tokens and a float32 log-softmax per chunk,
each chunk recomputed in backward (activation checkpointing of the head), so what it holds at once is one chunk's
``(chunk_size, V)`` logits and their gradient (TRL's ``selective_log_softmax``, AReaL's chunked ``gather_logprobs``,
prime-rl's fused LM-head chunks do the same). :func:`final_hidden_states` runs the model up to its last hidden state
(``model.get_decoder()``) and hands back its output layer (``model.get_output_embeddings()``). A vision-language model's
decoder is its text model alone, which would drop the images: it runs its whole base model instead (``model.model`` of
Qwen2-VL: vision tower and text model), with the images and M-RoPE positions it is given.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.checkpoint import checkpoint

from tokengym.llm_envs.vision import is_vision_model

__all__ = ["TokenScorer", "chunk_tokens", "final_hidden_states"]

CHUNK_ELEMENTS = {"cuda": 2**27, "other": 2**25}  # float32 logits per chunk: 512 MiB on a GPU, 128 MiB elsewhere
_SPLIT_OK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its decoder + head give its logits


def chunk_tokens(vocab_size: int, device: torch.device, chunk_size: int | None = None) -> int:
    """The tokens scored per chunk: ``chunk_size``, or the default that holds ``CHUNK_ELEMENTS`` float32 logits."""
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int (tokens whose logits are held at once) or None "
                             f"(about {CHUNK_ELEMENTS['other']:,} logits), got {chunk_size!r}")  # fmt: skip
        return chunk_size
    return max(1, CHUNK_ELEMENTS["cuda" if device.type == "cuda" else "other"] // max(1, vocab_size))


def _parts(model) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(decoder, output layer) of a transformers causal LM, or None for a model that does not expose them."""
    get_decoder, get_head = getattr(model, "get_decoder", None), getattr(model, "get_output_embeddings", None)
    if not (callable(get_decoder) and callable(get_head)):
        return None
    try:
        decoder, head = get_decoder(), get_head()
    except (AttributeError, NotImplementedError):
        return None
    if not isinstance(decoder, torch.nn.Module) or not isinstance(head, torch.nn.Module) or decoder is model:
        return None
    return decoder, head


def _vision_parts(model) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(base model, output layer) of a vision-language model: the module that runs the vision tower, puts its
    features into the image tokens and runs the text model (transformers' ``base_model``: Qwen2-VL's ``model``), and
    the LM head; None for a model that does not expose them. A PEFT model is read through its base model."""
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    base = getattr(inner, "base_model", None)
    get_head = getattr(inner, "get_output_embeddings", None)
    if not isinstance(base, torch.nn.Module) or base is inner or not callable(get_head):
        return None
    try:
        head = get_head()
    except (AttributeError, NotImplementedError):
        return None
    return (base, head) if isinstance(head, torch.nn.Module) else None


def _softcap(model) -> float | None:
    return getattr(getattr(model, "config", None), "final_logit_softcapping", None) or None


def _is_split_exact(model, decoder: torch.nn.Module, head: torch.nn.Module) -> bool:
    """Whether ``head(decoder(x))`` (softcapped where the config says so) gives ``model(x).logits``: checked once per
    model on two tokens (a model that scales its logits some other way keeps the whole-logits path)."""
    known = _SPLIT_OK.get(model)
    if known is not None:
        return known
    device = next(model.parameters()).device
    ids = torch.tensor([[0, 1]], device=device)
    # a vision-language model gets explicit positions: without them it computes and keeps rope deltas of its own
    positions = {"position_ids": torch.arange(2, device=device).expand(3, 1, 2)} if is_vision_model(model) else {}
    modes = {module: module.training for module in model.modules()}  # restored one by one (PEFT mixes modes)
    model.eval()
    try:
        with torch.no_grad():
            whole = model(input_ids=ids, use_cache=False, **positions).logits.float()
            split = _capped(head(decoder(input_ids=ids, use_cache=False, **positions).last_hidden_state).float(),
                            _softcap(model))  # fmt: skip
        exact = whole.shape == split.shape and bool(torch.allclose(whole, split, rtol=1e-3, atol=1e-3))
    except Exception:  # a model whose decoder takes other inputs: the whole-logits path
        exact = False
    finally:
        for module, was_training in modes.items():
            module.train(was_training)
    _SPLIT_OK[model] = exact
    return exact


def _check_images(model, inputs: dict) -> None:
    """Refuse images for a text-only model, and image tokens without images for a vision-language model: either would
    score the image tokens without what they stand for."""
    has_pixels = inputs.get("pixel_values") is not None
    if not is_vision_model(model):
        if has_pixels:
            raise ValueError(f"final_hidden_states got images (pixel_values) but {type(model).__name__} is text only: "
                             "score a batch with images with a vision-language model (Qwen2-VL, Qwen2.5-VL)")  # fmt: skip
        return
    ids = inputs.get("input_ids")
    if not has_pixels and ids is not None and bool((ids == int(model.config.image_token_id)).any()):
        raise ValueError(f"final_hidden_states got image tokens but no images (pixel_values, image_grid_thw) for "
                         f"{type(model).__name__}: pass the rows' images and M-RoPE positions "
                         "(tokengym.transforms.image_rows.forward_inputs builds them)")  # fmt: skip


def final_hidden_states(model, **inputs) -> tuple[torch.Tensor, torch.nn.Module, float | None] | None:
    """The model's last hidden states (N, L, H) for ``inputs`` (``input_ids``, ``attention_mask``, ``position_ids``;
    a vision-language model's ``pixel_values`` and ``image_grid_thw`` too, its position ids (3, N, L) M-RoPE), its
    output layer and its logit softcap; None when the model does not split into a decoder (a vision-language model:
    its whole base model, vision tower included) and an output layer that give its logits (then score its whole
    logits). ``use_cache=False`` is passed.

    Raises:
        ValueError: images for a text-only model, or image tokens without images for a vision-language model.
    """
    _check_images(model, inputs)
    parts = _vision_parts(model) if is_vision_model(model) else _parts(model)
    if parts is None or not _is_split_exact(model, *parts):
        return None
    decoder, head = parts
    out = decoder(**inputs, use_cache=False)
    return out.last_hidden_state, head, _softcap(model)


def _capped(x: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return x if softcap is None else torch.tanh(x / softcap) * softcap


def _chunk_scores(hidden: torch.Tensor, tokens: torch.Tensor, head: torch.nn.Module, temperature: float,
                  banned: torch.Tensor | None, softcap: float | None, is_entropy: bool) -> torch.Tensor:  # fmt: skip
    """Log-probs (c,) of ``tokens`` (or entropies) from hidden states (c, H): the chunk's (c, V) logits live here only."""
    x = _capped(head(hidden).float(), softcap)  # (c, V) float32
    if temperature != 1.0:
        x = x / temperature
    if banned is not None:
        x = x.index_fill(-1, banned, -float("inf"))
    lse = x.logsumexp(-1)  # (c,)
    if is_entropy:
        p = (x - lse[:, None]).exp()
        return lse - (p * x.masked_fill(p == 0, 0.0)).sum(-1)  # -inf * 0 (a banned token) counts 0
    return x.gather(-1, tokens[:, None]).squeeze(-1) - lse


class TokenScorer:
    """Log-probs and entropies of chosen positions from final hidden states, the output layer applied per chunk.

    Memory: the hidden states (R, H) it is given, a gathered copy (K, H) of the K positions scored, and one chunk's
    ``(chunk_size, V)`` float32 logits with their gradient at a time (in backward each chunk's logits are recomputed).
    Never ``(K, V)``.

    Args:
        hidden: (R, H) hidden states, a row per position (any float dtype; the head runs in the model's dtype).
        head: the output layer (``model.get_output_embeddings()``), LoRA-wrapped or not.
        temperature: divides the logits (> 0).
        banned: int64 token ids whose logits are -inf (the sampler's banned tokens), or None.
        softcap: the model's final logit softcap (Gemma 2), or None.
        chunk_size: positions scored at once; None: about 128 MiB of float32 logits (512 MiB on a GPU).

    Example:
        >>> from tokengym.testing import tiny_model, tiny_tokenizer
        >>> model = tiny_model(tiny_tokenizer())
        >>> ids = torch.tensor([[5, 6, 7, 8]])
        >>> hidden, head, cap = final_hidden_states(model, input_ids=ids)
        >>> scorer = TokenScorer(hidden[0], head, chunk_size=2)
        >>> lp = scorer.log_probs(torch.tensor([0, 1, 2]), ids[0, 1:])  # token j+1 scored at row j
        >>> whole = model(input_ids=ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        >>> bool(torch.allclose(lp, whole, atol=1e-6))
        True
    """

    def __init__(self, hidden: torch.Tensor, head: torch.nn.Module, *, temperature: float = 1.0,
                 banned: torch.Tensor | None = None, softcap: float | None = None,
                 chunk_size: int | None = None) -> None:  # fmt: skip
        if hidden.ndim != 2:
            raise ValueError(f"hidden must be (R, H) hidden states, a row per position, got shape {tuple(hidden.shape)}")
        self.hidden, self.head, self.temperature, self.softcap = hidden, head, float(temperature), softcap
        self.banned = None if banned is None else banned.to(hidden.device)
        vocab = getattr(head, "out_features", None) or head.weight.shape[0]
        self.chunk_size = chunk_tokens(vocab, hidden.device, chunk_size)

    def log_probs(self, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """float32 (K,): ``log p(tokens[k])`` under the distribution of hidden row ``rows[k]``."""
        return self._scores(rows, tokens.to(self.hidden.device), is_entropy=False)

    def entropies(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 (K,): the entropy of the distribution of hidden row ``rows[k]``."""
        return self._scores(rows, None, is_entropy=True)

    def _scores(self, rows: torch.Tensor, tokens: torch.Tensor | None, *, is_entropy: bool) -> torch.Tensor:
        rows = rows.to(self.hidden.device)
        if rows.numel() == 0:
            return torch.zeros(0, device=self.hidden.device)
        picked = self.hidden.index_select(0, rows)  # (K, H): its backward is one index_add
        pieces = picked.split(self.chunk_size)  # views whose backward concatenates once (no per-chunk zeros (K, H))
        token_pieces = tokens.split(self.chunk_size) if tokens is not None else [rows[:0]] * len(pieces)
        args = (self.head, self.temperature, self.banned, self.softcap, is_entropy)
        needs_grad = torch.is_grad_enabled() and (picked.requires_grad or any(
            p.requires_grad for p in self.head.parameters()))  # fmt: skip
        if not needs_grad:
            return torch.cat([_chunk_scores(h, t, *args) for h, t in zip(pieces, token_pieces, strict=True)])
        return torch.cat([checkpoint(_chunk_scores, h, t, *args, use_reentrant=False)
                          for h, t in zip(pieces, token_pieces, strict=True)])  # fmt: skip
