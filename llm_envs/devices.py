"""Where a model works: the device its inputs go to, the device its logits come out on, a sampling generator there.

The model's device decides where a policy, an actor or a transform that runs it works; the env's slot state and the
collected batches stay on the host. A model loaded with ``device_map`` (layers spread over several devices) takes its
inputs on its input embedding's device and returns logits on its output embedding's device; these helpers name both
(a module the map offloads to the CPU runs on its hook's execution device, where its output lands).

Example:
    >>> from tokengym.testing import tiny_model, tiny_tokenizer
    >>> model = tiny_model(tiny_tokenizer())
    >>> input_device(model), output_device(model)
    (device(type='cpu'), device(type='cpu'))
    >>> seeded_generator(input_device(model), 0).device
    device(type='cpu')
"""

from __future__ import annotations

import torch

__all__ = ["check_same_device", "generator_device", "input_device", "output_device", "seeded_generator"]


def _embedding_device(model, getter: str) -> torch.device | None:
    get = getattr(model, getter, None)
    module = get() if callable(get) else None
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    if weight.device.type == "meta":  # offloaded by a device_map (accelerate): it runs on its hook's device
        device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
        if device is not None:
            return _indexed(torch.device(device))
    return weight.device


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as the tensors there name it (``cuda:0``): a hook may name its device without an index."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _first_parameter_device(model) -> torch.device:
    parameters = getattr(model, "parameters", None)
    for p in parameters() if callable(parameters) else ():
        return p.device
    return torch.device("cpu")


def input_device(model) -> torch.device:
    """The device a model's ``input_ids`` go to: its input embedding's (``device_map`` models too), else its first
    parameter's, else the CPU."""
    return _embedding_device(model, "get_input_embeddings") or _first_parameter_device(model)


def output_device(model) -> torch.device:
    """The device a model's logits come out on: its output embedding's (the LM head), else :func:`input_device`."""
    return _embedding_device(model, "get_output_embeddings") or input_device(model)


def seeded_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed``: draws for tensors on a CUDA device need a CUDA
    generator (the same seed gives the same tokens on the same kind of device, not across devices)."""
    return torch.Generator(device=torch.device(device)).manual_seed(int(seed))


def generator_device(generator: torch.Generator) -> str:
    """The device type of ``generator`` (``"cpu"``, ``"cuda"``), as checkpoints record it."""
    return torch.device(generator.device).type


def check_same_device(owner: str, batch_device: torch.device, model_device: torch.device) -> None:
    """A ``ValueError`` naming the fix when a batch on one device meets a model on another (a host batch and a CUDA
    model: the per-step logits would be copied to the host)."""
    if batch_device.type == "cpu" and model_device.type != "cpu":
        raise ValueError(
            f"{owner}: the batch is on the host (cpu) but the model works on {model_device}; move the batch to the "
            f"model's device first: batch.to({str(model_device)!r}), or train(..., device={str(model_device)!r}) "
            "(collectors always yield host batches)"
        )
