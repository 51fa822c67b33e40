"""TransformersPolicy(decode="static"): the fixed-shape decode step (StaticSlotKVCache, what decode="graph" captures
on CUDA) gives the tokens and log-probs of the dynamic cache for the same generator state, on every kind of episode:
groups sharing a prompt, refills, multi-turn feedback, trees forked mid-sequence, self-play's waiting seats, a resume
from a checkpoint (weight updates: test/gpu/test_graph_decode.py); and decode="compile" (the same step compiled)
gives the static step's. Small env buffers make the static window slide back to the front often."""

import copy

import pytest
import torch

from tokengym.collectors import CollectorOptions, TokenCollector
from tokengym.collectors.branching import SegmentRule
from tokengym.collectors.policies import SamplingConfig, StaticSlotKVCache, TransformersPolicy
from tokengym.llm_envs import TokenEnv, keys, make_self_play_env
from tokengym.llm_envs.turns import Turn, TurnHandler
from tokengym.llm_envs.turns.self_play import CountingGame

PROMPTS = ["What is 12 + 7?", "hi", "Reverse the string abc:", "a b c d e f g h", "1+1=", "count down 5 4"]


def _reward(responses, prompts, metadata):
    return [float(len(r) % 3) for r in responses]


class _Feedback(TurnHandler):
    def end_turns(self, turns):
        return [Turn(1.0, feedback=None if t >= 2 else "go on, go on") for t in turns.turns]


ENVS = {
    "groups": lambda tok, cfg: TokenEnv(PROMPTS, tok, _reward, batch_size=4, group_size=2, max_new_tokens=20,
                                        max_length=40, model_config=cfg),  # fmt: skip
    "multi_turn": lambda tok, cfg: TokenEnv(PROMPTS, tok, turns=_Feedback(), max_turns=3, batch_size=3,
                                            max_new_tokens=18, max_turn_tokens=5, max_length=96, model_config=cfg),  # fmt: skip
    "self_play": lambda tok, cfg: make_self_play_env(lambda: CountingGame(rounds=1), tok, batch_size=4,
                                                     games_per_group=2, max_new_tokens=12, max_turn_tokens=4,
                                                     max_length=128, model_config=cfg),  # fmt: skip
}


def _collect(tok, model, env_kind, decode, *, batches=2, tree=None, sampling=None, seed=0):
    env = ENVS[env_kind](tok, model.config)
    policy = TransformersPolicy(model, env, seed=seed, decode=decode, sampling=sampling, return_raw_log_prob=True)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=4,
                               options=CollectorOptions(tree=tree) if tree else None)  # fmt: skip
    it = iter(collector)
    return [next(it) for _ in range(batches)], policy


def _assert_same(expected, got):
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a[keys.ACTION], b[keys.ACTION]) and torch.equal(a[keys.MASK], b[keys.MASK])
        for key in (keys.ACTION_LOG_PROB, keys.RAW_LOG_PROB):
            torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=0)


@pytest.mark.parametrize("env_kind", list(ENVS))
def test_the_static_step_samples_what_the_dynamic_one_does(tokenizer, model, env_kind):
    dynamic, _ = _collect(tokenizer, model, env_kind, "dynamic")
    static, policy = _collect(tokenizer, model, env_kind, "static")
    _assert_same(dynamic, static)
    assert isinstance(policy.cache, StaticSlotKVCache) and policy.graph is None


@pytest.mark.parametrize("env_kind", ["multi_turn", "self_play"])
def test_the_compiled_step_samples_what_the_static_one_does(tokenizer, model, env_kind):
    """decode="compile" (torch.compile; Inductor's kernels on the CPU) over multi-turn feedback and self-play's waiting
    seats, whose windows slide back to the front of the buffers (groups, trees, weight updates:
    test/gpu/test_graph_decode.py)."""
    static, _ = _collect(tokenizer, model, env_kind, "static")
    compiled, policy = _collect(tokenizer, model, env_kind, "compile")
    _assert_same(static, compiled)
    # compiled once per buffer layout a step ran on (self-play's seats may grow the buffers before the first step)
    assert policy.cache.moves > 0 and 1 <= policy.graph.captures <= policy.cache.layout


