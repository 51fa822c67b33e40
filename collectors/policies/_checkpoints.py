"""Checkpoints on disk and the weights an update sends, whatever the engine: the tensors of a local safetensors
checkpoint (names, shapes, the tensors themselves), the output layer a config ties to its embedding, and the
``(name, tensor)`` pairs a reload takes, checked against the checkpoint.

Every wave backend (an engine in this process, a fleet of servers of any engine) reads its checkpoint through these.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from tokengym.collectors.policies.protocol import weights_of

__all__ = ["checkpoint_shapes", "read_checkpoint", "tied_outputs", "weight_items"]

_NO_WEIGHTS = ("model directory {path!r} has no *.safetensors weights; save the model there with "
               "model.save_pretrained(path) (and the tokenizer with tokenizer.save_pretrained(path))")  # fmt: skip


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / name for name in names]
    return sorted(path.glob("*.safetensors"))


def checkpoint_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]] | None:
    """Name -> shape of every tensor in a local safetensors checkpoint (headers only); ``None`` if
    ``path`` is not a local directory with safetensors files."""
    path = Path(path)
    files = _checkpoint_files(path) if path.is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    shapes = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


def read_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a local safetensors checkpoint."""
    from safetensors.torch import load_file

    files = _checkpoint_files(Path(path))
    if not files:
        raise ValueError(_NO_WEIGHTS.format(path=str(path)))
    out: dict[str, torch.Tensor] = {}
    for file in files:
        out.update(load_file(str(file)))
    return out


def tied_outputs(hf_config) -> dict[str, str]:
    """Output weight -> input embedding it is tied to (``{"lm_head.weight": "model.embed_tokens.weight"}``
    for Qwen2), from the transformers class of the config's architecture; empty when untied."""
    if not getattr(hf_config, "tie_word_embeddings", False):
        return {}
    import transformers

    out: dict[str, str] = {}
    for arch in getattr(hf_config, "architectures", None) or ():
        tied = getattr(getattr(transformers, arch, None), "_tied_weights_keys", None)
        if isinstance(tied, Mapping):
            out.update(tied)
    return out


def weight_items(weights, expected: dict[str, tuple[int, ...]] | None, tied: dict[str, str]) -> list:
    """``(name, tensor)`` pairs to reload (``weights`` as :func:`weights_of` takes them): every tensor of the
    checkpoint, with its shape, is required.

    A tied output layer missing from ``weights`` (``save_pretrained`` drops it) is sent as its
    embedding: an engine may keep the output layer apart (vLLM's CPU backend repacks it separately), so a
    reload without it would leave it stale, with no error.
    """
    weights = weights_of(weights)
    for out_name, embed_name in tied.items():
        if out_name not in weights and embed_name in weights:
            weights[out_name] = weights[embed_name]
    if expected is not None:
        _check_names(weights, expected)
        # names the checkpoint lacks (buffers such as rotary inv_freq in a TensorDict.from_module) are
        # not weights the engine loads; the tied output layer is, although the checkpoint lacks it
        weights = {k: v for k, v in weights.items() if k in expected or k in tied}
    return [(name, tensor.detach()) for name, tensor in weights.items()]


def _check_names(weights: dict, expected: dict) -> None:
    missing = sorted(set(expected) - set(weights))
    if missing:
        other = sorted(set(weights) - set(expected))
        raise KeyError(
            f"weights lack {len(missing)} of the engine's checkpoint tensors, e.g. {missing[:3]} (names not in the "
            f"checkpoint: {other[:3]}); pass the trainer model's full state_dict() with transformers names"
        )
    wrong = [(k, tuple(weights[k].shape), expected[k]) for k in expected if tuple(weights[k].shape) != expected[k]]
    if wrong:
        raise ValueError(f"weights have the wrong shape (name, got, expected): {wrong[:5]}; "
                         "the trainer model and the engine's checkpoint are different architectures")  # fmt: skip
