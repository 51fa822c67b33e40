"""A non-editable install works: build a wheel, install it in a fresh virtualenv outside the source tree,
import every module from it and run the README quickstart there.

The fresh venv reuses the dependencies already installed beside the running interpreter (a ``.pth``
file naming its site-packages, whose own ``.pth`` files, such as the editable install's finder, are
not processed), so nothing is downloaded and only the wheel provides ``tokengym``.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# source folder -> package name, as setup.py maps them
FOLDERS = {"tokengym": "tokengym", "llm_envs": "tokengym.llm_envs", "transforms": "tokengym.transforms",
           "collectors": "tokengym.collectors"}  # fmt: skip
NOT_SOURCE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")

CHECK = r"""
import contextlib, importlib, io, json, pkgutil, sys, time
start = time.perf_counter()
import tokengym
found = sorted(m.name for m in pkgutil.walk_packages(tokengym.__path__, "tokengym."))
files = {name: importlib.import_module(name).__file__ for name in ["tokengym", *found]}
from tokengym.testing import tiny_tokenizer
vocab = len(tiny_tokenizer())
imported = time.perf_counter()
with contextlib.redirect_stdout(io.StringIO()) as printed:
    exec(compile(sys.argv[1], "README.md", "exec"), {})
quickstart = time.perf_counter()
from tokengym.__main__ import main
with contextlib.redirect_stdout(io.StringIO()) as help_text, contextlib.suppress(SystemExit):
    main(["demo", "--help"])
print(json.dumps({"modules": found, "files": files, "vocab": vocab, "printed": printed.getvalue(),
                  "help": help_text.getvalue(), "import_s": imported - start, "quickstart_s": quickstart - imported}))
"""


def _expected_modules(src: pathlib.Path) -> list[str]:
    """Every module and package under the mapped source folders, named as installed."""
    names = set()
    for folder, package in FOLDERS.items():
        for path in (src / folder).rglob("*.py"):
            parts = path.relative_to(src / folder).with_suffix("").parts
            in_packages = all((src / folder / pathlib.Path(*parts[:i]) / "__init__.py").is_file()
                              for i in range(len(parts)))  # fmt: skip
            if in_packages:
                names.add(".".join([package, *(p for p in parts if p != "__init__")]))
    return sorted(names - {"tokengym"})


def _run(cmd: list[str], cwd: pathlib.Path, timeout: float = 120) -> str:
    # one torch thread, as in test/conftest.py (two threads make tiny models 20-50x slower on 2 cores)
    env = {**os.environ, "PYTHONNOUSERSITE": "1", "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    env.pop("PYTHONPATH", None)
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"{cmd} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_source_tree(tmp_path):
    start = time.perf_counter()
    src = tmp_path / "src"  # a clean copy: no stale build/ or egg-info from the working tree
    src.mkdir()
    for name in ["setup.py", "pyproject.toml", "README.md"]:
        shutil.copy2(ROOT / name, src / name)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, src / folder, ignore=NOT_SOURCE)
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(wheels), str(src)], cwd=tmp_path)  # fmt: skip
    (wheel,) = wheels.glob("tokengym-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    site = pathlib.Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             cwd=tmp_path).strip())  # fmt: skip
    (site / "_reuse_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
          str(wheel)], cwd=tmp_path)  # fmt: skip

    installed = time.perf_counter()

    work = tmp_path / "elsewhere"  # cwd outside the repo: nothing importable from the source tree
    work.mkdir()
    quickstart = re.search(r"## Quickstart\n\n```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    report = json.loads(_run([str(python), "-c", CHECK, quickstart], cwd=work).strip().splitlines()[-1])
    assert report["modules"] == _expected_modules(src)
    for name, file in report["files"].items():
        assert pathlib.Path(file).is_relative_to(site), f"{name} imported from {file}, not from the wheel"
    assert report["vocab"] == 512  # the tokenizer fixture ships in the wheel
    assert len(report["printed"].strip().splitlines()) >= 2  # the quickstart: one line per collected batch
    assert "--iterations" in report["help"] and "--held-out" in report["help"]
    script = (venv / "bin" / "tokengym").read_text()  # the console script calls the same main
    assert "from tokengym.__main__ import main" in script
    print(f"wheel build + venv + install {installed - start:.1f} s, import every module {report['import_s']:.1f} s, "
          f"quickstart {report['quickstart_s']:.1f} s, total {time.perf_counter() - start:.1f} s")
