"""Run model-written Python in a separate, resource-limited process (the ``python`` tool).

Threat model, honestly: this sandbox stops *accidents and runaway code*: infinite loops (wall-time
and CPU limits, the child is killed), memory bombs (``RLIMIT_AS``), huge outputs (truncated),
file clutter (a fresh temporary working directory, deleted afterwards), crashes (reported as
text) and leaking the trainer's secrets through environment variables (the child gets an empty
environment with only ``PATH``). It is **not** a security boundary against malicious code: the
child runs as the same user with the same filesystem (it can read and write anything that user
can, outside its cwd too), has network access, can spawn processes and can use Python's ``ctypes``.
Run untrusted code from a policy you do not control inside a container or VM (gVisor, Firecracker,
nsjail) instead. POSIX only (``resource`` and ``preexec_fn``).

Example:
    >>> run_python("print(6 * 7)", timeout_s=5).output
    '42\\n'
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile

__all__ = ["PythonResult", "run_python"]

_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclasses.dataclass(frozen=True)
class PythonResult:
    """Outcome of :func:`run_python`.

    Attributes:
        output: stdout then stderr of the child, truncated to ``max_output_chars``.
        error: ``None`` on success, else a short reason (``"timeout"``, ``"exit code 1"``...).
        is_truncated: the output was cut.
    """

    output: str
    error: str | None = None
    is_truncated: bool = False


def _limits(memory_mb: int, cpu_s: int, max_file_mb: int):
    def apply() -> None:  # runs in the child between fork and exec
        import resource

        mem = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        size = max_file_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.setsid()  # own process group: a timeout kills its children too

    return apply


def _check(name: str, value, low: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= low:
        raise ValueError(f"{name} must be a number >= {low}, got {value!r}")


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 2000,
               max_file_mb: int = 16) -> PythonResult:  # fmt: skip
    """Run ``code`` with ``python -I`` in a fresh temporary directory, with limits; never raises for bad code.

    Args:
        code: Python source.
        timeout_s: wall-time limit; the child's process group is killed after it (CPU limit: the
            next whole second).
        memory_mb: address-space limit of the child (``RLIMIT_AS``).
        max_output_chars: stdout + stderr are cut to this many characters.
        max_file_mb: largest file the child may write.

    Returns:
        a :class:`PythonResult`; ``error`` names a timeout, a non-zero exit or a failure to start.
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    _check("timeout_s", timeout_s, 0.01)
    _check("memory_mb", memory_mb, 16)
    _check("max_output_chars", max_output_chars, 1)
    with tempfile.TemporaryDirectory(prefix="tokengym_py_") as cwd:
        env = {"PATH": _SAFE_PATH, "HOME": cwd, "TMPDIR": cwd, "PYTHONIOENCODING": "utf-8", "LANG": "C.UTF-8"}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", code], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                preexec_fn=_limits(int(memory_mb), int(timeout_s) + 1, int(max_file_mb)),
            )  # fmt: skip
        except OSError as err:
            return PythonResult("", f"could not start python: {err}")
        raw, error, flooded = _collect(proc, timeout_s, max_output_chars)
    text = raw.decode("utf-8", errors="replace")
    is_truncated = flooded or len(text) > max_output_chars
    if is_truncated:
        text = text[:max_output_chars]
    if error is None and not flooded and proc.returncode != 0:
        error = f"exit code {proc.returncode}" if proc.returncode > 0 else f"killed by signal {-proc.returncode}"
    return PythonResult(text, error, is_truncated)


def _collect(proc: subprocess.Popen, timeout_s: float, max_output_chars: int) -> tuple[bytes, str | None, bool]:
    """Read at most ~4 bytes per allowed char (a flood is cut, not buffered), then wait with a deadline."""
    import selectors
    import time

    budget, chunks, error = 4 * max_output_chars + 4, [], None
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                error = f"timeout after {timeout_s:g} s"
                break
            if not sel.select(timeout=min(left, 0.05)):
                if proc.poll() is not None and not sel.select(timeout=0):
                    break
                continue
            data = os.read(proc.stdout.fileno(), 65536)
            if not data:
                break
            chunks.append(data)
            budget -= len(data)
            if budget <= 0:
                break  # enough: the rest is dropped when the child is killed
    flooded = budget <= 0
    if error is not None or flooded:
        _kill(proc)
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()) + 0.5)
    except subprocess.TimeoutExpired:
        _kill(proc)
        proc.wait()
        error = error or f"timeout after {timeout_s:g} s"
    proc.stdout.close()
    return b"".join(chunks), error, flooded


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        proc.kill()
