"""docs/guides/lora.md runs: its python blocks in order, in one namespace, in a temporary directory; a block whose
first line is ``# not run here: <reason>`` is compiled, not run; a ```text block right after a python block is what
that block prints (vLLM's own log lines aside)."""

import contextlib
import io
import pathlib
import re

PAGE = pathlib.Path(__file__).resolve().parents[3] / "docs" / "guides" / "lora.md"
_VLLM_LOG = re.compile(r"^(\(\S+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d ")  # vLLM logs to stdout
_BLOCK = re.compile(r"^```python\n(.*?)^```\n(?:\s*^```text\n(.*?)^```\n)?", re.M | re.S)


def test_every_python_block_of_the_lora_guide_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    blocks = _BLOCK.findall(PAGE.read_text())
    assert len(blocks) >= 4
    for code, expected in blocks:
        compiled = compile(code, str(PAGE), "exec")
        if code.startswith("# not run here:"):
            continue
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compiled, namespace)
        if expected:
            said = [line for line in printed.getvalue().splitlines() if not _VLLM_LOG.match(line)]
            assert said == expected.splitlines(), code
