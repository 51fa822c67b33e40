"""The bubblewrap (``bwrap``) command line of the Python sandbox, and a cached check that it works here."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

__all__ = ["bwrap_command", "bwrap_problem", "find_bwrap"]

SANDBOX_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
               "PYTHONIOENCODING": "utf-8", "LANG": "C.UTF-8"}  # fmt: skip
# system directories, read-only; a merged-/usr symlink (/bin -> usr/bin) is recreated as a symlink
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# the few /etc files a dynamically linked interpreter and `time` read; nothing else of /etc is visible
_ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")


def find_bwrap() -> str | None:
    """Path of the ``bwrap`` executable, or ``None``."""
    return shutil.which("bwrap")


def _interpreter_dirs() -> list[str]:
    """Host directories the interpreter needs: its real binary's folder and its installation prefix."""
    dirs = {os.path.dirname(os.path.realpath(sys.executable)), sys.base_prefix, sys.base_exec_prefix}
    dirs = sorted(os.path.realpath(d) for d in dirs if d and os.path.isdir(d))
    kept: list[str] = []
    for d in dirs:  # sorted, so a parent comes before its subfolders; /usr is bound already
        if not any(d == k or d.startswith(k.rstrip("/") + "/") for k in ["/usr", *kept]):
            kept.append(d)
    return kept


def bwrap_command(bwrap: str, python_argv: list[str], *, tmp_mb: int) -> list[str]:
    """The ``bwrap`` argv that runs ``python_argv`` isolated.

    New PID, network, IPC and UTS namespaces; ``--die-with-parent`` and the PID namespace's init
    take every process down with the sandbox; no capabilities; an empty environment but
    :data:`SANDBOX_ENV`; its own ``/proc`` and minimal ``/dev``; a private ``/tmp`` (tmpfs of
    ``tmp_mb`` MB, the working directory, the only writable place); system directories and the
    interpreter's prefix read-only, nothing else of the host filesystem.
    """
    argv = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
            "--new-session", "--cap-drop", "ALL", "--clearenv"]  # fmt: skip
    for name, value in SANDBOX_ENV.items():
        argv += ["--setenv", name, value]
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for path in _ETC_FILES:
        argv += ["--ro-bind-try", path, path]
    for path in _interpreter_dirs():
        argv += ["--ro-bind", path, path]
    if os.path.realpath(sys.executable).startswith(os.path.realpath(sys.prefix) + os.sep):
        cfg = os.path.join(sys.prefix, "pyvenv.cfg")  # a venv made with --copies finds its stdlib through it
        argv += ["--ro-bind-try", cfg, cfg]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(tmp_mb * 1024 * 1024), "--tmpfs", "/tmp",
             "--remount-ro", "/", "--chdir", "/tmp", "--", *python_argv]  # fmt: skip
    return argv


@functools.lru_cache(maxsize=4)
def bwrap_problem(bwrap: str) -> str | None:
    """``None`` if ``bwrap`` runs this interpreter here, else why not (checked once per path and process).

    bwrap can be installed and still unusable, e.g. in a container that forbids new namespaces.
    """
    argv = bwrap_command(bwrap, [os.path.realpath(sys.executable), "-I", "-S", "-c", "print('ok')"], tmp_mb=1)
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{bwrap} did not run: {err}"
    if done.returncode != 0 or done.stdout.strip() != b"ok":
        why = (done.stderr or done.stdout).decode("utf-8", errors="replace").strip()[:300]
        return f"{bwrap} failed with exit code {done.returncode}: {why}"
    return None
