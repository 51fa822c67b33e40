"""Termination of TokenEnv against a reference that decodes the whole response at every step."""

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tokengym.llm_envs import TokenEnv, keys

EOS = 1
# tokens that make stops likely: EOS, "A", "B", "\n", "t", "h", "th", "the", " the", "=", the two bytes of "é"
INTERESTING = [EOS, 40, 41, 206, 87, 75, 311, 460, 313, 36, 135, 110]
STOPS = ["\n", "AB", "th", "he", "é", "=A", "<|pad|>"]
PROMPTS = ["1+1=", "the answer", "x"]


def _reference(tokenizer, response, prompt_len, stops, max_new, max_length):
    """(terminated, truncated) after ``response`` (the ids so far), decoding it from scratch."""
    text = tokenizer.decode(response)
    terminated = response[-1] == EOS or any(s in text for s in stops)
    truncated = not terminated and (len(response) >= max_new or prompt_len + len(response) >= max_length)
    return terminated, truncated


@settings(deadline=None, max_examples=50)
@given(
    actions=st.lists(
        st.lists(st.one_of(st.sampled_from(INTERESTING), st.integers(0, 511)), min_size=2, max_size=2),
        min_size=1,
        max_size=40,
    ),
    stops=st.lists(st.sampled_from(STOPS), max_size=3, unique=True),
    max_new=st.integers(1, 12),
    max_length=st.integers(5, 20),
)
def test_done_exactly_when_eos_stop_or_limit(tokenizer, actions, stops, max_new, max_length):
    assume(max_new < max_length)  # a budget of max_length or more is refused: a prompt takes at least one token
    env = TokenEnv(
        PROMPTS, tokenizer, batch_size=2, max_new_tokens=max_new, max_length=max_length, stop_strings=stops
    )
    td = env.reset()
    responses = [[], []]
    for pair in actions:
        before = td.select(*keys.OBSERVATION_KEYS).clone()
        out, td = env.step_and_maybe_reset(td.set(keys.ACTION, torch.tensor(pair)))
        nxt = out["next"]
        done, term, trunc = (nxt[name].reshape(-1) for name in keys.DONE_KEYS)
        assert torch.equal(done, term | trunc)
        assert not bool((term & trunc).any())
        for b, action in enumerate(pair):
            responses[b].append(action)
            p_len = int(before[keys.PROMPT_LEN][b])
            want = _reference(tokenizer, responses[b], p_len, stops, max_new, max_length)
            assert (bool(term[b]), bool(trunc[b])) == want, (b, responses[b], stops)
            assert int(nxt[keys.RESPONSE_LEN][b]) == len(responses[b]) <= max_new
            assert int(nxt[keys.SEQ_LEN][b]) == p_len + len(responses[b]) <= max_length
            assert env.tokens[b, p_len : p_len + len(responses[b])].tolist() == responses[b] or bool(done[b])
            if bool(done[b]):
                responses[b] = []
                assert int(td[keys.RESPONSE_LEN][b]) == 0
