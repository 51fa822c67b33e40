import pytest
import torch

from tokengym.collectors.policies import SamplingConfig, sample_tokens


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


# -- the large-vocabulary path (two-level inverse CDF, bans in weight space) --
V_LARGE = 151936  # Qwen2's vocabulary: more than one block, and a partial last block


def _heavy_logits(heavy: dict[int, float], vocab: int = V_LARGE) -> torch.Tensor:
    logits = torch.full((1, vocab), -30.0)  # the rest of the vocabulary holds ~1e-8 of the mass
    for i, v in heavy.items():
        logits[0, i] = v
    return logits


def test_large_vocabulary_draws_match_the_distribution_and_skip_banned_tokens():
    # tokens in the first, a middle and the last (partial) block; token 5000 banned although it dominates
    vocab = 9000  # the two-level path (> 8192), 35 full blocks of 256 and a partial one
    heavy = {0: 2.0, 255: 1.0, 256: 0.5, 7000: 1.5, vocab - 1: 1.0, 5000: 6.0}
    logits = _heavy_logits(heavy, vocab)
    config = SamplingConfig(banned_token_ids=(5000,))
    gen = _gen(1)
    actions = torch.cat([sample_tokens(logits.expand(1000, vocab), config, gen)[0] for _ in range(10)])
    assert not bool((actions == 5000).any())
    allowed = [i for i in heavy if i != 5000]
    probs = torch.tensor([heavy[i] for i in allowed]).softmax(-1)
    freq = torch.tensor([float((actions == i).float().mean()) for i in allowed])
    assert torch.allclose(freq, probs, atol=0.02), (freq, probs)


def test_large_vocabulary_log_probs_are_exact():
    """Within 1e-5 of a float64 log-softmax (a float32 log-softmax over 151936 logits is off by ~3e-5)."""
    gen = _gen(2)
    logits = torch.randn(6, V_LARGE) * 3
    logits[0, 7] = 200.0  # a banned token holding the row's max by far: the allowed mass must not underflow
    for config in [SamplingConfig(), SamplingConfig(banned_token_ids=(7, 9)), SamplingConfig(temperature=0.7),
                   SamplingConfig(temperature=1.3, banned_token_ids=(7,))]:  # fmt: skip
        action, logp, raw = sample_tokens(logits, config, gen)
        x = logits.double() / config.temperature
        if config.banned_token_ids:
            x = x.index_fill(-1, torch.tensor(config.banned_token_ids), -float("inf"))
            assert not any(int(a) in config.banned_token_ids for a in action)
        expected = x.log_softmax(-1).gather(-1, action[:, None]).squeeze(-1)
        assert torch.allclose(logp.double(), expected, atol=1e-5, rtol=0)
        expected_raw = logits.double().log_softmax(-1).gather(-1, action[:, None]).squeeze(-1)
        assert torch.allclose(raw.double(), expected_raw, atol=1e-5, rtol=0)


def test_seeded_and_raw_log_prob_on_request():
    logits = torch.randn(8, V_LARGE)
    config = SamplingConfig(banned_token_ids=(3,))
    a1, lp1, raw = sample_tokens(logits, config, _gen(4), with_raw_log_prob=False)
    a2, lp2, _ = sample_tokens(logits, config, _gen(4))
    assert raw is None and torch.equal(a1, a2) and torch.equal(lp1, lp2)
    small = torch.randn(8, 64)
    assert sample_tokens(small, SamplingConfig(temperature=0.5), _gen(), with_raw_log_prob=False)[2] is None


def test_banned_ids_tensor_is_built_once():
    config = SamplingConfig(banned_token_ids=(1, 2))
    assert config.banned_ids(torch.device("cpu")) is config.banned_ids(torch.device("cpu"))
    assert SamplingConfig().banned_ids(torch.device("cpu")) is None
    with pytest.raises(ValueError, match=r"banned_token_ids must be token ids >= 0, got -4"):
        SamplingConfig(banned_token_ids=(3, -4))


def test_a_large_vocabulary_draw_after_one_under_inference_mode():
    """The reused (B, V) scratch buffer is an ordinary tensor even when first allocated under inference mode."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 20_000)
    with torch.inference_mode():
        first, _, _ = sample_tokens(logits, SamplingConfig(), gen)
    again, logp, _ = sample_tokens(logits, SamplingConfig(), gen)  # outside: writes into the same buffer
    assert first.shape == again.shape == (3,) and bool((logp <= 0).all())
