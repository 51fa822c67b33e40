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
    recorder, prompts, and the prompt source's fingerprint (``PromptSource.fingerprint``)."""
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
        "prompt_source": _fingerprint(collector),
    }  # fmt: skip


def load_collector_state(collector, state: dict, *, strict: bool = True) -> None:
    """Restore :func:`collector_state` into ``collector`` (same mode, source and env shape; with ``strict``, the
    same prompts: a checkpoint without a fingerprint, older ones, is not checked; one with a fingerprint of 16 sampled
    prompts, before every prompt was hashed, is refused unless ``strict=False``)."""
    for name, mine in (("mode", collector.mode.value), ("source_kind", collector.source.kind.value)):
        if state.get(name, mine) != mine:
            raise ValueError(f"this checkpoint was taken with {name}={state[name]!r}, this collector has {mine!r}")
    theirs, mine = state.get("prompt_source"), _fingerprint(collector)
    if strict and theirs is not None and mine is not None and theirs != mine:
        if "scheme" not in theirs and (theirs["count"], theirs["first"]) == (mine["count"], mine["first"]):
            raise ValueError(f"this checkpoint's fingerprint of its prompts ({_summary(theirs)}) is of the old kind, "
                             "a digest of 16 sampled prompts, which cannot be compared with this env's (a digest of "
                             f"every prompt: {_summary(mine)}); if the env holds the checkpoint's prompts, load it "
                             "with collector.load_state_dict(state, strict=False), and the next checkpoint carries "
                             "the new fingerprint")  # fmt: skip
        raise ValueError(f"this checkpoint was taken on other prompts ({_summary(theirs)}) than this collector's env "
                         f"holds ({_summary(mine)}): its cursor and slots would resume in another prompt list. Build "
                         "the env on the checkpoint's prompts, or pass collector.load_state_dict(state, strict=False) "
                         "to resume over these prompts anyway")  # fmt: skip
    state = copy.deepcopy(state)
    collector.base_env.load_state_dict(state["env"])
    load_policy_state(collector.policy, state["policy"])
    collector.source.load_state_dict(state["source"])
    collector.recorder.load_state_dict(state["recorder"])
    collector.pending = state["pending"]
    collector.steps_done, collector.is_started = state["steps_done"], state["is_started"]
    collector.prompts = PromptTable.from_state_dict(state["prompts"])
    collector.counters.update(state["counters"])


def _fingerprint(collector) -> dict | None:
    fingerprint = getattr(collector.base_env.source, "fingerprint", None)
    return None if fingerprint is None else fingerprint()


def _summary(fingerprint: dict) -> str:
    return f"{fingerprint['count']} prompts, digest {fingerprint['digest']}, first {fingerprint['first']!r}"
