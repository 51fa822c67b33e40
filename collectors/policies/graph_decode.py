"""A TransformersPolicy's decode step and its sampling, captured in one CUDA graph and replayed every env step.

The step runs over a :class:`~tokengym.collectors.policies.static_kv_cache.StaticSlotKVCache`, whose buffers keep
their shapes and addresses: the graph holds the model's forward over them, the cache's in-place column writes and
:func:`~tokengym.collectors.policies.sampling.sample_tokens` with every sampling option. What changes from step to step
goes in through two small buffers the graph reads: the step's inputs (B, 4) (one host-to-device copy) and the
sampling's uniforms, drawn outside the graph from the policy's generator (``uniform_`` draws what ``torch.rand``
draws, so a captured step samples what an uncaptured one would from the same generator state). Prefill, refill,
forks, multi-turn extensions and teacher forcing stay outside: they write the same buffers in place. A weight update
copies into the model's parameters in place (``load_state_dict``), so the next replay uses the new weights; new
buffers (a window that outgrew them) or a new cache (a dtype cast) capture again.
"""

from __future__ import annotations

import time

import torch

from tokengym.collectors.policies.sampling import SamplingConfig, sample_tokens
from tokengym.collectors.policies.static_kv_cache import StaticSlotKVCache

__all__ = ["GraphDecode"]


class GraphDecode:
    """One decode step of ``cache`` and the sampling of its next tokens, captured once per buffer layout.

    Args:
        cache: the policy's :class:`StaticSlotKVCache`, on a CUDA device.
        sampling: the policy's :class:`SamplingConfig`.
        generator: the policy's generator, on the cache's device.
        with_raw: also compute the raw log-prob (``return_raw_log_prob``).
    """

    def __init__(self, cache: StaticSlotKVCache, sampling: SamplingConfig, generator: torch.Generator, *,
                 with_raw: bool) -> None:  # fmt: skip
        if cache.device.type != "cuda":
            raise ValueError(f"GraphDecode captures CUDA graphs; the cache is on {cache.device}: decode with the "
                             "static cache uncaptured there (TransformersPolicy(decode='static'))")  # fmt: skip
        self.cache, self.sampling, self.generator, self.with_raw = cache, sampling, generator, with_raw
        self.captures = 0
        """Graphs captured so far (one per buffer layout)."""
        self.capture_seconds = 0.0
        """Seconds the captures took (warm-up steps included)."""
        self._graph: torch.cuda.CUDAGraph | None = None
        self._layout = -1
        self._pool = None  # captures after the first share the first one's memory pool

    def step(self, tokens: torch.Tensor, live: torch.Tensor):
        """One decode step of every slot (host ``tokens`` (B,) and ``live`` (B,)): ``(action, log_prob, raw)`` on
        the device, in buffers the next step overwrites (``raw`` is ``None`` without ``with_raw``)."""
        host = self.cache.step_inputs(tokens, live)  # may copy the window back to the front, or grow the buffers
        if self._graph is None or self._layout != self.cache.layout:
            self._capture(host)
        self._inputs.copy_(host, non_blocking=True)  # one host-to-device copy
        self._uniforms.uniform_(0, 1, generator=self.generator)
        self._graph.replay()
        self.cache.advance(live)
        return self._outputs

    def _body(self):
        logits = self.cache.step_logits(self._inputs)
        return sample_tokens(logits, self.sampling, self.generator, with_raw_log_prob=self.with_raw,
                             uniforms=self._uniforms)  # fmt: skip

    def _capture(self, host: torch.Tensor) -> None:
        """Capture the step for the cache's current buffers. The warm-up steps run this step's inputs for real: they
        write its column (the replay writes the same values again) and draw nothing from the generator."""
        begin = time.perf_counter()
        device = self.cache.device
        with torch.inference_mode(False):  # ordinary tensors: written in place in and out of inference mode (waves)
            self._inputs = host.to(device, copy=True)  # never the host tensor itself (on the CPU)
            self._uniforms = torch.full((host.shape[0], 1), 0.5, dtype=torch.float64, device=device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for _ in range(2):  # lazy initializations and the allocator's first blocks, outside the graph
                self._body()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: a trainer thread's CUDA work during the capture (AsyncCollector) is not an error
            with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                outputs = self._body()
        except RuntimeError as err:
            raise RuntimeError(f"the decode step of {type(self.cache.model).__name__} could not be captured in a CUDA "
                               f"graph ({err}); decode uncaptured: TransformersPolicy(decode='static') or "
                               "decode='dynamic'") from err  # fmt: skip
        self._pool = graph.pool()
        self._graph, self._outputs, self._layout = graph, outputs, self.cache.layout
        torch.cuda.synchronize(device)
        self.captures += 1
        self.capture_seconds += time.perf_counter() - begin
