"""The policy protocols (TokenPolicy, StepPolicy, WavePolicy): a user's own policy, a composed policy + reference
and TransformersPolicy all run through every collector source, take weight updates and resume exactly; a
minimal second implementation of each protocol runs too."""

import pytest
import torch
from tensordict import TensorDict

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import (
    PolicyWithReference,
    StepPolicy,
    StepwiseReference,
    TokenPolicy,
    WavePolicy,
    check_fits_env,
    check_policy,
    is_token_policy,
    supports_cache_state,
)
from tokengym.collectors.policies.protocol import FunctionPolicy, weights_of
from tokengym.llm_envs import TokenEnv, keys
from tokengym.llm_envs.waves import WaveResult


class ScriptedPolicy:
    """Emits ``start, start+1, ...`` (mod vocab) per trajectory, EOS after ``length`` tokens; both modes."""

    def __init__(self, eos: int, length: int = 3, vocab: int = 500) -> None:
        self.eos, self.length, self.vocab, self.version, self.offset = eos, length, vocab, 0, 10

    def _token(self, traj: torch.Tensor, resp: torch.Tensor) -> torch.Tensor:
        tok = (self.offset + 7 * traj + resp) % self.vocab + 3
        return torch.where(resp + 1 >= self.length, torch.full_like(tok, self.eos), tok)

    def __call__(self, td):
        action = self._token(td.get(keys.TRAJ_ID), td.get(keys.RESPONSE_LEN))
        td.set(keys.ACTION, action)
        td.set(keys.ACTION_LOG_PROB, -torch.ones(action.shape))
        return td.set(keys.POLICY_VERSION, torch.full_like(action, self.version))

    def generate(self, request):
        n, T = len(request), int(request.max_new_tokens.max())
        # the trajectory is not in the request: derive a stable start from the prompt's last token
        start = torch.stack([p[-1] for p in request.prompts])
        resp = torch.arange(T).expand(n, T)
        actions = torch.where(resp + 1 >= self.length, self.eos, (self.offset + start[:, None] + resp) % self.vocab + 3)
        lengths = torch.minimum(torch.full((n,), self.length), request.max_new_tokens)
        return WaveResult(actions=actions, lengths=lengths, log_probs=-torch.ones(n, T), version=self.version)

    def update_weights(self, weights=None) -> int:
        self.offset = int(weights["offset"]) if weights is not None else self.offset + 1
        self.version += 1
        return self.version

    def set_seed(self, seed: int) -> None:
        self.offset = 10 + seed

    def collection_state(self) -> dict:
        return {"version": self.version, "offset": self.offset}

    def load_collection_state(self, state) -> None:
        self.version, self.offset = state["version"], state["offset"]

    def close(self) -> None:
        pass


def _equal(a, b) -> bool:
    return all(torch.equal(a.get(k), b.get(k)) for k in a.keys(True, True) if isinstance(a.get(k), torch.Tensor))


def _resume_check(make_collector, n_before=2, n_after=3):
    """Batches after a checkpoint (restored into a fresh collector) equal the uninterrupted run's."""
    collector = make_collector()
    it = iter(collector)
    for _ in range(n_before):
        next(it)
    state = collector.state_dict()
    expected = [next(it) for _ in range(n_after)]
    resumed = make_collector()
    resumed.load_state_dict(state)
    got = [b for b, _ in zip(resumed, range(n_after), strict=False)]
    assert len(got) == n_after
    for a, b in zip(expected, got, strict=True):
        assert sorted(a.keys(True, True), key=str) == sorted(b.keys(True, True), key=str) and _equal(a, b)


def test_scripted_policy_is_a_token_policy(tokenizer):
    policy = ScriptedPolicy(tokenizer.eos_token_id)
    assert isinstance(policy, TokenPolicy) and is_token_policy(policy)
    assert isinstance(policy, StepPolicy) and isinstance(policy, WavePolicy)

    class NoWeights:
        version = 0

        def __call__(self, td):
            return td

    with pytest.raises(TypeError, match=r"NoWeights is not a TokenPolicy: it lacks \['update_weights', 'set_seed', "
                                        r"'collection_state', 'load_collection_state', 'close'\]"):  # fmt: skip
        check_policy(NoWeights())


@pytest.mark.parametrize("source", ["step", "wave"])
@pytest.mark.parametrize("mode", ["steps", "trajectories"])
def test_scripted_policy_runs_updates_and_resumes(make_env, tokenizer, source, mode):
    def make():
        env = make_env(batch_size=3, max_new_tokens=5)
        return TokenCollector(env, ScriptedPolicy(tokenizer.eos_token_id), mode=mode, batch_size=4, source=source)

    collector = make()
    batch = next(iter(collector))
    mask = batch[keys.MASK]
    assert bool((batch["action_log_prob"][mask] == -1).all())
    assert collector.update_policy_weights_({"offset": 40}) == 1
    later = next(iter(collector))
    assert int(later[keys.POLICY_VERSION][later[keys.MASK]].max()) == 1
    _resume_check(make)


