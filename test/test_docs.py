"""The documentation site (docs/): every python block of its pages runs, every public name is in the API reference.

Blocks run page by page: the blocks of one page in order, in one namespace, in a temporary working directory. A block
whose first line is ``# not run here: <reason>`` (a GPU, a multi-node Ray cluster, a model-hub download) is compiled
and counted, not run. A ```text block right after a python block (blank lines between at most) is what that block
prints, compared line by line (log records a library writes to stdout left out). The metrics reference is checked in test_docs_metrics.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import importlib.util
import inspect
import io
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NOT_RUN = "# not run here:"
# what a block may need that this machine (CI) lacks; the convention is documented in docs/contributing.md
NOT_RUN_REASONS = re.compile(r"GPU|Ray cluster|download|torchrun", re.I)
_FENCE = re.compile(r"^(`{3,}|~{3,})\s*([^\s`]*)")
# a library's log records on stdout (vLLM's "(EngineCore pid=1) INFO 11-24 18:09:31 [file.py:1] ..."): not the block's
_LOG_LINE = re.compile(r"^(\(\w+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d ")


@dataclasses.dataclass
class Block:
    page: pathlib.Path
    line: int  # of the first code line, 1-based
    code: str
    output: str | None  # the ```text block right after it

    @property
    def is_not_run(self) -> bool:
        return self.code.startswith(NOT_RUN)

    @property
    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page.name
        return f"{page}:{self.line}"


def blocks(page: pathlib.Path) -> list[Block]:
    """The ```python blocks of a MyST page, each with the ```text block that follows it, if any."""
    lines = page.read_text().splitlines()
    fenced: list[tuple[str, int, int, str]] = []  # (language, first code line, line after the fence, code)
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, language, start = match.group(1), match.group(2), i + 1
        end = next((j for j in range(start, len(lines)) if lines[j].strip() == fence[0] * len(fence)
                    or lines[j].startswith(fence) and not lines[j][len(fence):].strip()), len(lines))  # fmt: skip
        fenced.append((language, start + 1, end + 1, "\n".join(lines[start:end]) + "\n"))
        i = end + 1
    out = []
    for k, (language, line, after, code) in enumerate(fenced):
        if language != "python":
            continue
        output = None
        if k + 1 < len(fenced) and fenced[k + 1][0] == "text":
            between = lines[after : fenced[k + 1][1] - 2]
            if not any(text.strip() for text in between):
                output = fenced[k + 1][3]
        out.append(Block(page, line, code, output))
    return out


def pages() -> list[pathlib.Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)


def _page_id(page: pathlib.Path) -> str:
    return str(page.relative_to(DOCS))


def _run_page(page: pathlib.Path) -> None:
    namespace: dict = {"__name__": "__main__"}
    for block in blocks(page):
        code = compile("\n" * (block.line - 1) + block.code, str(block.page), "exec")
        if block.is_not_run:
            continue
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                exec(code, namespace)
        except Exception as err:
            raise AssertionError(f"the block at {block.where} raised {type(err).__name__}: {err}") from err
        if block.output is not None:
            got = [line.rstrip() for line in printed.getvalue().rstrip("\n").splitlines() if not _LOG_LINE.match(line)]
            said = [line.rstrip() for line in block.output.rstrip("\n").splitlines()]
            assert got == said, f"the block at {block.where} printed {got}, its page says {said}"
    namespace.clear()
    gc.collect()


@pytest.mark.parametrize("page", [p for p in pages() if any(not b.is_not_run for b in blocks(p))], ids=_page_id)
def test_every_python_block_of_the_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # a block may import a module an earlier block wrote
    _run_page(page)


def test_blocks_not_run_here_say_why_and_compile():
    not_run = [b for p in pages() for b in blocks(p) if b.is_not_run]
    for block in not_run:
        reason = block.code.splitlines()[0][len(NOT_RUN) :].strip()
        assert NOT_RUN_REASONS.search(reason), (
            f"{block.where}: '{NOT_RUN} {reason}' names no reason of the convention (a GPU, a multi-node Ray "
            "cluster, a model-hub download, processes under torchrun; docs/contributing.md)"
        )
        compile(block.code, block.where, "exec")  # what is not run still parses
    ran = sum(not b.is_not_run for p in pages() for b in blocks(p))
    assert ran > 5 * len(not_run), f"{len(not_run)} blocks not run against {ran} run: {[b.where for b in not_run]}"


def test_block_parser_pairs_a_block_with_the_output_after_it(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# t\n\n```python\nprint(1)\n```\n\n```text\n1\n```\n\nprose\n\n```python\n# not run here: a GPU\n"
                    "x = 1\n```\n\nprose\n\n```text\nnot an output\n```\n\n````markdown\n```python\nnested\n```\n````\n")  # fmt: skip
    found = blocks(page)
    assert [(b.line, b.output, b.is_not_run) for b in found] == [(4, "1\n", False), (14, None, True)]
    with pytest.raises(AssertionError, match=r"page.md:4 printed \['1'\], its page says \['2'\]"):
        page.write_text(page.read_text().replace("```text\n1\n", "```text\n2\n"))
        _run_page(page)


# -- the API reference --

def _api_extension():
    spec = importlib.util.spec_from_file_location("tokengym_api", DOCS / "_ext" / "tokengym_api.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("tokengym_api", module)
    spec.loader.exec_module(module)
    return module


def _public_packages() -> list[str]:
    spec = importlib.util.spec_from_file_location("public_surface", ROOT / "test" / "test_public_surface.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PACKAGES


def test_every_public_name_has_an_entry_with_its_signature_in_the_api_reference():
    api = _api_extension()
    assert set(_public_packages()) <= set(api.PACKAGES), "a package of test_public_surface.py has no API page"
    toc = (DOCS / "api" / "index.md").read_text()
    for package in [api.TOP, *api.PACKAGES, *api.MODULES]:
        page = DOCS / "api" / f"{package}.rst"
        assert page.is_file() and f"\n{package}\n" in toc, f"{package} has no page docs/api/{package}.rst in the toctree"
        assert f".. tokengym-api:: {package}" in page.read_text()
    pages = {package: "\n".join(api.package_rst(package)) for package in api.PACKAGES}
    homes, missing = api.homes(), []
    for package in api.PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj):
                assert obj.__name__ in api.PACKAGES + api.MODULES, f"{package}.{name}: a module without an API page"
                continue
            home_package, home_name = homes[id(obj)].rsplit(".", 1)
            entry = rf"^\.\. auto(class|function|data|exception):: {re.escape(home_package)}\.{home_name}$"
            if not re.search(entry, pages[home_package], re.M):
                missing.append(f"{package}.{name}")
    assert not missing, f"public names without an entry in the API reference: {missing}"


def test_built_api_reference_documents_every_public_name(tmp_path):
    """Against the last ``make docs`` build (its object inventory); built here, as ``make docs`` builds it, when
    there is none newer than the sources (``make test`` builds the docs first)."""
    inventory = DOCS / "_build" / "html" / "objects.inv"
    sources = [p for folder in ("llm_envs", "transforms", "collectors", "tokengym", "docs") for p in (ROOT / folder).rglob("*")
               if p.suffix in (".py", ".md", ".rst") and "_build" not in p.parts]  # fmt: skip
    if not inventory.is_file() or inventory.stat().st_mtime < max(p.stat().st_mtime for p in sources):
        out = tmp_path / "html"
        subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-n", "-W", "--keep-going", "-E", "-q",
                        str(DOCS), str(out)], check=True, cwd=ROOT)  # fmt: skip
        inventory = out / "objects.inv"
    from sphinx.util.inventory import InventoryFile

    with inventory.open("rb") as f:
        data = InventoryFile.load(f, "", lambda base, uri: uri)
    documented = {name for kind in data.values() for name in kind}
    api = _api_extension()
    homes = api.homes()  # a name exported by two packages is documented at its home
    expected = [homes[id(getattr(importlib.import_module(p), n))] for p in api.PACKAGES for n in api.public_names(p)]
    expected += api.MODULES
    assert not [name for name in expected if name not in documented]
