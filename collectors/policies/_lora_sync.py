"""How a LoRA adapter reaches a generator: what a policy knows of its adapter, adapter directories, vLLM adapter versions.

:class:`AdapterSpec` is what a LoRA policy knows of the adapter it samples with (its PEFT config, the names and
shapes of its tensors, the scaling of each layer); it turns what ``update_weights`` gets (the PEFT model, its
adapter tensors or its full state_dict) into the adapter's tensors, checked, and merges them into base weights
for a backend that cannot take adapters. An adapter reaches vLLM through a directory (``adapter_model.safetensors``
and ``adapter_config.json``, written to a temporary name and renamed, so it is never read half written) under a
new adapter name per version: vLLM's prefix cache is keyed by the adapter, so a new name needs no cache reset.
:class:`EngineAdapters` loads them into an in-process engine (``LoRARequest``), :class:`ServerAdapters` into
running servers (the dialect's adapter calls, :mod:`._lora_servers`).

Scope: plain LoRA on linear layers (what vLLM serves). DoRA, ``modules_to_save``, LoRA biases and adapted
embeddings are refused with the fix (send :func:`~tokengym.collectors.policies.lora.merged_weights` to a policy
that takes full weights).
"""

from __future__ import annotations

import itertools
import math
import re
import secrets
from collections.abc import Mapping
from pathlib import Path

import torch

from tokengym.collectors.policies._server_weights import DirectoryTransport, save_tensors
from tokengym.collectors.policies.lora import (
    active_adapter,
    adapter_parameters,
    adapter_weights,
    import_peft,
    is_lora_model,
)
from tokengym.collectors.policies.protocol import weights_of

__all__ = ["MERGE_FIX", "AdapterSpec", "AdapterTransport", "EngineAdapters", "check_not_adapter", "lora_engine_kwargs",
           "lora_rank", "tensor_bytes"]  # fmt: skip

_PREFIX = "base_model.model."
_VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks
_LORA_NAME = re.compile(r"\.(lora_[AB])\.[^.]+\.weight$")  # a full PEFT state_dict's ".lora_A.<adapter>.weight"
_LORA_IDS = itertools.count(1)  # vLLM caches adapters by integer id: unique in this process
MERGE_FIX = "send merged_weights(model) (tokengym.collectors.policies) to a policy that takes full weights"


def tensor_bytes(tensors) -> int:
    """Bytes of the tensors of a ``{name: tensor}`` mapping or of ``(name, tensor)`` pairs."""
    values = tensors.values() if isinstance(tensors, Mapping) else (t for _, t in tensors)
    return sum(t.numel() * t.element_size() for t in values)


def check_not_adapter(weights: Mapping[str, torch.Tensor], owner: str) -> None:
    """A ``ValueError`` when full ``weights`` for ``owner`` are a LoRA adapter's tensors (it has no adapter)."""
    if any(".lora_A." in k for k in weights):
        raise ValueError(f"the update holds LoRA adapter tensors but {owner} has no adapter to load them into: build "
                         "it with the PEFT model (TransformersPolicy(peft_model, env)) or with lora=... (VLLMPolicy, "
                         f"VLLMServerPolicy), or {MERGE_FIX}")  # fmt: skip


def _config_of(lora):
    """The LoRA config of ``lora`` (a PEFT LoRA model, or a ``peft.LoraConfig``)."""
    if is_lora_model(lora):
        return lora.peft_config[active_adapter(lora)]
    if str(getattr(lora, "peft_type", "")).upper().endswith("LORA"):
        return lora
    raise TypeError(f"lora must be a peft LoRA model (peft.get_peft_model(model, LoraConfig(...))) or its "
                    f"peft.LoraConfig, got {type(lora).__name__}")  # fmt: skip


def lora_rank(lora) -> int:
    """The largest rank of ``lora``'s adapter (its ``r`` or a ``rank_pattern`` entry)."""
    config = _config_of(lora)
    return max([int(config.r), *(int(r) for r in (getattr(config, "rank_pattern", None) or {}).values())])


def _check_plain(config) -> None:
    problems = [what for what, bad in (("DoRA (use_dora=True)", getattr(config, "use_dora", False)),
                                       (f"modules_to_save={config.modules_to_save}", config.modules_to_save),
                                       (f"bias={config.bias!r}", config.bias != "none"),
                                       ("lora_bias=True", getattr(config, "lora_bias", False))) if bad]  # fmt: skip
    if problems:
        raise ValueError(f"tokengym syncs plain LoRA adapters on linear layers; this one has {', '.join(problems)}: "
                         f"{MERGE_FIX}")  # fmt: skip


