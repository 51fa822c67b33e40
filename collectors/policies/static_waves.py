"""A whole wave decoded with the stepping path's fixed-shape step: the waves of ``TransformersPolicy(decode="static")``,
``decode="graph"`` and ``decode="compile"``.

``model.generate`` grows a dynamic cache by a column per token and launches every kernel from the host; a policy
that decodes with a :class:`~tokengym.collectors.policies.static_kv_cache.StaticSlotKVCache` (and, on CUDA, a
:class:`~tokengym.collectors.policies.graph_decode.GraphDecode` replaying it, or a
:class:`~tokengym.collectors.policies.compiled_decode.CompiledDecode` running it compiled) runs its waves on that same
step:
the wave's rows are prefilled into the cache's first rows (prompts shared within a group as when stepping), then
each step feeds every row's last token, samples, and stops a row at an end id or its budget.

Uncaptured (``decode="static"``) the sampling draws from the policy's generator over the wave's rows exactly as
``generate`` does (one uniform per row and step, in the request's order), so a wave gives ``generate``'s tokens and
log-probs for the same generator state; it stops once every row ended, where ``generate`` would go on while a row
past its budget has not yet sampled an end id (then only the generator's state after the wave differs). The
captured step samples all of the cache's rows: its tokens are the uncaptured step's where the wave fills every row.
One device-to-host copy per step (the sampled ids: which rows ended).
"""

from __future__ import annotations

import threading

import torch

from tokengym.collectors.policies.compiled_decode import CompiledDecode
from tokengym.collectors.policies.graph_decode import GraphDecode
from tokengym.collectors.policies.sampling import SamplingConfig, sample_tokens
from tokengym.collectors.policies.static_kv_cache import StaticSlotKVCache
from tokengym.llm_envs.waves import WaveRequest

__all__ = ["step_wave"]


@torch.inference_mode()
def step_wave(cache: StaticSlotKVCache, request: WaveRequest, *, sampling: SamplingConfig, generator: torch.Generator,
              with_raw: bool, interrupt: threading.Event, graph: GraphDecode | CompiledDecode | None = None,
              pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Decode ``request`` on ``cache`` (its rows ``0..n-1``, ``n = len(request)`` at most the cache's rows):
    ``(actions, log_probs, raw_log_probs)``, each (n, T) on the host (``raw`` ``None`` without ``with_raw``).

    The wave stops after the token being generated once ``interrupt`` is set or ``request.min_finished`` rows ended.
    The cache's rows hold the wave afterwards: the next env step prefills its slots again.
    """
    rows = int(cache.length.shape[0])
    n = len(request)
    if n > rows:
        raise ValueError(f"a wave of {n} rows does not fit the static cache's {rows} rows")
    lengths = torch.tensor([len(p) for p in request.prompts], dtype=torch.int64)
    tokens = torch.full((rows, int(lengths.max())), pad_token_id, dtype=torch.int64)
    for i, ids in enumerate(request.prompts):  # one copy per sequence and wave
        tokens[i, : len(ids)] = ids
    seq_len = torch.zeros(rows, dtype=torch.int64)
    seq_len[:n] = lengths
    live = torch.zeros(rows, dtype=torch.bool)
    live[:n] = True
    # trajectory ids no row holds: every wave row is prefilled (and an env step after the wave prefills its slots)
    fresh = min(int(cache.traj.min()), 0) - 1 - torch.arange(rows, dtype=torch.int64)
    cache.sync(tokens, seq_len, fresh, live)
    feed = torch.zeros(rows, dtype=torch.int64)
    feed[:n] = tokens[torch.arange(n), lengths - 1]
    budget, eos = request.max_new_tokens, torch.tensor(request.eos_token_ids, dtype=torch.int64)
    ended = torch.zeros(n, dtype=torch.bool)
    actions, log_probs, raws = [], [], []
    for step in range(int(budget.max())):
        if graph is not None:
            action, logp, raw = (t if t is None else t[:n].clone() for t in graph.step(feed, live))
        else:
            logits = cache.decode(feed, live)[:n]
            action, logp, raw = sample_tokens(logits, sampling, generator, with_raw_log_prob=with_raw)
        host = action.cpu()  # the step's one synchronization: which rows ended (and the ids the wave returns)
        actions.append(host)
        log_probs.append(logp)
        raws.append(raw)
        ended |= torch.isin(host, eos) | (budget <= step + 1)
        live[:n] = ~ended
        feed[:n] = host
        if bool(ended.all()) or interrupt.is_set():
            break
        if request.min_finished is not None and int(ended.sum()) >= request.min_finished:
            break
    return torch.stack(actions, 1), torch.stack(log_probs, 1).cpu(), torch.stack(raws, 1).cpu() if with_raw else None
