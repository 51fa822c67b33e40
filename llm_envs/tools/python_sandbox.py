"""Run model-written Python in a sandbox (the ``python`` tool): bubblewrap where it works, else rlimits.

Two sandboxes; :attr:`PythonResult.sandbox` says which one ran:

- ``"bwrap"`` (used when `bubblewrap <https://github.com/containers/bubblewrap>`_ is installed and
  works here; Debian/Ubuntu: ``apt-get install bubblewrap``): new PID, network, IPC and UTS
  namespaces, so every process the code starts (double fork + ``setsid`` included) dies when the
  tool returns, there is no network, and ``/proc`` shows only the sandbox (the trainer's
  ``/proc/<pid>/environ`` is out of reach); no capabilities; an empty environment; a private
  ``/tmp`` (a tmpfs of ``4 * max_file_mb`` MB, the working directory and the only writable
  place); system directories and the interpreter read-only, nothing else of the host filesystem.
  Plus the rlimits below.
- ``"rlimit"`` (the fallback): a child process with rlimits (address space, CPU, file size, no
  core dumps) in its own session, an empty environment and a fresh temporary working directory
  that is always deleted. A supervisor (a Linux child subreaper) kills every process the code
  started when it ends, and the process group is killed after every run. It is **not** a
  security boundary: the code runs as the same user, sees the same filesystem, the network and
  other processes' ``/proc`` entries.

In both, the code arrives on stdin (any size), runs as ``__main__`` with ``python -I -S`` (no
site-packages), wall time is bounded (the sandbox is killed) and the output is truncated. Neither
bounds the number of processes (a fork bomb is cut by the timeout, not prevented). For untrusted
code at scale, prefer a VM-grade sandbox (gVisor, Firecracker). POSIX only.

Example:
    >>> result = run_python("print(6 * 7)", timeout_s=5)
    >>> result.output, result.error, result.sandbox in ("bwrap", "rlimit")
    ('42\\n', None, True)
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import tempfile
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path

from tokengym.llm_envs.tools._bwrap import SANDBOX_ENV, bwrap_command, bwrap_problem, find_bwrap
from tokengym.llm_envs.tools._process import remove_tree, run_process

__all__ = ["PythonResult", "Sandbox", "python_tool", "run_python"]

_SUPERVISOR = Path(__file__).with_name("_supervisor.py").read_text(encoding="utf-8")
_SURROGATE = re.compile("[\ud800-\udfff]")


class Sandbox(StrEnum):
    """Which sandbox :func:`run_python` uses; ``AUTO`` is bwrap where it works, else rlimit."""

    AUTO = "auto"
    BWRAP = "bwrap"
    RLIMIT = "rlimit"


@dataclasses.dataclass(frozen=True)
class PythonResult:
    """Outcome of :func:`run_python`.

    Attributes:
        output: stdout and stderr of the code, line by line in the order written, truncated to
            ``max_output_chars``.
        error: ``None`` on success, else a short reason (``"timeout after 5 s"``, ``"exit code 1"``...).
        is_truncated: the output was cut.
        sandbox: the sandbox that ran the code, ``"bwrap"`` or ``"rlimit"``.
    """

    output: str
    error: str | None = None
    is_truncated: bool = False
    sandbox: str = Sandbox.RLIMIT.value


def _check_number(name: str, value, low: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= low:
        raise ValueError(f"{name} must be a number >= {low}, got {value!r}")


def _encode_code(code: str) -> bytes:
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    if "\x00" in code:
        raise ValueError(f"code contains a NUL byte at index {code.index(chr(0))}; Python source cannot contain "
                         "NUL bytes (remove it, or write '\\x00' inside a string literal)")  # fmt: skip
    bad = _SURROGATE.search(code)
    if bad is not None:
        raise ValueError(f"code contains a lone surrogate {bad.group()!r} at index {bad.start()}, which is not "
                         "valid text; decode the source with errors='replace' first")  # fmt: skip
    return code.encode("utf-8")


def _parse_sandbox(sandbox: Sandbox | str) -> Sandbox:
    try:
        return Sandbox(sandbox)
    except ValueError:
        raise ValueError(f"sandbox must be one of {[s.value for s in Sandbox]}, got {sandbox!r}") from None


def _choose(sandbox: Sandbox | str) -> tuple[Sandbox, str | None]:
    kind = _parse_sandbox(sandbox)
    if kind is Sandbox.RLIMIT:
        return kind, None
    bwrap = find_bwrap()
    problem = "bwrap is not installed" if bwrap is None else bwrap_problem(bwrap)
    if problem is None:
        return Sandbox.BWRAP, bwrap
    if kind is Sandbox.BWRAP:
        raise RuntimeError(f"sandbox='bwrap' but {problem}; install bubblewrap (Debian/Ubuntu: apt-get install "
                           "bubblewrap) where namespaces are allowed, or pass sandbox='auto' or 'rlimit'")  # fmt: skip
    return Sandbox.RLIMIT, None


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 2000,
               max_file_mb: int = 16, sandbox: Sandbox | str = Sandbox.AUTO) -> PythonResult:  # fmt: skip
    """Run ``code`` in a sandbox with limits (see the module docstring); never raises for code that fails.

    Args:
        code: Python source, any length.
        timeout_s: wall-time limit; then every process of the run is killed (CPU limit: the next
            whole second).
        memory_mb: address-space limit of each process (``RLIMIT_AS``).
        max_output_chars: stdout + stderr are cut to this many characters.
        max_file_mb: largest file the code may write.
        sandbox: ``"auto"`` (bwrap where it works, else rlimit), ``"bwrap"`` or ``"rlimit"``.

    Returns:
        a :class:`PythonResult`; ``error`` names a timeout, a non-zero exit, a signal or a failure to start.

    Raises:
        TypeError: ``code`` is not a str.
        ValueError: ``code`` holds a NUL byte or a lone surrogate (it cannot be Python source), or a
            limit or ``sandbox`` is invalid.
        RuntimeError: ``sandbox="bwrap"`` where bwrap is missing or cannot create namespaces.
    """
    data = _encode_code(code)
    _check_number("timeout_s", timeout_s, 0.01)
    _check_number("memory_mb", memory_mb, 16)
    _check_number("max_output_chars", max_output_chars, 1)
    _check_number("max_file_mb", max_file_mb, 1)
    kind, bwrap = _choose(sandbox)
    is_bwrap = kind is Sandbox.BWRAP
    # the supervisor reaps every descendant before it exits, under bwrap too: bwrap reports the command's exit as soon as
    # its PID namespace's init hears of it, before the kernel has torn the namespace down (under load, a process the
    # code started was still alive after run_python returned)
    limits = [str(int(memory_mb)), str(int(timeout_s) + 1), str(int(max_file_mb)), "1"]
    python = [os.path.realpath(sys.executable), "-I", "-S", "-c", _SUPERVISOR, *limits]
    common = {"timeout_s": timeout_s, "max_output_chars": int(max_output_chars), "is_pid_namespace": is_bwrap}
    if is_bwrap:
        argv = bwrap_command(bwrap, python, tmp_mb=4 * int(max_file_mb))
        outcome = run_process(argv, data, cwd="/", env={"PATH": SANDBOX_ENV["PATH"]}, **common)
    else:
        cwd = tempfile.mkdtemp(prefix="tokengym_py_")
        try:
            outcome = run_process(python, data, cwd=cwd, env={**SANDBOX_ENV, "HOME": cwd, "TMPDIR": cwd}, **common)
        finally:
            remove_tree(cwd)
    return _result(outcome, kind, int(max_output_chars))


def _result(outcome, kind: Sandbox, max_output_chars: int) -> PythonResult:
    text = outcome.output.decode("utf-8", errors="replace")
    is_truncated = outcome.is_flooded or len(text) > max_output_chars
    text = text[:max_output_chars]
    error, code = outcome.error, outcome.returncode
    if error is None and not outcome.is_flooded and code:
        if kind is Sandbox.BWRAP and 128 < code <= 128 + 64:
            code = 128 - code  # bwrap reports a child killed by signal N as exit code 128 + N
        error = f"exit code {code}" if code > 0 else f"killed by signal {-code}"
    return PythonResult(text, error, is_truncated, kind.value)


def python_tool(*, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 2000,
                sandbox: Sandbox | str = Sandbox.AUTO) -> Callable[[str], str]:  # fmt: skip
    """The ``python`` tool: runs the argument with :func:`run_python`.

    A non-zero exit, a timeout or a kill raises ``RuntimeError`` carrying the (truncated) output,
    so the registry reports it as a tool error.

    Example:
        >>> python_tool()("print(2 ** 8)")
        '256\\n'
    """
    _parse_sandbox(sandbox)  # a bad value fails here, not at the first call

    def python(code: str) -> str:
        result = run_python(code, timeout_s=timeout_s, memory_mb=memory_mb, max_output_chars=max_output_chars,
                            sandbox=sandbox)  # fmt: skip
        output = result.output + (" [output truncated]" if result.is_truncated else "")
        if result.error is not None:
            raise RuntimeError(f"{result.error}" + (f"\n{output}" if output else ""))
        return output

    return python
