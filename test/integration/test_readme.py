"""The README is what a first visit needs: its quickstart runs as written, it stays short, and its links into the
documentation lead to pages that exist (the guides' blocks run in test/test_docs.py)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def _block(title: str) -> str:
    """The first ```python block after the line that starts with ``title``."""
    match = re.search(r"^" + re.escape(title) + r".*?```python\n(.*?)```", README.read_text(), re.S | re.M)
    assert match is not None, f"README has no python block after {title!r}"
    return match.group(1)


def test_readme_quickstart_runs(capsys):
    exec(compile(_block("## Quickstart"), "README.md", "exec"), {})
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) >= 2  # one line per collected batch


def test_readme_stays_a_first_visit():
    assert len(README.read_text()) < 15_000, "the README grew: move the details to a guide under docs/"


def test_readme_links_lead_to_documentation_pages_and_headings():
    text = README.read_text()
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", text)
    assert len(links) >= 10
    for path, anchor in links:
        page = ROOT / path
        assert page.is_file(), f"README links to {path}, which does not exist"
        if anchor:
            slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                     for h in re.findall(r"^#{1,6} (.*)$", page.read_text(), re.M)}  # fmt: skip
            assert anchor in slugs, f"README links to {path}#{anchor}, a heading that {path} does not have"
