import pytest
import torch

from tokengym.collectors import SamplingConfig, sample_tokens


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_and_reports_model_log_prob():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    action, logp, raw = sample_tokens(logits, SamplingConfig(greedy=True), None)
    assert action.tolist() == [1, 0]
    assert torch.allclose(logp, logits.log_softmax(-1).gather(-1, action[:, None]).squeeze(-1))
    assert torch.allclose(raw, logp)


def test_banned_tokens_are_never_sampled():
    logits = torch.zeros(64, 5)
    logits[:, 2] = 10.0
    action, _, _ = sample_tokens(logits, SamplingConfig(banned_token_ids=(2,)), _gen())
    assert not bool((action == 2).any())


def test_top_k_keeps_the_k_best():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).expand(2000, 5)
    action, logp, raw = sample_tokens(logits, SamplingConfig(top_k=2), _gen())
    assert set(action.tolist()) == {0, 1}
    # log-prob under the renormalized top-2 distribution, raw under the full softmax
    expected = torch.tensor([4.0, 3.0]).log_softmax(-1)
    assert torch.allclose(logp, expected[action])
    assert torch.allclose(raw, logits[0].log_softmax(-1)[action])


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(3000, 4)
    action, _, _ = sample_tokens(logits, SamplingConfig(top_p=0.8), _gen())
    assert set(action.tolist()) == {0, 1}


def test_temperature_scales_the_distribution():
    logits = torch.tensor([[1.0, 0.0]])
    _, logp, raw = sample_tokens(logits.expand(1, 2), SamplingConfig(temperature=0.5, greedy=True), None)
    assert torch.allclose(logp, (logits / 0.5).log_softmax(-1)[:, 0])
    assert torch.allclose(raw, logits.log_softmax(-1)[:, 0])


def test_sampling_matches_the_distribution_and_is_seeded():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().expand(20000, 4)
    a1, _, _ = sample_tokens(logits, SamplingConfig(), _gen(3))
    a2, _, _ = sample_tokens(logits, SamplingConfig(), _gen(3))
    assert torch.equal(a1, a2)
    freq = torch.bincount(a1, minlength=4) / len(a1)
    assert torch.allclose(freq, probs, atol=0.015)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": 0.0}, r"temperature must be > 0, got 0.0; use greedy=True"),
        ({"top_k": -1}, r"top_k must be an int >= 0 \(0 keeps all tokens\), got -1"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ],
)
def test_bad_sampling_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)
