"""`make demo` runs `python -m tokengym demo`: a quick run trains, prints the table and saves the curve."""

import pytest

from tokengym.__main__ import main


def test_demo_quick_run(tmp_path, capsys):
    main(["demo", "--iterations", "3", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "mean reward: first 1 iterations" in out
    assert (tmp_path / "reward_curve.png").stat().st_size > 1000


def test_demo_rejects_bad_iterations():
    with pytest.raises(SystemExit):
        main(["demo", "--iterations", "0"])
