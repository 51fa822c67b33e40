"""Trees of multi-turn episodes (collectors/branching.py, TokenEnv.fork): TurnRule, SegmentRule and EntropyRule on
feedback turns, on the step source and on TransformersPolicy waves. A tree that ends short gets its missing leaves as
fresh episodes of its prompt; entropy forks lie in the chain's last turn (the env cannot roll an episode back)."""

import pytest
import torch
from collector_helpers import tree_leaves

from tokengym.collectors import CollectorOptions, TokenCollector
from tokengym.collectors.branching import EntropyRule, SegmentRule, TurnRule
from tokengym.collectors.policies import TransformersPolicy
from tokengym.llm_envs import TokenEnv, keys
from tokengym.llm_envs.turns import Turn, TurnHandler
from tokengym.testing import tiny_model

PROMPTS = ["What is 12 + 7?", "hi", "Reverse the string abc:", "a b c d e f g h", "1+1=", "count down 5 4"]
TURN_TOKENS = 4  # each turn ends at 4 tokens at the latest: every episode has its max_turns turns


class _Counting(TurnHandler):
    """Rewards each turn with the episode's turn count so far (per-episode state, copied at a fork); feedback until
    the last turn."""

    def __init__(self, max_turns):
        self.turns_of, self.forked, self.last = {}, [], max_turns - 1

    def end_turns(self, turns):
        out = []
        for episode, turn in zip(turns.episodes, turns.turns, strict=True):
            self.turns_of[episode] = self.turns_of.get(episode, 0) + 1
            out.append(Turn(float(self.turns_of[episode]), feedback=None if turn >= self.last else "go on"))
        return out

    def fork(self, parent, child):
        self.forked.append((parent.episode, child.episode))
        self.turns_of[child.episode] = self.turns_of.get(parent.episode, 0)


def multi_turn_env(tokenizer, max_turns, *, batch_size=8, handler=None):
    return TokenEnv(PROMPTS, tokenizer, turns=handler or _Counting(max_turns), max_turns=max_turns,
                    batch_size=batch_size, group_size=4, max_new_tokens=TURN_TOKENS * max_turns,
                    max_turn_tokens=TURN_TOKENS, max_length=160)  # fmt: skip


def check_tree_batch(batch, group_size):
    """Whole trees; each leaf's steps up to its fork are its parent's (same tokens and log-probs), its own after."""
    traj, action, logp = batch[keys.TRAJ_ID][:, 0], batch[keys.ACTION], batch[keys.ACTION_LOG_PROB]
    for _, i, fork, parent, _ in tree_leaves(batch, group_size):
        if parent >= 0:
            p = traj.tolist().index(parent)
            assert torch.equal(action[i, :fork], action[p, :fork]) and torch.equal(logp[i, :fork], logp[p, :fork])


CASES = {
    "turn": (lambda: TurnRule(2), 2),  # one turn boundary: 2 leaves forked there, 2 fresh episodes of the prompt
    "segment": (lambda: SegmentRule(5, 2), 2),  # forks in the second turn (the first has <= 4 tokens), the rest fresh
    "entropy": (lambda: EntropyRule(), 3),  # one chain, forked at its most surprising tokens of its last turn
}


@pytest.mark.parametrize("source", ["step", "wave"])
@pytest.mark.parametrize("case", list(CASES))
def test_multi_turn_trees_are_whole_and_every_leaf_is_teacher_forced(tokenizer, case, source):
    rule, max_turns = CASES[case]
    model = tiny_model(tokenizer, seed=0)
    env = multi_turn_env(tokenizer, max_turns)
    collector = TokenCollector(env, TransformersPolicy(model, env, seed=0), mode="trajectories", batch_size=8,
                               source=source, options=CollectorOptions(tree=rule()))  # fmt: skip
    batch = next(iter(collector))
    check_tree_batch(batch, 4)
    forced = TransformersPolicy(model, env).teacher_forced_log_probs(batch)
    mask = batch[keys.MASK]
    torch.testing.assert_close(batch[keys.ACTION_LOG_PROB][mask], forced[mask], atol=1e-4, rtol=0)
    fork, parent, turn = batch[keys.FORK_INDEX][:, 0], batch[keys.PARENT_ID][:, 0], batch[keys.TURN]
    assert (fork > 0).any()  # the rule forked inside episodes
    rewards = batch[keys.REWARD].squeeze(-1).sum(1)
    whole = fork == 0  # the roots and the fresh episodes: every turn from the first, counted from 0 by the handler
    assert (turn[whole, 0] == 0).all() and (rewards[whole] == sum(range(1, max_turns + 1))).all()
    traj = batch[keys.TRAJ_ID][:, 0].tolist()
    last = mask.sum(1) - 1
    for i in (fork > 0).nonzero().squeeze(-1).tolist():  # a fork lies in a turn its parent had when it forked
        p = traj.index(int(parent[i]))
        assert turn[i, fork[i]] == turn[p, fork[i]]
        if case == "entropy":  # a finished chain forks in its last turn
            assert turn[p, fork[i]] == turn[p, last[p]] == max_turns - 1
    if case != "entropy":
        assert collector.metrics["tree_leaves_from_prompt"] >= 2  # each tree's 2 missing leaves: fresh episodes


def test_a_fork_at_step_0_past_the_first_turn_starts_a_fresh_episode_of_the_prompt(tokenizer):
    handler = _Counting(2)
    env = multi_turn_env(tokenizer, 2, batch_size=3, handler=handler)
    obs = env.reset()
    prompt = env.history(0).clone()
    for action in (40, 41, 42, 43, 44):  # turn 0 ends at its 4th token, turn 1 goes on
        _, obs = env.step_and_maybe_reset(obs.set(keys.ACTION, torch.full((3,), action)))
    assert int(obs[keys.TURN][0]) == 1 and int(obs[keys.RESPONSE_LEN][0]) == 5
    env.vacate([1, 2])
    with pytest.raises(ValueError, match=r"forks at a step in \[4, 5\] .* or at 0 \(a fresh episode"):
        env.fork(0, [2], at=2)  # a step of the first turn: its feedback cannot be rolled back
    parent_episode = env.held_episode(0).episode
    trajs = env.fork(0, [1, 2], at=0, sample_ids=[1, 2])
    obs = env.observation()
    assert len(set(trajs)) == 2 and not set(trajs) & {env.slot_trajectory(0)}
    for b in (1, 2):
        assert torch.equal(env.history(b), prompt)  # the prompt alone, no turn or feedback
        assert int(obs[keys.TURN][b]) == 0 and int(obs[keys.RESPONSE_LEN][b]) == 0
        assert int(obs[keys.PROMPT_LEN][b]) == int(obs[keys.SEQ_LEN][b]) == prompt.numel()
        assert env.held_episode(b).episode not in (parent_episode, *[e for _, e in handler.forked])
    assert obs[keys.SAMPLE_ID][1:].tolist() == [1, 2] and obs[keys.ACTIVE].all()
    assert not handler.forked  # a fresh episode copies no per-episode state
    for _ in range(TURN_TOKENS):
        _, obs = env.step_and_maybe_reset(obs.set(keys.ACTION, torch.full((3,), 45)))
    assert obs[keys.TURN][1:].tolist() == [1, 1]  # the fresh episodes' first turn ended, as a refill's would
