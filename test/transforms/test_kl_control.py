import pytest

from tokengym.transforms import AdaptiveKLController, ConstantKLController


def test_constant():
    ctl = ConstantKLController(0.3)
    assert ctl.update(10.0, 4) == 0.3 and ctl.metrics() == {"beta": 0.3, "kl": 10.0}


@pytest.mark.parametrize(("kl", "factor"), [(12.0, 1 + 0.2 * 0.5), (6.6, 1 + 0.1 * 0.5), (0.0, 1 - 0.2 * 0.5)])
def test_adaptive_formula(kl, factor):
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=100)
    assert ctl.update(kl, n_steps=50) == pytest.approx(0.1 * factor)


def test_adaptive_stays_positive_for_huge_batches():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10)
    for _ in range(20):
        ctl.update(0.0, n_steps=10_000)
    assert ctl.beta > 0


def test_state_dict_round_trip():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=100)
    ctl.update(12.0, 10)
    other = AdaptiveKLController(1.0, target=1.0, horizon=1)
    other.load_state_dict(ctl.state_dict())
    assert other.state_dict() == ctl.state_dict() and "AdaptiveKLController(beta=" in repr(other)


def test_bad_input():
    with pytest.raises(ValueError, match=r"beta must be in \[0.0, inf\], got -0.1. Use beta=0.0"):
        ConstantKLController(-0.1)
    with pytest.raises(ValueError, match="beta must be in \\(0.0, inf\\], got 0.0. An adaptive controller"):
        AdaptiveKLController(0.0, target=1.0, horizon=10)
    with pytest.raises(ValueError, match="target must be in .* got -1.0"):
        AdaptiveKLController(0.1, target=-1.0, horizon=10)
    with pytest.raises(ValueError, match="horizon must be in .* got 0.0"):
        AdaptiveKLController(0.1, target=1.0, horizon=0)
    with pytest.raises(TypeError, match="beta must be a number, got str"):
        ConstantKLController("0.1")
    with pytest.raises(ValueError, match="n_steps must be an int >= 0"):
        ConstantKLController(0.1).update(1.0, -1)
    with pytest.raises(ValueError, match="kl must be in .* got nan"):
        ConstantKLController(0.1).update(float("nan"), 1)
    with pytest.raises(KeyError, match="load_state_dict needs a dict with 'beta'"):
        ConstantKLController(0.1).load_state_dict({})


# -- issue 12 regressions --


def test_cap_on_n_steps_over_horizon_is_optional():
    capped = AdaptiveKLController(0.1, target=6.0, horizon=10)
    assert capped.update(12.0, n_steps=20) == pytest.approx(0.1 * (1 + 0.2 * 1.0))  # n/h capped at 1
    ziegler = AdaptiveKLController(0.1, target=6.0, horizon=10, use_cap=False)
    assert ziegler.update(12.0, n_steps=20) == pytest.approx(0.1 * (1 + 0.2 * 2.0))  # the uncapped formula
    assert "use_cap=False" in repr(ziegler) and ziegler.state_dict()["use_cap"] is False
    restored = AdaptiveKLController(1.0, target=1.0, horizon=1)
    restored.load_state_dict(ziegler.state_dict())
    assert restored.use_cap is False


def test_uncapped_factor_that_would_flip_beta_raises():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10, use_cap=False)
    with pytest.raises(ValueError, match=r"n_steps / horizon = 60 / 10.0 .* use_cap=True or a larger horizon"):
        ctl.update(0.0, n_steps=60)
    assert ctl.beta == 0.1 and ctl.last_kl != ctl.last_kl  # state untouched (last_kl still NaN)
    with pytest.raises(TypeError, match="use_cap must be a bool, got str 'no'"):
        AdaptiveKLController(0.1, target=6.0, horizon=10, use_cap="no")
