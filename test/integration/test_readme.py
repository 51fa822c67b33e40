"""The README's code blocks run as written (the quickstart, the environments, the TRL reward, over-long prompt
and KL-in-the-loss examples)."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _block(title: str) -> str:
    """The first ```python block after the line that starts with ``title``."""
    match = re.search(r"^" + re.escape(title) + r".*?```python\n(.*?)```", README.read_text(), re.S | re.M)
    assert match is not None, f"README has no python block after {title!r}"
    return match.group(1)


def _run(title: str, capsys) -> list[str]:
    exec(compile(_block(title), "README.md", "exec"), {})
    return capsys.readouterr().out.strip().splitlines()


def test_readme_quickstart_runs(capsys):
    printed = _run("## Quickstart", capsys)
    assert len(printed) >= 2  # one line per collected batch


def test_readme_environments_run(capsys):
    printed = _run("## Environments", capsys)
    assert [line.split(")")[0] + ")" for line in printed] == ["(8, 16)", "(4, 64)", "(4, 64)"]


def test_readme_overlong_prompts_example_prints_what_the_readme_says(capsys):
    printed = _run("- **Prompts**", capsys)
    said = re.search(r"printed `(.*?)`", README.read_text()).group(1)
    assert printed == [said]


def test_readme_turn_handler_runs(capsys):
    printed = _run("### A new kind of turn", capsys)
    assert printed[0].startswith("TokenEnv(batch_size=2,") and "turns=GuessSeven(), max_turns=3)" in printed[0]


@pytest.mark.parametrize("title", ["### TRL reward functions", "### KL in the loss"])
def test_readme_sections_run(title, capsys):
    _run(title, capsys)
