"""Offline tiny models and tokenizers, and synthetic collected batches, for tests, examples and benchmarks.

Nothing is downloaded: the tokenizer and models come from ``tokengym.llm_envs.tiny_models`` (the vision-language
ones, a tiny Qwen2-VL and its processor, from ``tokengym.llm_envs.tiny_vl_models``);
:func:`make_trajectory_batch` builds a collected batch without an env or a model.

vLLM (in process, ``VLLMPolicy``, or a server, ``LocalVLLMServer`` + ``VLLMServerPolicy``) serves
``tiny_model(tok, size="small")`` on CPU: its head size is 64, and vLLM's CPU attention runs head sizes of 32 and up
(32, 64, 80, ...). The default ``size="tiny"`` has head size 16: ``VLLMPolicy`` and ``VLLMServerPolicy`` refuse it at
construction (a server would load it, then its engine would die at the first request). Save the model and the
tokenizer with ``save_pretrained`` into one directory for vLLM::

    tok = tiny_tokenizer(); model = tiny_model(tok, size="small")
    model.save_pretrained(path); tok.save_pretrained(path)
    with LocalVLLMServer(path) as server: ...
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from tensordict import TensorDict

from tokengym.llm_envs import keys
from tokengym.llm_envs.prompt_table import PromptTable
from tokengym.llm_envs.tiny_models import (
    CHAT_TEMPLATE,
    FAMILIES,
    SIZES,
    TOOL_CHAT_TEMPLATE,
    tiny_model,
    tiny_reward_model,
    tiny_tokenizer,
)
from tokengym.llm_envs.tiny_vl_models import (
    VL_CHAT_TEMPLATE,
    ImageOnlyQwen2VLProcessor,
    tiny_vl_model,
    tiny_vl_processor,
    tiny_vl_tokenizer,
)

__all__ = [
    "CHAT_TEMPLATE",
    "FAMILIES",
    "SIZES",
    "TOOL_CHAT_TEMPLATE",
    "VL_CHAT_TEMPLATE",
    "ImageOnlyQwen2VLProcessor",
    "PublishAfter",
    "make_trajectory_batch",
    "tiny_model",
    "tiny_reward_model",
    "tiny_tokenizer",
    "tiny_vl_model",
    "tiny_vl_processor",
    "tiny_vl_tokenizer",
    "to_steps_layout",
]


def make_trajectory_batch(lengths, rewards=None, *, group_size: int = 1, steps: int | None = None,
                          prompt_len: int = 3, vocab: int = 50, truncated=None, seed: int = 0) -> TensorDict:  # fmt: skip
    """A TRAJECTORIES batch [N, T]: row ``i`` is one trajectory of ``lengths[i]`` tokens, right-padded.

    Args:
        lengths: response length of each trajectory (>= 1).
        rewards: task reward of each trajectory (at its last step); random by default.
        group_size: consecutive rows share a group id (``group_id = i // group_size``).
        steps: ``T`` (>= max length); defaults to the longest trajectory.
        prompt_len: every prompt has ``prompt_len + group_id % 3`` tokens.
        vocab: token ids are drawn in ``[2, vocab)``.
        truncated: bool per trajectory: truncated (no EOS) instead of terminated.
        seed: seed of the random tokens and log-probs.

    Example:
        >>> b = make_trajectory_batch([2, 3], [1.0, 0.0], group_size=2)
        >>> b.batch_size, b[keys.MASK].tolist(), b[keys.REWARD].squeeze(-1).tolist()
        (torch.Size([2, 3]), [[True, True, False], [True, True, True]], [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    """
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    n = len(lengths)
    width = int(lengths.max()) if steps is None else steps
    rewards = torch.rand(n, generator=gen) if rewards is None else torch.as_tensor(rewards, dtype=torch.float32)
    truncated = torch.zeros(n, dtype=torch.bool) if truncated is None else torch.as_tensor(truncated, dtype=torch.bool)
    t = torch.arange(width)
    mask = t < lengths[:, None]  # (N, T)
    last = t == (lengths - 1)[:, None]
    rows = torch.arange(n)
    group = (rows // group_size)[:, None].expand(n, width)
    prompt_lens = prompt_len + group[:, 0] % 3
    log_prob = -torch.rand(n, width, generator=gen) * 3 * mask
    table = PromptTable(pad_token_id=0)
    for g in group[:, 0].unique().tolist():
        table.add(g, torch.randint(2, vocab, (prompt_len + g % 3,), generator=gen))
    i64 = {"dtype": torch.int64}
    td = TensorDict(
        {
            keys.ACTION: torch.randint(2, vocab, (n, width), generator=gen) * mask,
            keys.ACTION_LOG_PROB: log_prob,
            keys.REF_LOG_PROB: log_prob - torch.rand(n, width, generator=gen) * mask,
            keys.TRAJ_ID: rows[:, None].expand(n, width).clone(),
            keys.GROUP_ID: group.clone(),
            keys.SAMPLE_ID: (rows % group_size)[:, None].expand(n, width).clone(),
            keys.TURN: torch.zeros(n, width, **i64),
            keys.POLICY_VERSION: torch.zeros(n, width, **i64),
            keys.RESPONSE_LEN: t.expand(n, width) * mask,
            keys.PROMPT_LEN: prompt_lens[:, None].expand(n, width) * mask,
            keys.SEQ_LEN: (prompt_lens[:, None] + t) * mask,
            keys.ACTIVE: mask.clone(),
            keys.REWARD: (last * rewards[:, None]).unsqueeze(-1),
            keys.DONE: last.unsqueeze(-1),
            keys.TERMINATED: (last & ~truncated[:, None]).unsqueeze(-1),
            keys.TRUNCATED: (last & truncated[:, None]).unsqueeze(-1),
            keys.MASK: mask,
        },
        batch_size=[n, width],
    )
    td.set_non_tensor(keys.PROMPTS, table)
    return td


def to_steps_layout(batch: TensorDict, rows: int) -> TensorDict:
    """Pack the trajectories of a TRAJECTORIES batch back to back into ``rows`` rows (a STEPS-style batch).

    Trajectory ``i`` goes to row ``i % rows``; rows are right-padded with ``keys.MASK`` False.

    Example:
        >>> s = to_steps_layout(make_trajectory_batch([2, 1, 3]), rows=2)
        >>> s[keys.TRAJ_ID].tolist(), s[keys.MASK].tolist()
        ([[0, 0, 2, 2, 2], [1, 0, 0, 0, 0]], [[True, True, True, True, True], [True, False, False, False, False]])
    """
    mask = batch.get(keys.MASK)
    lengths = mask.sum(-1)
    n = len(lengths)
    row = torch.arange(n) % rows
    # start column of trajectory i in its row: the lengths of the earlier ones in that row
    same_row_before = (row[None, :] == row[:, None]) & (torch.arange(n)[None, :] < torch.arange(n)[:, None])
    start = (same_row_before * lengths[None, :]).sum(-1)
    width = int(torch.zeros(rows, dtype=torch.int64).index_add_(0, row, lengths).max())
    data = batch.exclude(keys.PROMPTS)[mask]
    traj = torch.arange(n)[:, None].expand_as(mask)[mask]
    col = (start[:, None] + torch.arange(mask.shape[1]))[mask]

    def place(x):
        out = x.new_zeros((rows, width, *x.shape[1:]))
        out[row[traj], col] = x
        return out

    out = data.apply(place, batch_size=[rows, width])
    filled = torch.zeros(rows, width, dtype=torch.bool)
    filled[row[traj], col] = True
    out.set(keys.MASK, filled)
    out.set_non_tensor(keys.PROMPTS, batch.get_non_tensor(keys.PROMPTS))
    return out


class PublishAfter(threading.Event):
    """A wave policy's ``interrupt`` event that publishes weights at its ``k``-th check: a trainer whose update lands
    after a known number of decode steps of a wave (partial rollouts), not on a timer.

    ``TransformersPolicy`` checks its ``interrupt`` once when a wave starts and once per decode step; at the ``k``-th
    check ``publish()`` runs in a new thread (as a trainer thread would publish) and is waited for, so the collector
    queues the update and sets this event, and the wave stops after that step.

    Example:
        >>> import copy
        >>> from tokengym.collectors import TokenCollector
        >>> from tokengym.collectors.policies import TransformersPolicy
        >>> from tokengym.llm_envs import TokenEnv
        >>> tok = tiny_tokenizer(); model = tiny_model(tok)
        >>> env = TokenEnv(["1+1=", "2+3="], tok, batch_size=2, max_new_tokens=12, model_config=model.config)
        >>> policy = TransformersPolicy(copy.deepcopy(model), env)
        >>> policy.interrupt = PublishAfter(4, lambda: collector.update_policy_weights_(model.state_dict()))
        >>> collector = TokenCollector(env, policy, mode="trajectories", batch_size=2, source="wave")
        >>> batch = next(iter(collector))
        >>> collector.metrics["interrupted_sequences"] > 0, policy.version
        (True, 1)
    """

    def __init__(self, k: int, publish: Callable[[], object]) -> None:
        super().__init__()
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an int >= 1 (the check at which weights are published), got {k!r}")
        self.k, self.publish, self.checks = k, publish, 0

    def is_set(self) -> bool:
        self.checks += 1
        if self.checks == self.k:
            trainer = threading.Thread(target=self.publish, name="tokengym-test-trainer")
            trainer.start()
            trainer.join()
        return super().is_set()