def test_a_step_that_cannot_be_compiled_whole_names_the_fix(tokenizer, model):
    """A model whose forward reads a value back to the host breaks TorchDynamo's graph: decode="compile" refuses it
    at the first step with one line of Dynamo's reason and the decodes that work, instead of a slower partial graph."""

    class HostRead(type(model)):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            if out.logits.sum().item() > 1e30:  # a host read: a graph break
                out.logits.zero_()
            return out

    breaks = HostRead(model.config).eval()
    breaks.load_state_dict(model.state_dict())
    env = ENVS["groups"](tokenizer, breaks.config)
    policy = TransformersPolicy(breaks, env, decode="compile")
    with pytest.raises(RuntimeError, match=r"the decode step of HostRead could not be compiled whole \(\w+: [^\n]+\); "
                                           r"decode uncompiled: TransformersPolicy\(decode='static'\) or "
                                           r"decode='dynamic'$"):  # fmt: skip
        policy(env.reset())


def test_trees_forked_mid_sequence_with_filtered_sampling(tokenizer, model):
    sampling = SamplingConfig(temperature=0.8, top_k=50, top_p=0.9)
    dynamic, _ = _collect(tokenizer, model, "groups", "dynamic", tree=SegmentRule(3, 2), sampling=sampling)
    static, _ = _collect(tokenizer, model, "groups", "static", tree=SegmentRule(3, 2), sampling=sampling)
    _assert_same(dynamic, static)
    assert (static[0][keys.PARENT_ID][:, 0] >= 0).any()  # forks happened


def test_the_window_slides_back_to_the_front_and_the_buffers_stay(tokenizer, model):
    env = ENVS["groups"](tokenizer, model.config)
    policy = TransformersPolicy(model, env, seed=0, decode="static")
    cache = policy.cache
    buffers = [k.data_ptr() for k, _ in cache.buffers]
    collector = TokenCollector(env, policy, mode="steps", batch_size=4 * cache.capacity)  # many times the buffers
    next(iter(collector))
    assert cache.moves > 0  # the window reached the end of the buffers and went back to the front
    assert [k.data_ptr() for k, _ in cache.buffers] == buffers and cache.layout == 1  # never reallocated


@pytest.mark.parametrize("decode", ["static", "compile"])
def test_a_resume_from_a_checkpoint_is_exact(tokenizer, model, decode):
    def collector():
        env = ENVS["multi_turn"](tokenizer, model.config)
        return TokenCollector(env, TransformersPolicy(model, env, seed=3, decode=decode), mode="trajectories",
                              batch_size=3)  # fmt: skip

    first = collector()
    it = iter(first)
    next(it)
    state = copy.deepcopy(first.state_dict())
    expected = [next(it) for _ in range(2)]
    resumed = collector()
    resumed.load_state_dict(state)
    it = iter(resumed)
    for want in expected:
        got = next(it)
        assert torch.equal(want[keys.ACTION], got[keys.ACTION])
        assert torch.equal(want[keys.ACTION_LOG_PROB], got[keys.ACTION_LOG_PROB])


def test_bad_decode_settings_are_refused_by_name(tokenizer, model):
    env = ENVS["groups"](tokenizer, model.config)
    with pytest.raises(ValueError, match=r"decode must be one of \('dynamic', 'static', 'graph', 'compile'\), got 'cuda'"):
        TransformersPolicy(model, env, decode="cuda")
    with pytest.raises(ValueError, match=r"decode='graph' captures the decode step in a CUDA graph; the model is on "
                                         r"cpu: use decode='static'"):  # fmt: skip
        TransformersPolicy(model, env, decode="graph")
    with pytest.raises(ValueError, match=r"capacity must be an int >= 2 .*got 1"):
        StaticSlotKVCache(model, 2, capacity=1)


