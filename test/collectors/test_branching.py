"""Branching rollouts: trees of samples forked in the env and the KV cache (collectors/branching.py, TokenEnv.fork)."""

import pytest
import torch
from collector_helpers import tree_leaves

from tokengym.collectors import CollectorOptions, TokenCollector
from tokengym.collectors.branching import EntropyRule, Fork, SegmentRule, TurnRule
from tokengym.collectors.policies import TransformersPolicy
from tokengym.llm_envs import TokenEnv, keys
from tokengym.llm_envs.turns import Turn, TurnHandler
from tokengym.testing import tiny_model

PROMPTS = ["What is 12 + 7?", "hi", "Reverse the string abc:", "a b c d e f g h", "1+1=", "count down 5 4"]
EOS = list(range(1, 512, 29))  # enough end ids that branches end at different lengths


def length_reward(responses, prompts, metadata):
    return [float(len(r) % 5) for r in responses]


def make_collector(tokenizer, rule, *, group_size=4, batch_size=8, max_new_tokens=12, eos=EOS, seed=0, prompts=PROMPTS,
                   batch=4, model=None):  # fmt: skip
    model = model or tiny_model(tokenizer, seed=0)
    env = TokenEnv(prompts, tokenizer, length_reward, batch_size=batch_size, group_size=group_size,
                   max_new_tokens=max_new_tokens, max_length=64, eos_token_ids=eos)  # fmt: skip
    policy = TransformersPolicy(model, env, seed=seed)
    return TokenCollector(env, policy, mode="trajectories", batch_size=batch, options=CollectorOptions(tree=rule))


def check_tree_batch(batch, group_size):
    """Whole trees; each leaf's shared steps equal its ancestors' steps (same tokens, log-probs, versions)."""
    mask, traj = batch[keys.MASK], batch[keys.TRAJ_ID][:, 0]
    branch, action, logp = batch[keys.BRANCH_ID], batch[keys.ACTION], batch[keys.ACTION_LOG_PROB]
    for rows, i, fork, parent, _ in tree_leaves(batch, group_size):
        if parent >= 0:
            assert fork == 0 or branch[i, fork - 1] != traj[i]
        for j in rows:  # wherever two leaves name the same branch at a step, they hold the same token
            same = (branch[i] == branch[j]) & mask[i] & mask[j]
            assert torch.equal(action[i][same], action[j][same])
            assert torch.equal(logp[i][same], logp[j][same])


@pytest.mark.parametrize("rule", [SegmentRule(3, 2), EntropyRule()], ids=["segment", "entropy"])
def test_leaves_share_their_parents_tokens_and_every_log_prob_is_teacher_forced(tokenizer, rule):
    collector = make_collector(tokenizer, rule)
    batches = [b for _, b in zip(range(3), collector, strict=False)]
    forced_policy = TransformersPolicy(collector.policy.model, collector.base_env)
    for batch in batches:
        check_tree_batch(batch, 4)
        forced = forced_policy.teacher_forced_log_probs(batch)
        mask = batch[keys.MASK]
        assert torch.allclose(forced[mask], batch[keys.ACTION_LOG_PROB][mask], atol=1e-4)
    shared = sum(int((b[keys.BRANCH_ID] != b[keys.TRAJ_ID])[b[keys.MASK]].sum()) for b in batches)
    assert shared > 0  # the leaves do share tokens
    assert collector.metrics["tree_forks"] > 0


def test_a_segment_tree_forks_every_length_tokens_into_width(tokenizer):
    collector = make_collector(tokenizer, SegmentRule(3, 2), eos=[511], max_new_tokens=12)  # no branch ends early
    batch = next(iter(collector))
    forks = sorted(batch[keys.FORK_INDEX][:, 0].tolist())
    assert forks == [0, 3, 6, 6]  # the root; 1 -> 2 branches at 3 tokens, 2 -> 4 at 6
    assert collector.metrics["tree_leaves_from_prompt"] == 0


