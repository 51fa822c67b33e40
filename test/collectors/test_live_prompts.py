"""A batch's prompt table keeps the own prompt of a trajectory that was still in a slot when an earlier batch was
committed (the later part of a split episode: its prompt is not its group's)."""

from __future__ import annotations

import torch

from tokengym.collectors import TokenCollector
from tokengym.llm_envs import TokenEnv, keys
from tokengym.llm_envs.turns import Turn, TurnHandler
from tokengym.testing import tiny_tokenizer

REWRITE = [{"role": "user", "content": "from the top"}]


class Rewrites(TurnHandler):
    """Each episode's first turn ends its trajectory; the episode goes on in a new one whose prompt is REWRITE."""

    may_split = True

    def __init__(self) -> None:
        self.split: set[int] = set()  # episodes that went on in a new trajectory

    def end_turns(self, turns):
        out = []
        for episode in turns.episodes:
            out.append(Turn(1.0) if episode in self.split else Turn(0.0, REWRITE, new_trajectory=True))
            self.split.add(episode)
        return out


def _policy(end: int, first_prompt_len: int):
    """Slot 0 writes two tokens a trajectory; slot 1 one token in an episode's first trajectory and eight in its second:
    slot 1's second part is in its slot when slot 0's episodes fill a batch."""

    def policy(td):
        pos, prompt_len = (td.get(keys.SEQ_LEN) - td.get(keys.PROMPT_LEN)).tolist(), td.get(keys.PROMPT_LEN).tolist()
        length = [2, 1 if prompt_len[1] <= first_prompt_len else 8]
        action = [end if pos[b] + 1 >= length[b] else 5 for b in range(2)]
        td.set(keys.ACTION, torch.tensor(action))
        td.set(keys.ACTION_LOG_PROB, torch.zeros(2))
        return td.set(keys.POLICY_VERSION, torch.zeros(2, dtype=torch.int64))

    return policy


def test_a_live_trajectorys_own_prompt_survives_the_commit_of_a_batch():
    tok = tiny_tokenizer()
    env = TokenEnv(["a", "b", "c", "d", "e", "f"], tok, turns=Rewrites(), max_turns=2, batch_size=2,
                   max_new_tokens=24, max_length=96)  # fmt: skip
    first = int(env.reset()[keys.PROMPT_LEN].max())  # the prompts of the episodes' first trajectories
    policy = _policy(tok.convert_tokens_to_ids("<|end|>"), first)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=2, source="step")
    later_parts = 0
    for i, batch in enumerate(collector):
        table, traj = batch[keys.PROMPTS], batch[keys.TRAJ_ID][:, 0].tolist()
        episode = (batch[keys.GROUP_ID][:, 0] * 1000 + batch[keys.SAMPLE_ID][:, 0]).tolist()
        for t, e in zip(traj, episode, strict=True):
            if t != min(u for u, f in zip(traj, episode, strict=True) if f == e):  # an episode's later part
                later_parts += 1
                own = table.trajectory_prompt(t)
                assert own is not None, f"batch {i}: trajectory {t} lost its own prompt"
                assert "from the top" in tok.decode(own)
        if i == 3:
            break
    collector.shutdown()
    assert later_parts >= 3
