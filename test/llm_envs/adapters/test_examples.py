"""The adapter examples (examples/*_env.py) run end to end; the OpenEnv one against the test server."""

import pathlib
import runpy
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[3] / "examples"


@pytest.mark.parametrize("script", ["reasoning_gym_env.py", "textarena_env.py", "openenv_env.py"])
def test_example_runs(script, monkeypatch, capsys, request):
    argv = ["--url", request.getfixturevalue("openenv_server").url] if script == "openenv_env.py" else []
    monkeypatch.setattr(sys, "argv", [script, *argv])
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    out = capsys.readouterr().out
    assert out.count("\n") >= 2 and "nan" not in out.lower(), out