def test_forking_then_stepping_equals_stepping_a_copy_prefilled_from_scratch(tokenizer):
    """Two envs and policies in the same state; one forks with the KV cache's row copy, the other lets the policy
    prefill the branch from the env's tokens: the next steps sample the same tokens with the same log-probs."""
    model = tiny_model(tokenizer, seed=0)
    runs = []
    for copy_cache in (True, False):
        env = TokenEnv(PROMPTS, tokenizer, batch_size=3, max_new_tokens=16, max_length=64, eos_token_ids=[511])
        policy = TransformersPolicy(model, env, seed=5)
        obs = env.reset()
        for _ in range(4):
            td = policy(obs)
            _, obs = env.step_and_maybe_reset(td)
        env.vacate([2])
        trajs = env.fork(0, [2], at=2)
        if copy_cache:
            policy.fork([0], [2], [int(env.history(2).numel())], trajs)
        obs = env.observation()
        steps = []
        for _ in range(5):
            td = policy(obs)
            steps.append((td[keys.ACTION].clone(), td[keys.ACTION_LOG_PROB].clone()))
            _, obs = env.step_and_maybe_reset(td)
        runs.append((steps, env.history(2).clone()))
    (a, seq_a), (b, seq_b) = runs
    assert torch.equal(seq_a, seq_b)
    for (act_a, lp_a), (act_b, lp_b) in zip(a, b, strict=True):
        assert torch.equal(act_a, act_b)
        assert torch.allclose(lp_a, lp_b, atol=1e-5)


def test_a_fork_copies_the_state_and_records_the_new_ids(tokenizer):
    env = TokenEnv(PROMPTS, tokenizer, batch_size=3, max_new_tokens=8, max_length=64, group_size=3)
    obs = env.reset()
    for _ in range(3):
        _, obs = env.step_and_maybe_reset(obs.set(keys.ACTION, torch.tensor([40, 41, 42])))
    env.vacate([1, 2])
    trajs = env.fork(0, [1, 2], at=1, sample_ids=[5, 6])
    obs = env.observation()
    assert trajs == [3, 4] and obs[keys.TRAJ_ID].tolist() == [0, 3, 4]
    assert obs[keys.RESPONSE_LEN].tolist() == [3, 1, 1]
    assert obs[keys.SEQ_LEN][1] == obs[keys.SEQ_LEN][0] - 2
    assert obs[keys.SAMPLE_ID].tolist()[1:] == [5, 6] and obs[keys.GROUP_ID].tolist() == [0, 0, 0]
    assert obs[keys.ACTIVE].all() and not obs[keys.DONE_NAME].any()
    assert torch.equal(env.history(1), env.history(0)[:-2])
    assert env.slot_prompt(1).sample_id == 5 and env.slot_prompt(1).text == env.slot_prompt(0).text


@pytest.mark.parametrize(
    ("call", "match"),
    [(lambda env: env.fork(0, [1]), "not free"), (lambda env: env.fork(0, [0]), "not free"),
     (lambda env: env.fork(0, [2], at=5), r"forks at a step in \[0, 2\]"), (lambda env: env.fork(2, [1]), "holds no"),
     (lambda env: env.fork("0", [2]), "slot must be an int"), (lambda env: env.fork(0, [2, 2]), "not free"),
     (lambda env: env.fork(0, [2], sample_ids=[1, 2]), "sample_ids has 2")],
)  # fmt: skip
def test_a_bad_fork_is_refused_naming_the_fix(tokenizer, call, match):
    env = TokenEnv(PROMPTS, tokenizer, batch_size=3, max_new_tokens=8, max_length=64)
    obs = env.reset()
    for _ in range(2):
        _, obs = env.step_and_maybe_reset(obs.set(keys.ACTION, torch.tensor([40, 41, 42])))
    env.vacate([2])
    with pytest.raises((ValueError, TypeError), match=match):
        call(env)