def _wave_collect(tok, model, env_kind, decode, *, batches=2, options=None, seed=0):
    env = ENVS[env_kind](tok, model.config)
    policy = TransformersPolicy(model, env, seed=seed, decode=decode, return_raw_log_prob=True)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=4, source="wave", options=options)
    it = iter(collector)
    return [next(it) for _ in range(batches)], policy


@pytest.mark.parametrize("env_kind", ["groups", "multi_turn"])
def test_waves_on_the_static_step_sample_what_generate_does(tokenizer, model, env_kind):
    dynamic, _ = _wave_collect(tokenizer, model, env_kind, "dynamic")
    static, policy = _wave_collect(tokenizer, model, env_kind, "static")
    _assert_same(dynamic, static)
    assert isinstance(policy.cache, StaticSlotKVCache)
    for batch in static:  # and each token's log-prob is the model's, teacher-forced
        torch.testing.assert_close(policy.teacher_forced_log_probs(batch), batch[keys.ACTION_LOG_PROB], atol=1e-5,
                                   rtol=0)  # fmt: skip


def test_a_static_wave_with_mixed_budgets_and_long_tails_left_to_the_next_wave(tokenizer, model):
    from tokengym.llm_envs.waves import WaveRequest

    env = ENVS["groups"](tokenizer, model.config)
    prompts = [torch.tensor(tokenizer(p)["input_ids"]) for p in ("1+1=", "1+1=", "hi there", "count")]
    request = WaveRequest(slots=torch.arange(4), prompts=prompts, max_new_tokens=torch.tensor([3, 9, 1, 6]),
                          eos_token_ids=(tokenizer.eos_token_id,))  # fmt: skip
    results = {}
    for decode in ("dynamic", "static"):
        policy = TransformersPolicy(model, env, seed=5, decode=decode, return_raw_log_prob=True)
        results[decode] = policy.generate(request)
        # the static policy ran the wave on its cache's first rows (ids no env trajectory has), not model.generate
        assert bool((policy.cache.traj[:4] < -1).all()) == (decode == "static")  # -1: a row never filled
    want, got = results["dynamic"], results["static"]
    assert torch.equal(want.lengths, got.lengths) and (got.lengths <= request.max_new_tokens).all()
    for i, n in enumerate(got.lengths.tolist()):
        assert torch.equal(want.actions[i, :n], got.actions[i, :n])
        torch.testing.assert_close(want.log_probs[i, :n], got.log_probs[i, :n], atol=1e-5, rtol=0)
        torch.testing.assert_close(want.raw_log_probs[i, :n], got.raw_log_probs[i, :n], atol=1e-5, rtol=0)
    assert got.actions.shape[1] <= int(request.max_new_tokens.max())

    # two rows ended: the wave stops there, the others come back unfinished with what they have
    policy = TransformersPolicy(model, env, seed=5, decode="static")
    early = policy.generate(WaveRequest(slots=request.slots, prompts=prompts, max_new_tokens=torch.tensor([2, 9, 1, 9]),
                                        eos_token_ids=(), min_finished=2))  # fmt: skip
    assert early.actions.shape[1] == 2 and early.finished.tolist() == [True, False, True, False]
    assert early.lengths.tolist() == [2, 2, 1, 2]


def test_an_interrupt_stops_a_static_wave_and_the_rows_go_on_in_the_next(tokenizer, model):
    options = CollectorOptions(over_sampling=True)
    dynamic, _ = _wave_collect(tokenizer, model, "groups", "dynamic", options=options)
    static, policy = _wave_collect(tokenizer, model, "groups", "static", options=options)
    _assert_same(dynamic, static)  # long tails left to the next wave, as generate leaves them
    from tokengym.llm_envs.waves import WaveRequest

    prompts = [torch.tensor(tokenizer("1+1=")["input_ids"])] * 2
    policy.interrupt.set()
    stopped = policy.generate(WaveRequest(slots=torch.arange(2), prompts=prompts, max_new_tokens=torch.tensor([5, 5]),
                                          eos_token_ids=()))  # fmt: skip
    assert stopped.actions.shape[1] == 0 and stopped.finished.tolist() == [False, False]
    policy.interrupt.clear()
