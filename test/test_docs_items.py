"""Docs items of issue 41: the landing page's install line and first program, one torch thread beside the quickstart,
code blocks wrapped to the page width, API pages whose right-hand list holds no internal members, and the public pid
of LocalVLLMServer. (The pages' python blocks run in test_docs.py.)"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

from tokengym.collectors.policies import LocalVLLMServer
from tokengym.testing import tiny_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _first_python_block(text: str, after: str = "") -> str:
    match = re.search(re.escape(after) + r".*?```python\n(.*?)```", text, re.S)
    assert match is not None, f"no python block after {after!r}"
    return match.group(1)


def test_the_landing_page_has_the_install_line_and_a_first_program_with_its_output():
    page = (DOCS / "index.md").read_text()
    assert re.search(r"```bash\npip install -e \.\n```", page)
    code = _first_python_block(page)
    assert "train(" in code and "torch.set_num_threads(1)" in code
    assert re.search(r"```python\n.*?```\n\n```text\n\[0, 1\] True\n```", page, re.S), "its output follows it"


@pytest.mark.parametrize(("path", "after"), [("docs/guides/getting-started.md", "## Collect a batch"),
                                             ("README.md", "## Quickstart")])  # fmt: skip
def test_the_quickstart_sets_one_torch_thread_and_says_why(path, after):
    text = (ROOT / path).read_text()
    code = _first_python_block(text, after)
    first, second = code.splitlines()[:2]
    assert first == "import torch" and second.startswith("torch.set_num_threads(1)")
    assert "20-50x slower" in text and "OpenMP" in text


def _conf():
    spec = importlib.util.spec_from_file_location("docs_conf", DOCS / "conf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_code_blocks_wrap_at_the_page_width():
    conf = _conf()
    css = [DOCS / folder / name for folder in conf.html_static_path for name in conf.html_css_files]
    assert css and all(path.is_file() for path in css)
    assert any(re.search(r"pre\s*\{[^}]*white-space:\s*pre-wrap", path.read_text()) for path in css)


def _built_html(tmp_path: pathlib.Path) -> pathlib.Path:
    """The last ``make docs`` build when newer than the sources, else a build here (as test_docs.py does)."""
    html = DOCS / "_build" / "html"
    sources = [p for folder in ("llm_envs", "transforms", "collectors", "tokengym", "docs") for p in (ROOT / folder).rglob("*")
               if p.suffix in (".py", ".md", ".rst", ".css") and "_build" not in p.parts]  # fmt: skip
    inventory = html / "objects.inv"
    if inventory.is_file() and inventory.stat().st_mtime >= max(p.stat().st_mtime for p in sources):
        return html
    out = tmp_path / "html"
    subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-n", "-W", "--keep-going", "-E", "-q", str(DOCS),
                    str(out)], check=True, cwd=ROOT)  # fmt: skip
    return out


@pytest.mark.slow
def test_the_api_pages_right_hand_list_holds_no_internal_members(tmp_path):
    spec = importlib.util.spec_from_file_location("tokengym_api", DOCS / "_ext" / "tokengym_api.py")
    api = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("tokengym_api", api)
    spec.loader.exec_module(api)
    html = _built_html(tmp_path)
    listed: dict[str, list[str]] = {}
    for page in sorted((html / "api").glob("tokengym*.html")):
        toc = re.search(r'<div class="toc-tree">(.*?)</div>\s*</div>', page.read_text(), re.S)
        entries = re.findall(r'<a class="reference internal" href="[^"]*">(.*?)</a>', toc.group(1), re.S) if toc else []
        listed[page.stem] = [re.sub(r"<[^>]+>", "", entry).strip() for entry in entries]
    assert "TokenCollector" in listed["tokengym.collectors"] and "check_loss_inputs()" in listed["tokengym.training"]
    private = [name for names in listed.values() for name in names if re.search(r"(^|\.)_", name)]
    assert not private, private
    members = [name.removesuffix("()").split(".") for names in listed.values() for name in names if name.count(".") == 1]
    hooks = [".".join(m) for m in members if m[1] in api.FRAMEWORK_HOOKS]  # forward(), transform_output_spec()...
    core = set().union(*api.CORE_HOOKS.values())
    collector_hooks = [".".join(m) for m in members if m[0].endswith("Collector") and m[1] in core]
    assert not hooks and not collector_hooks, hooks + collector_hooks
    assert "CollectorBase.collect_batch()" in listed["tokengym.collectors"]  # the core's own entry keeps its hooks
    assert "_static/wrap-code.css" in (html / "index.html").read_text()


def test_a_local_vllm_server_shows_its_pid_before_and_after_its_process(tmp_path, tokenizer):
    tiny_model(tokenizer).save_pretrained(tmp_path)
    server = LocalVLLMServer(tmp_path)
    assert server.pid is None  # not launched
    assert LocalVLLMServer.pid.__doc__ and "os.killpg(server.pid" in LocalVLLMServer.pid.__doc__