def test_a_rule_that_gives_fewer_leaves_gets_the_rest_from_the_prompt(tokenizer):
    class Never:
        needs_surprise = False

        def forks(self, step):
            return []

    collector = make_collector(tokenizer, Never())
    batch = next(iter(collector))
    check_tree_batch(batch, 4)
    assert (batch[keys.FORK_INDEX] == 0).all()  # plain samples of the prompt: GRPO
    assert collector.metrics["tree_leaves_from_prompt"] >= 3  # each tree's 3 other leaves


def test_a_rule_that_asks_for_more_leaves_is_capped_and_counted(tokenizer):
    class Greedy:
        needs_surprise = False

        def forks(self, step):
            return [Fork(b, step.steps[b], 5) for b in step.slots if b not in step.ended]

    collector = make_collector(tokenizer, Greedy())
    batch = next(iter(collector))
    check_tree_batch(batch, 4)
    assert collector.metrics["tree_forks_skipped"] > 0


def test_a_checkpoint_with_open_trees_resumes_exactly(tokenizer):
    first = make_collector(tokenizer, EntropyRule(), seed=3)
    batches = iter(first)
    next(batches)
    assert first.source.sampler.live  # trees in flight at the checkpoint
    state = first.state_dict()
    expected = [next(batches) for _ in range(2)]
    resumed = make_collector(tokenizer, EntropyRule(), seed=3)
    resumed.load_state_dict(state)
    got = [b for _, b in zip(range(2), resumed, strict=False)]
    for a, b in zip(expected, got, strict=True):
        assert set(a.keys(True, True)) == set(b.keys(True, True))
        assert all(torch.equal(a[k], b[k]) for k in a.keys(True, True))


class _Counting(TurnHandler):
    """Feedback after each turn; per-episode turn counts, copied at a fork."""

    def __init__(self):
        self.turns_of, self.forked = {}, []

    def end_turns(self, turns):
        out = []
        for episode, turn in zip(turns.episodes, turns.turns, strict=True):
            self.turns_of[episode] = self.turns_of.get(episode, 0) + 1
            out.append(Turn(float(self.turns_of[episode]), feedback=None if turn >= 2 else "go on"))
        return out

    def fork(self, parent, child):
        self.forked.append((parent.episode, child.episode))
        self.turns_of[child.episode] = self.turns_of.get(parent.episode, 0)


def test_a_turn_rule_forks_multi_turn_episodes_at_turn_boundaries(tokenizer):
    handler = _Counting()
    model = tiny_model(tokenizer, seed=0)
    env = TokenEnv(PROMPTS, tokenizer, turns=handler, max_turns=3, batch_size=8, group_size=4, max_new_tokens=24,
                   max_turn_tokens=4, max_length=160)  # fmt: skip
    policy = TransformersPolicy(model, env, seed=0)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=4, options=CollectorOptions(tree=TurnRule(2)))
    batch = next(iter(collector))
    check_tree_batch(batch, 4)
    assert handler.forked  # the handler copied its per-episode state at each fork
    forked = batch[keys.FORK_INDEX][:, 0]
    assert (forked[batch[keys.PARENT_ID][:, 0] >= 0] > 0).all()  # branches left at a turn's end, not from the prompt
    forced = TransformersPolicy(model, env).teacher_forced_log_probs(batch)
    mask = batch[keys.MASK]
    assert torch.allclose(forced[mask], batch[keys.ACTION_LOG_PROB][mask], atol=1e-4)
    rewards = batch[keys.REWARD].squeeze(-1).sum(1)
    assert (rewards == 1 + 2 + 3).all()  # every leaf counts its branch's turns, its ancestors' included


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"mode": "steps", "batch_size": 4}, "mode='trajectories'"),
     ({"source": "wave", "options": CollectorOptions(tree=SegmentRule(), over_sampling=True)}, "over_sampling off"),
     ({"options": CollectorOptions(tree=SegmentRule(), in_flight="drop")}, "keep in_flight='continue'")],
)  # fmt: skip
def test_trees_need_trajectories_and_no_over_sampling(tokenizer, kwargs, match):
    model = tiny_model(tokenizer, seed=0)
    env = TokenEnv(PROMPTS, tokenizer, batch_size=8, group_size=4, max_new_tokens=8, max_length=64)
    args = {"mode": "trajectories", "batch_size": 4, "options": CollectorOptions(tree=SegmentRule()), **kwargs}
    with pytest.raises(ValueError, match=match):
        TokenCollector(env, TransformersPolicy(model, env), **args)