def test_policy_with_reference_updates_and_resumes(make_env, make_policy, model):
    import copy

    ref_model = copy.deepcopy(model)

    def make():
        env = make_env(batch_size=3, max_new_tokens=5, eos_token_ids=list(range(1, 512, 9)))
        policy = PolicyWithReference(make_policy(env, seed=3), StepwiseReference(ref_model, env))
        return TokenCollector(env, policy, mode="trajectories", batch_size=3)

    collector = make()
    batch = next(iter(collector))
    mask = batch[keys.MASK]
    # same weights: the reference log-prob is the policy's own
    assert torch.allclose(batch[keys.REF_LOG_PROB][mask], batch[keys.ACTION_LOG_PROB][mask], atol=1e-5)
    weights = {k: v + 0.01 for k, v in model.state_dict().items()}
    assert collector.update_policy_weights_(weights=weights) == 1 and collector.policy.version == 1
    model.load_state_dict({k: v - 0.01 for k, v in weights.items()})  # restore the shared fixture's weights
    _resume_check(make)


def test_transformers_policy_wave_source_resumes_exactly(make_env, make_policy):
    def make(mode):
        env = make_env(batch_size=3, max_new_tokens=6, eos_token_ids=list(range(1, 512, 7)))
        return TokenCollector(env, make_policy(env, seed=5), mode=mode, batch_size=4, source="wave")

    _resume_check(lambda: make("trajectories"))
    _resume_check(lambda: make("steps"), n_before=1)  # a wave spans batches: the leftover is checkpointed


# -- a second implementation: the protocols are all a collector needs --
class MinimalStep:
    """A StepPolicy in a few lines: always EOS."""

    version = 0

    def __init__(self, eos: int) -> None:
        self.eos = eos

    def __call__(self, td):
        n = td.batch_size[0]
        td.set(keys.ACTION, torch.full((n,), self.eos)).set(keys.ACTION_LOG_PROB, torch.zeros(n))
        return td.set(keys.POLICY_VERSION, torch.full((n,), self.version))

    def update_weights(self, weights=None) -> int:
        self.version += 1
        return self.version

    def set_seed(self, seed: int) -> None:
        pass

    def collection_state(self) -> dict:
        return {"version": self.version}

    def load_collection_state(self, state: dict) -> None:
        self.version = state["version"]

    def close(self) -> None:
        pass


class MinimalWave:
    """A WavePolicy in a few lines: every row answers ``token`` twice, then EOS."""

    version = 0

    def __init__(self, token: int, eos: int) -> None:
        self.token, self.eos = token, eos

    def generate(self, request):
        n = len(request)
        actions = torch.tensor([[self.token, self.token, self.eos]]).expand(n, 3)
        lengths = torch.minimum(torch.full((n,), 3), request.max_new_tokens)
        return WaveResult(actions, lengths, torch.zeros(n, 3), version=self.version)

    update_weights, set_seed, collection_state, load_collection_state, close = (
        MinimalStep.update_weights, MinimalStep.set_seed, MinimalStep.collection_state,
        MinimalStep.load_collection_state, MinimalStep.close,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["steps", "trajectories"])
def test_minimal_step_and_wave_policies_run_through_the_collector(make_env, tokenizer, mode):
    eos = tokenizer.eos_token_id
    step, wave = MinimalStep(eos), MinimalWave(7, eos)
    assert isinstance(step, StepPolicy) and not isinstance(step, WavePolicy) and isinstance(step, TokenPolicy)
    assert isinstance(wave, WavePolicy) and not isinstance(wave, StepPolicy) and isinstance(wave, TokenPolicy)
    assert not isinstance(object(), TokenPolicy) and not supports_cache_state(step)
    for policy, source, length in ((step, "step", 1), (wave, "wave", 3)):
        collector = TokenCollector(make_env(batch_size=2), policy, mode=mode, batch_size=4, source=source)
        batch = next(iter(collector))
        if mode == "trajectories":
            assert batch[keys.MASK].sum(1).tolist() == [length] * 4
        assert collector.update_policy_weights_({}) == 1 and policy.version == 1
        state = collector.state_dict()
        assert state["policy"] == {"version": 1}
        collector.load_state_dict(state)
        assert collector.set_seed(3) == 3
    with pytest.raises(TypeError, match="source='step' needs a policy callable"):
        TokenCollector(make_env(), wave, mode=mode, batch_size=4, source="step")


