"""Checkpoints of a TokenCollector as plain data (tensors, numbers, strings, lists, dicts).

``torch.save(collector.state_dict(), path)`` and ``torch.load(path, weights_only=True)`` round-trip
with no unpickling of arbitrary classes.
"""

from __future__ import annotations

import copy

from tokengym.collectors.policies.protocol import load_policy_state, policy_state
from tokengym.llm_envs import PromptTable

__all__ = ["collector_state", "load_collector_state"]


def collector_state(collector, *, include_cache: bool = True) -> dict:
    """Env, policy (its ``collection_state``: RNG, version, cache unless ``include_cache`` is False), source,
    recorder, prompts."""
    policy = policy_state(collector.policy, include_cache=include_cache)
    # every part is already a copy (the env, policy, source and recorder clone what they hand out)
    return {
        "env": collector.base_env.state_dict(),
        "policy": policy,
        "source": collector.source.state_dict(),
        "recorder": collector.recorder.state_dict(),
        "pending": None if collector.pending is None else {k: v.clone() for k, v in collector.pending.items()},
        "steps_done": collector.steps_done,
        "is_started": collector.is_started,
        "prompts": copy.deepcopy(collector.prompts.state_dict()),
        "counters": dict(collector.counters),
        "mode": collector.mode.value,
        "source_kind": collector.source.kind.value,
    }  # fmt: skip


def load_collector_state(collector, state: dict) -> None:
    """Restore :func:`collector_state` into ``collector`` (same mode, source and env shape)."""
    for name, mine in (("mode", collector.mode.value), ("source_kind", collector.source.kind.value)):
        if state.get(name, mine) != mine:
            raise ValueError(f"this checkpoint was taken with {name}={state[name]!r}, this collector has {mine!r}")
    state = copy.deepcopy(state)
    collector.base_env.load_state_dict(state["env"])
    load_policy_state(collector.policy, state["policy"])
    collector.source.load_state_dict(state["source"])
    collector.recorder.load_state_dict(state["recorder"])
    collector.pending = state["pending"]
    collector.steps_done, collector.is_started = state["steps_done"], state["is_started"]
    collector.prompts = PromptTable.from_state_dict(state["prompts"])
    collector.counters.update(state["counters"])
