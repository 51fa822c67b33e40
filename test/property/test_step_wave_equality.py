"""Stepping one token at a time and unrolling whole waves give the same trajectories, key for key, single- and
multi-turn (feedback turns, turn limits), whatever the lengths: the env core alone decides termination and rewards."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokengym.collectors import CollectorOptions, TokenCollector
from tokengym.llm_envs import TokenEnv, keys
from tokengym.llm_envs.turns import FeedbackTurns, Turn
from tokengym.llm_envs.waves import WaveResult
from tokengym.testing import tiny_tokenizer

TOK = tiny_tokenizer()
PROMPTS = ["1+1=", "hello there", "abc def", "x y z w", "12+7=", "3*4="]


def _token(key: int, position: int, p_end: int) -> int:
    """The scripted token at ``position`` of a sequence whose first tokens sum to ``key``: EOS about 1 in ``p_end``."""
    h = (key * 1_000_003 + position * 7_919) % 10_007
    return TOK.eos_token_id if h % p_end == 0 else 40 + h % 400


class ScriptedPolicy:
    """Tokens that depend only on the sequence (its first 4 ids) and the position: the same stepped or in waves."""

    def __init__(self, env, p_end: int) -> None:
        self.env, self.p_end, self.version = env, p_end, 0

    def __call__(self, td):
        seq = td.get(keys.SEQ_LEN)
        action = [_token(int(self.env.history(b, 0, 4).sum()), int(seq[b]), self.p_end) for b in range(len(seq))]
        td.set(keys.ACTION, torch.tensor(action))
        td.set(keys.ACTION_LOG_PROB, -torch.ones(len(seq)))
        return td.set(keys.POLICY_VERSION, torch.zeros(len(seq), dtype=torch.int64))

    def generate(self, request):
        T = max(int(request.max_new_tokens.max()), 1)
        rows = [[_token(int(p[:4].sum()), len(p) + t, self.p_end) for t in range(T)] for p in request.prompts]
        actions = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), T)
        return WaveResult(actions, request.max_new_tokens.clone(), -torch.ones(actions.shape, dtype=torch.float32))

    def update_weights(self, weights=None) -> int:
        return self.version

    def set_seed(self, seed: int) -> None:
        pass

    def collection_state(self) -> dict:
        return {}

    def load_collection_state(self, state) -> None:
        pass

    def close(self) -> None:
        pass


def _feedback(responses, prompts, metadata, turns):
    return [Turn(0.5 + len(r) % 3, "again") if t == 0 else Turn(float(len(r) % 2)) for r, t in zip(responses, turns, strict=True)]


def _trajectories(source: str, B: int, turns: int, max_new: int, turn_limit, p_end: int, n: int) -> dict:
    kwargs = dict(batch_size=B, max_new_tokens=max_new, max_turn_tokens=turn_limit, max_length=96)
    if turns == 1:
        env = TokenEnv(PROMPTS, TOK, lambda r, p, m: [len(x) % 5 - 1.5 for x in r], **kwargs)
    else:
        env = TokenEnv(PROMPTS, TOK, turns=FeedbackTurns(_feedback), max_turns=turns, **kwargs)
    collector = TokenCollector(env, ScriptedPolicy(env, p_end), mode="trajectories", batch_size=B, source=source,
                               options=CollectorOptions(is_whole_groups=False))  # fmt: skip
    out = {}
    for batch in collector:
        for i in range(batch.shape[0]):
            row = batch[i]
            mask = row.get(keys.MASK)
            out[int(row.get(keys.TRAJ_ID)[0])] = row[mask]  # the trajectory's real steps
        if all(t in out for t in range(n)):
            return {t: out[t] for t in range(n)}
    raise AssertionError("the collector stopped before n trajectories")


@settings(deadline=None, max_examples=25)
@given(B=st.integers(1, 4), turns=st.integers(1, 3), max_new=st.integers(1, 12), turn_limit=st.one_of(st.none(), st.integers(1, 5)),
       p_end=st.integers(2, 9))  # fmt: skip
def test_stepped_and_wave_trajectories_are_equal_on_every_key(B, turns, max_new, turn_limit, p_end):
    n = B + 2  # past the first wave: refilled slots too
    step = _trajectories("step", B, turns, max_new, turn_limit, p_end, n)
    wave = _trajectories("wave", B, turns, max_new, turn_limit, p_end, n)
    for t in range(n):
        a, b = step[t], wave[t]
        assert set(a.keys(True, True)) == set(b.keys(True, True))
        for key in a.keys(True, True):
            x, y = a.get(key), b.get(key)
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y), (t, key, x, y)