class AdapterSpec:
    """The adapter a LoRA policy samples with: PEFT config, tensor names and shapes, per-layer scaling.

    Build it with :meth:`of`. ``initial`` holds the tensors of version 0 (the PEFT model's own, or zeros for a
    config: an adapter whose ``B`` is 0, as PEFT initializes it).
    """

    def __init__(self, config, shapes: dict[str, tuple[int, ...]], scaling: dict[str, float],
                 initial: dict[str, torch.Tensor]) -> None:  # fmt: skip
        self.config, self.shapes, self.scaling, self.initial = config, shapes, scaling, initial
        self.target: tuple | None = None  # (model, its adapter parameters by saved name): where load_into copies
        self.is_transposed = bool(getattr(config, "fan_in_fan_out", False))  # GPT-2's Conv1D stores W as (in, out)

    @classmethod
    def of(cls, lora, checkpoint: Mapping[str, tuple[int, ...]] | None = None) -> AdapterSpec:
        """From a PEFT LoRA model (its active adapter), or from a ``peft.LoraConfig`` and the base checkpoint's
        tensor shapes (``checkpoint``: name -> shape), which give the adapted layers."""
        config = _config_of(lora)
        _check_plain(config)
        if is_lora_model(lora):
            adapter = active_adapter(lora)
            initial = adapter_weights(lora)
            scaling = {name.removeprefix(_PREFIX): float(m.scaling[adapter]) for name, m in lora.named_modules()
                       if isinstance(getattr(m, "scaling", None), dict) and adapter in m.scaling}  # fmt: skip
            return cls(config, {k: tuple(v.shape) for k, v in initial.items()}, scaling, initial)
        if checkpoint is None:
            raise ValueError("a LoraConfig alone does not say which layers it adapts: pass the PEFT model as lora=, "
                             "or give the policy a local model directory")  # fmt: skip
        return cls._from_config(config, checkpoint)

    @classmethod
    def _from_config(cls, config, checkpoint: Mapping[str, tuple[int, ...]]) -> AdapterSpec:
        if getattr(config, "rank_pattern", None) or getattr(config, "alpha_pattern", None):
            raise ValueError("a LoraConfig with rank_pattern / alpha_pattern: pass the PEFT model as lora= (its "
                             "layers say their ranks)")  # fmt: skip
        import_peft()  # an ImportError naming the extra
        from peft.tuners.tuners_utils import check_target_module_exists

        r, transposed = int(config.r), bool(getattr(config, "fan_in_fan_out", False))
        scale = config.lora_alpha / (math.sqrt(r) if config.use_rslora else r)
        shapes, scaling = {}, {}
        for name, shape in checkpoint.items():
            module = name.removesuffix(".weight")
            if module == name or len(shape) != 2 or not check_target_module_exists(config, module):
                continue
            fan_out, fan_in = shape[::-1] if transposed else shape
            shapes[f"{_PREFIX}{module}.lora_A.weight"] = (r, fan_in)
            shapes[f"{_PREFIX}{module}.lora_B.weight"] = (fan_out, r)
            scaling[module] = scale
        if not shapes:
            raise ValueError(f"the LoraConfig's target_modules {config.target_modules} match no layer of the model")
        initial = {k: torch.zeros(s) for k, s in shapes.items()}
        return cls(config, shapes, scaling, initial)

    def is_initial_zero(self) -> bool:
        """Whether the version-0 adapter changes nothing (every ``lora_B`` is 0, as PEFT initializes it)."""
        return all(not bool(t.any()) for k, t in self.initial.items() if k.endswith(".lora_B.weight"))

    def tensors(self, weights) -> dict[str, torch.Tensor]:
        """The adapter's tensors from an update: the PEFT model, its :func:`adapter_weights` or its full
        ``state_dict()`` (a mapping or a TensorDict); a ``KeyError`` / ``ValueError`` naming what does not fit."""
        if weights is None:
            raise ValueError("a LoRA policy takes the adapter's weights: pass the PEFT model (or "
                             "adapter_weights(model)); None (reload the checkpoint) has no adapter to reload")  # fmt: skip
        weights = adapter_weights(weights) if is_lora_model(weights) else weights_of(weights)
        if any(_LORA_NAME.search(k) for k in weights) and not all(k in self.shapes for k in weights):
            weights = {_LORA_NAME.sub(r".\1.weight", k): v for k, v in weights.items() if _LORA_NAME.search(k)}
        missing, extra = sorted(set(self.shapes) - set(weights)), sorted(set(weights) - set(self.shapes))
        if missing or extra:
            hint = "" if any(".lora_" in k for k in weights) else " (these are not LoRA adapter tensors)"
            raise KeyError(f"the update does not fit the policy's LoRA adapter{hint}: missing {len(missing)} tensors, "
                           f"e.g. {missing[:2]}, unexpected {extra[:2]}; pass the PEFT model being trained "
                           "(update_policy_weights_(model)) or adapter_weights(model)")  # fmt: skip
        wrong = [(k, tuple(v.shape), self.shapes[k]) for k, v in weights.items() if tuple(v.shape) != self.shapes[k]]
        if wrong:
            raise ValueError(f"LoRA tensors of the wrong shape (name, got, expected): {wrong[:3]}; the update comes "
                             "from an adapter of another rank or model")  # fmt: skip
        return {k: v.detach() for k, v in weights.items()}

    @torch.no_grad()
    def merge(self, base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``base`` (transformers names) with ``lora_B @ lora_A * scaling`` added to every adapted layer."""
        out = dict(base)
        for module, scale in self.scaling.items():
            delta = adapter[f"{_PREFIX}{module}.lora_B.weight"] @ adapter[f"{_PREFIX}{module}.lora_A.weight"]
            weight = out[f"{module}.weight"]
            out[f"{module}.weight"] = weight + (delta.T if self.is_transposed else delta).to(weight.dtype) * scale
        return out

    def load_into(self, model, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy checked adapter ``tensors`` into the PEFT ``model``'s active adapter, in place."""
        if self.target is None or self.target[0] is not model:  # the parameters of a model, found once
            self.target = (model, adapter_parameters(model, active_adapter(model)))
        with torch.no_grad():
            for name, tensor in tensors.items():
                self.target[1][name].copy_(tensor)


class AdapterTransport(DirectoryTransport):
    """Adapters as PEFT directories ``root/lora-<token>-v<version>``, whose name is the adapter's name on the servers
    (``<token>`` is random per transport: several policies loading adapters into one server never share a name).

    Example:
        >>> import os
        >>> from peft import LoraConfig
        >>> spec = AdapterSpec.of(LoraConfig(r=2, target_modules=["q"]), {"q.weight": (4, 3)})
        >>> transport = AdapterTransport(spec, reload=lambda h: [("/load_lora_adapter", {"lora_path": h})])
        >>> handle = transport.publish(list(spec.initial.items()), version=1)
        >>> sorted(os.listdir(handle)), transport.load_calls(handle)[0][0]
        (['adapter_config.json', 'adapter_model.safetensors'], '/load_lora_adapter')
        >>> transport.close()

    ``reload``: the calls that load one adapter directory into a server (its dialect's ``adapter_calls``; ``None`` for
    an engine in this process, which loads the directory itself).
    """

    def __init__(self, spec: AdapterSpec, root=None, *, keep: int = 2, reload=None) -> None:
        super().__init__(root, keep=keep, reload=reload)
        self.spec, self.prefix = spec, f"lora-{secrets.token_hex(4)}-v"

    def write(self, directory: Path, items: list[tuple[str, torch.Tensor]]) -> None:
        save_tensors(items, directory / "adapter_model.safetensors")
        self.spec.config.save_pretrained(str(directory))  # adapter_config.json


def lora_engine_kwargs(engine_kwargs: Mapping, lora) -> dict:
    """``engine_kwargs`` with LoRA switched on (unless ``enable_lora=False`` is given): rank and one adapter slot."""
    out = dict(engine_kwargs)
    if out.setdefault("enable_lora", True):
        rank = lora_rank(lora)
        out.setdefault("max_lora_rank", next((r for r in _VLLM_RANKS if r >= rank), rank))
        out.setdefault("max_loras", 1)
    return out


class EngineAdapters:
    """The adapter versions of an in-process vLLM engine: each update is a new directory and a new ``LoRARequest``."""

    def __init__(self, llm, spec: AdapterSpec) -> None:
        from vllm.lora.request import LoRARequest

        self.llm, self.spec, self.make_request = llm, spec, LoRARequest
        self.transport = AdapterTransport(spec)
        self.request = None
        """The ``LoRARequest`` every wave is sampled with."""
        self.load(spec.initial)

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write ``tensors`` as a new adapter, load it into the engine, drop the previous one."""
        number = next(_LORA_IDS)
        handle = self.transport.publish(list(tensors.items()), number)
        request = self.make_request(Path(handle).name, number, handle)
        try:
            self.llm.llm_engine.add_lora(request)
        except Exception as err:  # vLLM raises its own types for an adapter it cannot load
            raise ValueError(f"vLLM could not load the LoRA adapter ({type(err).__name__}: {err}); check that the "
                             f"engine's max_lora_rank holds rank {lora_rank(self.spec.config)} and that it adapts "
                             f"only layers vLLM supports, or {MERGE_FIX}") from err  # fmt: skip
        previous, self.request = self.request, request
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)

    def close(self) -> None:
        self.transport.close()
