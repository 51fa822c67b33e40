import pytest

from tokengym.llm_envs.tools import calculator


@pytest.mark.parametrize(
    ("expr", "value"),
    [("(3 + 4) * 2", "14"), ("-2 ** 3", "-8"), ("7 // 2 + 7 % 2", "4"), ("1 / 4", "0.25"), ("6 / 3", "2"),
     ("2 ** 10", "1024"), ("1.5 * 2", "3")],
)  # fmt: skip
def test_calculator(expr, value):
    assert calculator(expr) == value


@pytest.mark.parametrize(
    ("expr", "match"),
    [
        ("__import__('os').system('echo hi')", "only numbers and"),
        ("x + 1", "only numbers and"),
        ("(1).__class__", "only numbers and"),
        ("[1, 2]", "only numbers and"),
        ("'a' * 3", "only numbers and"),
        ("9 ** 9 ** 9", "exponent .* too large"),
        ("10 ** 99 * 10 ** 99", "too large"),
        ("1e308 * 10", "too large"),
        ("1 / 0", "division by zero"),
        ("(-1) ** 0.5", "not a real number"),
        ("1 +", "bad syntax"),
        ("1" * 1001, "longer than 1000"),
        ("1 +\x00 2", "bad syntax"),
        ("'\ud800'", "bad syntax"),
    ],
)
def test_calculator_rejects(expr, match):
    with pytest.raises(ValueError, match=match):
        calculator(expr)
