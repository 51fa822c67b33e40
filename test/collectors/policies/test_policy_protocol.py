"""The TokenPolicy protocol: a user's own policy, a composed policy + reference and TransformersPolicy
all run through every collector source, take weight updates and resume exactly."""

import pytest
import torch

from tokengym.collectors import (
    PolicyWithReference,
    StepwiseReference,
    TokenCollector,
    TokenPolicy,
    check_policy,
    is_token_policy,
)
from tokengym.llm_envs import keys
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

    def state_dict(self) -> dict:
        return {"version": self.version, "offset": self.offset}

    def load_state_dict(self, state) -> None:
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

    class NoWeights:
        version = 0

        def __call__(self, td):
            return td

    with pytest.raises(TypeError, match=r"NoWeights is not a TokenPolicy: it lacks \['update_weights', 'state_dict'"):
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
