"""LoRA models (PEFT) as policies: the adapter's tensors, merged weights, and the base model as the KL reference.

A ``peft`` LoRA model (``get_peft_model(model, LoraConfig(...))``) goes wherever a transformers model goes:
:class:`~tokengym.collectors.policies.TransformersPolicy` (steps and waves, KV cache), the sequence actors the losses
read (only the adapter's parameters require a gradient) and :func:`~tokengym.transforms.step_log_probs`.
A weight update of a LoRA policy sends only the adapter: ``collector.update_policy_weights_(model)`` with the PEFT
model sends :func:`adapter_weights` (so do the Ray and async collectors). A backend that cannot take adapters
gets :func:`merged_weights` instead (the base weights with ``B @ A * scaling`` added, transformers names).

:class:`AdaptersDisabled` is the base model of a PEFT model, its adapters switched off for each call: the KL
reference without a second copy of the weights (``KLRewardTransform(ref_model=AdaptersDisabled(model))``,
``StepwiseReference(AdaptersDisabled(model), env)``).

``peft`` is imported lazily: ``pip install tokengym[lora]``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

__all__ = ["AdaptersDisabled", "adapter_weights", "is_lora_model", "merged_weights"]

_INSTALL = "LoRA models need peft: pip install tokengym[lora] (peft 0.21)"
_NOT_PEFT = ("{what} must be a peft LoRA model (peft.get_peft_model(model, LoraConfig(...))), got {name}; a plain "
             "transformers model has no adapter")  # fmt: skip


def import_peft():
    """The ``peft`` module, or an ``ImportError`` naming the extra to install."""
    try:
        import peft
    except ImportError as err:
        raise ImportError(f"{_INSTALL} ({err})") from err
    return peft


def is_lora_model(model) -> bool:
    """True when ``model`` is a ``peft`` model whose active adapter is a LoRA adapter (no import of ``peft``)."""
    config = getattr(model, "peft_config", None)
    if not isinstance(config, Mapping) or not callable(getattr(model, "disable_adapter", None)):
        return False
    adapter = config.get(getattr(model, "active_adapter", None))
    return str(getattr(adapter, "peft_type", "")).upper().endswith("LORA")


def active_adapter(model) -> str:
    """The name of ``model``'s one active adapter (a ``TypeError`` for a model that is not a PEFT LoRA model)."""
    if not is_lora_model(model):
        raise TypeError(_NOT_PEFT.format(what="model", name=type(model).__name__))
    active = model.active_adapters
    if len(active) != 1:
        raise ValueError(f"the PEFT model has {len(active)} active adapters {active}; activate one with "
                         "model.set_adapter(name): a policy samples with one adapter")  # fmt: skip
    return active[0]


def adapter_weights(model) -> dict[str, torch.Tensor]:
    """The active adapter's tensors, named as PEFT saves them (``base_model.model.<module>.lora_A.weight``).

    What a weight update of a LoRA policy sends (``collector.update_policy_weights_(model)`` calls it for a PEFT
    model); the tensors are the model's own (detached, not copied).

    Example:
        >>> from peft import LoraConfig, get_peft_model
        >>> from tokengym.testing import tiny_model, tiny_tokenizer
        >>> model = get_peft_model(tiny_model(tiny_tokenizer()), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        >>> weights = adapter_weights(model)
        >>> len(weights), next(iter(weights))
        (8, 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight')
    """
    name = active_adapter(model)
    fast = adapter_parameters(model, name)  # plain LoRA: its parameters, renamed (peft's own walk costs ~8x more)
    if fast is not None:
        return {k: v.detach() for k, v in fast.items()}
    peft = import_peft()
    weights = peft.get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=False)
    return {k: v.detach() for k, v in weights.items()}