def test_builtin_policies_implement_their_protocols(make_env, make_policy):
    env = make_env()
    policy = make_policy(env)
    assert isinstance(policy, StepPolicy) and isinstance(policy, WavePolicy) and supports_cache_state(policy)
    ref = PolicyWithReference(policy, StepwiseReference(policy.model, env))
    assert isinstance(ref, StepPolicy) and not isinstance(ref, WavePolicy) and supports_cache_state(ref)
    assert isinstance(FunctionPolicy(lambda td: td), StepPolicy)


def test_state_dict_of_a_module_policy_is_its_weights(make_env, make_policy, model):
    """One meaning of state_dict: the module's; what a collector checkpoints is collection_state."""
    env = make_env()
    policy = make_policy(env)
    assert policy.state_dict().keys() == {f"model.{k}" for k in model.state_dict()}
    policy(env.reset())
    state = policy.collection_state()
    assert set(state) == {"generator", "generator_device", "version", "cache"}
    assert set(policy.collection_state(include_cache=False)) == {"generator", "generator_device", "version"}
    ref = StepwiseReference(model, env)
    assert ref.state_dict().keys() == {f"model.{k}" for k in model.state_dict()}
    assert set(ref.collection_state()) == {"cache"}


def test_update_weights_takes_a_state_dict_a_tensordict_or_a_module(make_env, make_policy, model):
    import copy

    env, original = make_env(), copy.deepcopy(model.state_dict())
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5)
    try:
        for weights in (other.state_dict(), TensorDict.from_module(other), other):
            policy = make_policy(env)
            assert policy.update_weights(weights) == 1
            for name, value in other.state_dict().items():
                assert torch.equal(policy.model.state_dict()[name], value), name
            model.load_state_dict(original)
    finally:
        model.load_state_dict(original)  # the session fixture's weights
    with pytest.raises(TypeError, match=r"weights must be a state_dict \(a mapping name -> tensor\)"):
        weights_of([("w", torch.ones(1))])
    with pytest.raises(ValueError, match="needs weights"):
        weights_of(None, None, missing="needs weights")


def test_an_old_checkpoint_loads_and_a_policy_of_the_old_names_is_refused(make_env, tokenizer, make_policy):
    """Checkpoints keep their format; a policy with state_dict / load_state_dict (the names before the rename) is
    refused, naming the methods it lacks."""

    class OldPolicy:
        version = 0
        __init__, __call__, update_weights, close = (MinimalStep.__init__, MinimalStep.__call__,
                                                     MinimalStep.update_weights, MinimalStep.close)  # fmt: skip

        def state_dict(self) -> dict:
            return {"version": self.version}

        def load_state_dict(self, state: dict) -> None:
            self.version = state["version"]

    with pytest.raises(TypeError, match=r"OldPolicy is not a TokenPolicy: it lacks \['set_seed', 'collection_state', "
                                        r"'load_collection_state'\]"):  # fmt: skip
        TokenCollector(make_env(), OldPolicy(tokenizer.eos_token_id), mode="steps", batch_size=4)
    # a checkpoint of a TransformersPolicy written before the rename: the same keys, loaded as they are
    env = make_env()
    policy = make_policy(env)
    collector = TokenCollector(env, policy, mode="steps", batch_size=4)
    next(iter(collector))
    old = {"generator": policy.generator.get_state(), "version": 3, "cache": policy.cache.state_dict()}
    collector.load_state_dict({**collector.state_dict(), "policy": old})
    assert policy.version == 3


def test_one_fits_check_for_every_backend(tokenizer, model):
    from tokengym.collectors.policies import SamplingConfig

    env = TokenEnv(["hi"], tokenizer, max_new_tokens=8, max_length=64, model_config=model.config)
    fits = dict(vocab_size=512, positions=64, length_fix="x")
    check_fits_env(env, "M", **fits, probe_text=tokenizer.decode(list(range(512))))
    cases = [
        (dict(vocab_size=300), r"M has vocab_size 300, smaller than the env tokenizer's 512"),
        (dict(vocab_size=1024), r"M can emit ids up to 1023 but the env accepts \[0, 512\); build the env with"),
        (dict(positions=32, length_fix="use {positions}"), r"max_length=64 tokens but M has 32 positions; use 32"),
        (dict(sampling=SamplingConfig(banned_token_ids=(600,))), r"banned_token_ids \[600\] are outside"),
        (dict(probe_text="other"), r"M's tokenizer decodes ids differently from the env's"),
    ]
    for changed, match in cases:
        with pytest.raises(ValueError, match=match):
            check_fits_env(env, "M", **{**fits, **changed})
    check_fits_env(env, "M", vocab_size=None, positions=None, length_fix="")  # nothing known: nothing checked
