"""A TransformersPolicy's decode step and its sampling compiled with ``torch.compile(mode="reduce-overhead")``.

The other way to the GPU's speed beside :class:`~tokengym.collectors.policies.graph_decode.GraphDecode` (a CUDA graph
captured by hand): the same step over the same
:class:`~tokengym.collectors.policies.static_kv_cache.StaticSlotKVCache` buffers and the same two input buffers (the
step's inputs (B, 4), one host-to-device copy, and the sampling's uniforms, drawn outside from the policy's
generator), traced whole by TorchDynamo (``fullgraph=True``: a graph break is an error, not a slow step) and compiled
by Inductor. On CUDA, ``reduce-overhead`` replays the compiled step in CUDA graphs (cudagraph trees); on the CPU the
step runs Inductor's C++ kernels. Every buffer the step reads or writes is marked as a static address, so the graphs
read and write the cache in place and a weight update copied into the parameters (``load_state_dict``) reaches the
next step.

Each policy compiles its own step, and compiles again when the cache's buffers are allocated anew (a window that
outgrew them): a fresh code object per compile, so no policy's guards evict another's and Dynamo's recompile limit is
never reached by a process that builds many policies.
"""

from __future__ import annotations

import time
import types
import warnings

import torch
from torch._dynamo.utils import counters

from tokengym.collectors.policies.sampling import SamplingConfig, sample_tokens
from tokengym.collectors.policies.static_kv_cache import StaticSlotKVCache
from tokengym.llm_envs.errors import TokenGymWarning

__all__ = ["CompiledDecode"]


def _decode_step(cache: StaticSlotKVCache, sampling: SamplingConfig, generator: torch.Generator, with_raw: bool,
                 inputs: torch.Tensor, uniforms: torch.Tensor):  # fmt: skip
    logits = cache.step_logits(inputs)
    return sample_tokens(logits, sampling, generator, with_raw_log_prob=with_raw, uniforms=uniforms)


class CompiledDecode:
    """One decode step of ``cache`` and the sampling of its next tokens, compiled once per buffer layout.

    Args:
        cache: the policy's :class:`StaticSlotKVCache` (any device: CUDA graphs on CUDA, Inductor's kernels elsewhere).
        sampling: the policy's :class:`SamplingConfig`.
        generator: the policy's generator, on the cache's device.
        with_raw: also compute the raw log-prob (``return_raw_log_prob``).
        mode: the ``torch.compile`` mode.
    """

    def __init__(self, cache: StaticSlotKVCache, sampling: SamplingConfig, generator: torch.Generator, *,
                 with_raw: bool, mode: str = "reduce-overhead") -> None:  # fmt: skip
        self.cache, self.sampling, self.generator, self.with_raw, self.mode = cache, sampling, generator, with_raw, mode
        self.captures = 0
        """Steps compiled so far (one per buffer layout)."""
        self.capture_seconds = 0.0
        """Seconds of the first step of each layout (tracing and compiling included)."""
        self._step = None
        self._layout = -1

    def step(self, tokens: torch.Tensor, live: torch.Tensor):
        """One decode step of every slot (host ``tokens`` (B,) and ``live`` (B,)): ``(action, log_prob, raw)`` on
        the device, in buffers the next step may overwrite (``raw`` is ``None`` without ``with_raw``)."""
        host = self.cache.step_inputs(tokens, live)  # may copy the window back to the front, or grow the buffers
        first = self._step is None or self._layout != self.cache.layout
        if first:
            self._compile(host)
            begin, skips = time.perf_counter(), counters["inductor"]["cudagraph_skips"]
        self._inputs.copy_(host, non_blocking=True)  # one host-to-device copy
        self._uniforms.uniform_(0, 1, generator=self.generator)
        torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs were copied out: its graph may be reused
        try:
            with torch.inference_mode():
                out = self._step(self.cache, self.sampling, self.generator, self.with_raw, self._inputs,
                                 self._uniforms)  # fmt: skip
        except Exception as err:
            if not first:
                raise
            self._step = None  # compile again at the next step, and say why this one could not be compiled
            why = (str(err).strip().splitlines() or [""])[0][:300]  # Dynamo's own text goes on for pages
            raise RuntimeError(f"the decode step of {type(self.cache.model).__name__} could not be compiled whole "
                               f"({type(err).__name__}: {why}); decode uncompiled: TransformersPolicy(decode='static') "
                               "or decode='dynamic'") from err  # fmt: skip
        if first:
            if self.cache.device.type == "cuda":
                torch.cuda.synchronize(self.cache.device)
                if counters["inductor"]["cudagraph_skips"] > skips:  # Inductor ran the step without a graph
                    warnings.warn(f"decode='compile' runs the decode step of {type(self.cache.model).__name__} "
                                  "compiled but without CUDA graphs (Inductor skipped them; TORCH_LOGS=cudagraphs "
                                  "prints why): each step launches its kernels from the host; decode='graph' captures "
                                  "the step by hand",
                                  TokenGymWarning, stacklevel=2)  # fmt: skip
            self.captures += 1
            self.capture_seconds += time.perf_counter() - begin
        self.cache.advance(live)
        return out

    def _compile(self, host: torch.Tensor) -> None:
        """A step compiled for the cache's current buffers, each marked as a static address."""
        device = self.cache.device
        with torch.inference_mode(False):  # ordinary tensors: written in place in and out of inference mode (waves)
            self._inputs = host.to(device, copy=True)  # never the host tensor itself (on the CPU)
            self._uniforms = torch.full((host.shape[0], 1), 0.5, dtype=torch.float64, device=device)
        for k, v in self.cache.buffers:
            torch._dynamo.mark_static_address(k)
            torch._dynamo.mark_static_address(v)
        for t in (self._inputs, self._uniforms, *self.cache.step_state()):
            torch._dynamo.mark_static_address(t)
        # a code object of its own: Dynamo keeps compiled code (and counts recompiles) per code object
        fn = types.FunctionType(_decode_step.__code__.replace(), _decode_step.__globals__, "decode_step")
        self._step = torch.compile(fn, mode=self.mode, fullgraph=True, dynamic=False)
        self._layout = self.cache.layout