def adapter_parameters(model, adapter: str) -> dict[str, torch.nn.Parameter] | None:
    """Name as PEFT saves it -> parameter, for every tensor of ``adapter``, when it is a plain LoRA adapter on linear
    layers (``lora_A`` / ``lora_B`` only); ``None`` for anything else (DoRA, biases, embeddings, saved modules)."""
    config = model.peft_config[adapter]
    if (getattr(config, "use_dora", False) or getattr(config, "lora_bias", False) or config.bias != "none"
            or config.modules_to_save):  # fmt: skip
        return None
    plain = re.compile(rf"\.(lora_[AB])\.{re.escape(adapter)}\.weight$")
    out = {}
    for name, param in model.named_parameters():
        if ".lora_" not in name or f".{adapter}." not in name:
            continue
        if not plain.search(name):
            return None
        out[plain.sub(r".\1.weight", name)] = param
    return out


def _base_name(name: str, adapter: str) -> str | None:
    """The transformers name of a PEFT model's state_dict entry; ``None`` for adapter parameters and stale copies."""
    if ".lora_" in name or ".original_module." in name:
        return None
    name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
    return name.replace(f".modules_to_save.{adapter}.", ".")


@torch.no_grad()
def merged_weights(model) -> dict[str, torch.Tensor]:
    """The base model's full weights with the active LoRA adapter merged in (transformers names, new tensors where
    merged): what a backend that cannot take adapters loads instead. The model is not changed.

    Each LoRA layer's weight is ``W + lora_B @ lora_A * scaling`` (peft's own ``get_delta_weight``); trained copies
    of ``modules_to_save`` replace the originals.

    Example:
        >>> import torch
        >>> from peft import LoraConfig, get_peft_model
        >>> from tokengym.testing import tiny_model, tiny_tokenizer
        >>> base = tiny_model(tiny_tokenizer())
        >>> model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
        >>> merged = merged_weights(model)
        >>> set(merged) == set(tiny_model(tiny_tokenizer()).state_dict())
        True
    """
    adapter = active_adapter(model)
    config = model.peft_config[adapter]
    if getattr(config, "use_dora", False):
        raise ValueError("merged_weights merges plain LoRA adapters; this one uses DoRA (use_dora=True): merge it with "
                         "model.merge_and_unload() on a copy of the model")  # fmt: skip
    out = {}
    for name, tensor in model.state_dict().items():
        base = _base_name(name, adapter)
        if base is not None and (base not in out or f".modules_to_save.{adapter}." in name):
            out[base] = tensor.detach()
    for name, module in model.named_modules():
        if hasattr(module, "get_delta_weight") and adapter in getattr(module, "lora_A", {}):
            key = name.removeprefix("base_model.model.") + ".weight"
            out[key] = out[key] + module.get_delta_weight(adapter).to(out[key].dtype)
    return out


class AdaptersDisabled:
    """The base model of a PEFT ``model``: every call runs with its adapters disabled.

    The KL reference of LoRA training without a second copy of the weights: pass it where a reference model goes
    (``KLRewardTransform(ref_model=AdaptersDisabled(model))``, ``StepwiseReference(AdaptersDisabled(model), env)``).
    It switches the adapters off on the shared model for the length of each call, so do not call it while another
    thread generates with the same model.

    Example:
        >>> import torch
        >>> from peft import LoraConfig, get_peft_model
        >>> from tokengym.testing import tiny_model, tiny_tokenizer
        >>> tok = tiny_tokenizer(); ids = torch.tensor([[5, 6, 7]])
        >>> model = get_peft_model(tiny_model(tok), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
        >>> base = AdaptersDisabled(model)(input_ids=ids).logits
        >>> bool(torch.allclose(base, tiny_model(tok)(input_ids=ids).logits, atol=1e-6))
        True
    """

    def __init__(self, model) -> None:
        active_adapter(model)  # a TypeError for a model without LoRA adapters
        self.model = model

    @property
    def config(self):
        """The base model's config."""
        return self.model.config

    def parameters(self, recurse: bool = True):
        return self.model.parameters(recurse)

    def __call__(self, *args, **kwargs):
        with self.model.disable_adapter():
            return self.model(*args, **kwargs)

    def __repr__(self) -> str:
        return f"AdaptersDisabled({type(self.model).__name__})"