def test_trees_need_groups_that_fit_and_a_rule(tokenizer):
    model = tiny_model(tokenizer, seed=0)
    for group_size, batch_size in ((1, 8), (8, 4)):
        env = TokenEnv(PROMPTS, tokenizer, batch_size=batch_size, group_size=group_size, max_new_tokens=8, max_length=64)
        with pytest.raises(ValueError, match="group_size >= 2"):
            TokenCollector(env, TransformersPolicy(model, env), mode="trajectories", batch_size=8,
                           options=CollectorOptions(tree=SegmentRule()))  # fmt: skip
    with pytest.raises(TypeError, match="branching rule"):
        CollectorOptions(tree="segment")
    with pytest.raises(ValueError, match="width must be an int >= 2"):
        SegmentRule(4, 1)


def test_the_shared_prefix_layout_packs_a_trees_shared_tokens_once(tokenizer):
    """The training layout that computes shared prefixes once (to_shared_prefix) packs a tree's leaves into one row
    whose shared segments appear once: no more tokens than the prompt plus the tokens the tree sampled."""
    from tokengym.transforms import to_padded, to_shared_prefix

    collector = make_collector(tokenizer, SegmentRule(3, 2), eos=[511], max_new_tokens=12)
    batch = next(iter(collector))
    padded = to_padded(batch)
    layout = to_shared_prefix(padded)
    mask = batch[keys.MASK]
    sampled = int((mask & (batch[keys.BRANCH_ID] == batch[keys.TRAJ_ID])).sum())  # each tree token once
    prompt = int((padded[keys.ATTENTION_MASK] & ~padded[keys.ACTION_MASK])[0].sum())
    packed = int((layout.segment_ids >= 0).sum())
    assert layout.tokens.shape[0] == 1  # one tree, one pack
    assert packed <= prompt + sampled < int(padded[keys.ATTENTION_MASK].sum())


def test_trees_under_async_collection_keep_every_token_under_its_version(tokenizer):
    """AsyncCollector around a tree collector, new weights after each batch: branches forked after an update copy the
    re-prefilled cache rows; every leaf token's log-prob is teacher-forced under the version stamped on it."""
    import copy

    from tokengym.collectors import AsyncCollector

    model = tiny_model(tokenizer, seed=0)
    published = {0: copy.deepcopy(model)}
    inner = make_collector(tokenizer, SegmentRule(3, 2), model=copy.deepcopy(model), max_new_tokens=10)
    seen = set()
    with AsyncCollector(inner, max_staleness=2, stale_tokens="mask") as collector:
        for i, batch in enumerate(collector):
            check_tree_batch(batch, 4)
            version, mask = batch[keys.POLICY_VERSION], batch[keys.MASK]
            for v in version[mask].unique().tolist():
                forced = TransformersPolicy(published[v], inner.base_env).teacher_forced_log_probs(batch)
                rows = (version == v) & mask
                torch.testing.assert_close(batch[keys.ACTION_LOG_PROB][rows], forced[rows], atol=2e-5, rtol=0)
                seen.add(v)
            if i == 3:
                break
            new = copy.deepcopy(published[len(published) - 1])
            with torch.no_grad():
                for p in new.parameters():
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.05)
            published[len(published)] = new
            collector.update_policy_weights_(new.state_dict())
    assert len(seen) > 1  # batches held tokens of several versions


@pytest.mark.parametrize("source", ["step", "wave"])
@pytest.mark.parametrize(
    ("rule", "env_kwargs", "match"),
    [(EntropyRule(chains=10), {}, r"chains=10 >= the env's group_size=4 .* use chains below 4"),
     (EntropyRule(chains=4), {}, r"chains=4 >= the env's group_size=4"),
     (TurnRule(2), {}, r"max_turns=1 .* build the env with max_turns >= 2"),
     (SegmentRule(20, 2), {}, r"length=20 >= the env's max_new_tokens=12 .* use a length below 12"),
     (SegmentRule(12, 2), {}, r"length=12 >= the env's max_new_tokens=12"),
     (SegmentRule(8, 2), {"max_turns": 2, "max_turn_tokens": 3},
      r"length=8 >= the env's max_turns \* max_turn_tokens \(2 \* 3\)=6"),
     (EntropyRule(skip=11), {}, r"skip=11 leaves no fork point .* use skip <= 10")],
    ids=["chains>G", "chains=G", "turns-single-turn", "length>budget", "length=budget", "length>turn-budget", "skip"],
)  # fmt: skip
def test_a_rule_that_cannot_fork_in_the_env_is_refused_when_the_collector_is_built(tokenizer, source, rule,
                                                                                   env_kwargs, match):  # fmt: skip
    """Each of these used to run as independent samples, silently (tree_forks_skipped 0)."""
    model = tiny_model(tokenizer, seed=0)
    env = TokenEnv(PROMPTS, tokenizer, length_reward, batch_size=8, group_size=4, max_new_tokens=12, max_length=64,
                   **env_kwargs)  # fmt: skip
    with pytest.raises(ValueError, match=match):
        TokenCollector(env, TransformersPolicy(model, env), mode="trajectories", batch_size=4, source=source,
                       options=CollectorOptions(tree=rule))  # fmt: skip
    fits = {TurnRule: lambda: TurnRule(2), SegmentRule: lambda: SegmentRule(5, 2), EntropyRule: lambda: EntropyRule(3)}
    if type(rule) is not TurnRule:  # the same rule, in reach: built without complaint
        TokenCollector(env, TransformersPolicy(model, env), mode="trajectories", batch_size=4, source=source,
                       options=CollectorOptions(tree=fits[type(rule)]()))  # fmt: skip


def test_a_normal_segment_run_counts_no_skipped_forks(tokenizer):
    """``SegmentRule(3, 2)`` with 4 leaves of 12 tokens makes 1 + 2 forks per tree and has no leaf left after 6 tokens;
    the branches' asks at 9 tokens (at whole trees) are not skips. They counted 4 per tree here, hundreds in long runs."""
    collector = make_collector(tokenizer, SegmentRule(3, 2), eos=[511], max_new_tokens=12)
    for _, batch in zip(range(3), collector, strict=False):
        check_tree_batch(batch, 4)
    assert collector.metrics["tree_forks"] > 0 and collector.metrics["tree_forks_skipped"] == 0


def test_slots_a_finished_tree_left_idle_give_their_cache_columns_back(tokenizer):
    """A vacated slot kept its columns while the next trees grew (99 -> 195 -> 291 columns in the trees benchmark,
    1.5-2x the time per leaf after the first batch): the cache stays within one episode's width across batches."""
    collector = make_collector(tokenizer, SegmentRule(3, 2), eos=[511], max_new_tokens=12)
    widths = []
    for _, batch in zip(range(6), collector, strict=False):
        check_tree_batch(batch, 4)
        widths.append(collector.policy.cache.columns)
    longest_prompt = max(len(tokenizer(p)["input_ids"]) for p in PROMPTS)
    assert max(widths) <= longest_prompt + 12 + 2, widths
