"""Start the sandbox process, feed it the code on stdin, read its output within a budget, and clean up.

Whatever happens (normal exit, timeout, output flood, an exception here), the process group is
killed before :func:`run_process` returns, and :func:`remove_tree` removes a folder even when an
escaped process writes into it or made parts of it unreadable.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import time

from tokengym.llm_envs.tools._supervisor import children_of

__all__ = ["ProcessOutcome", "remove_tree", "run_process"]

_GRACE_S = 1.0  # after a SIGTERM, how long the supervisor gets to kill the tool's processes


class ProcessOutcome:
    """Raw output, the reason the run was cut (``None`` if not), whether the output flooded, the exit status."""

    __slots__ = ("output", "error", "is_flooded", "returncode")

    def __init__(self, output: bytes, error: str | None, is_flooded: bool, returncode: int | None) -> None:
        self.output, self.error, self.is_flooded, self.returncode = output, error, is_flooded, returncode


def run_process(argv: list[str], stdin_data: bytes, *, cwd: str | None, env: dict[str, str], timeout_s: float,
                max_output_chars: int, is_pid_namespace: bool) -> ProcessOutcome:  # fmt: skip
    """Run ``argv`` with ``stdin_data`` on its stdin and stdout+stderr captured; never leaves a process behind.

    ``is_pid_namespace``: the process's child is the init of a PID namespace (bwrap): stopping
    SIGKILLs that init, which takes every process inside down before ``argv`` exits; otherwise
    the process is the supervisor, stopped with SIGTERM (it kills the code's processes first).
    """
    try:
        # no preexec_fn (the supervisor sets its own limits): subprocess can then use vfork, which
        # does not copy a large trainer's page tables the way fork does
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    except OSError as err:
        return ProcessOutcome(b"", f"could not start the sandbox: {err}", False, None)
    deadline = time.monotonic() + timeout_s
    try:
        output, error, flooded = _exchange(proc, stdin_data, deadline, timeout_s, max_output_chars)
        if error is not None or flooded:
            _stop(proc, is_pid_namespace)
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()) + 0.5)
        except subprocess.TimeoutExpired:  # it closed its stdout but ran on past the deadline
            _stop(proc, is_pid_namespace)
            error = error or f"timeout after {timeout_s:g} s"
        return ProcessOutcome(output, error, flooded, proc.returncode)
    finally:
        _kill_group(proc)  # children left in the group (a normal exit included)
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()


def _exchange(proc: subprocess.Popen, data: bytes, deadline: float, timeout_s: float, max_output_chars: int):
    """Write ``data`` to stdin and read stdout until EOF, the deadline or ~4 bytes per allowed char."""
    budget, chunks, error = 4 * max_output_chars + 4, [], None
    view, written = memoryview(data), 0
    os.set_blocking(proc.stdin.fileno(), False)
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        sel.register(proc.stdin, selectors.EVENT_WRITE)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                error = f"timeout after {timeout_s:g} s"
                break
            events = sel.select(timeout=min(left, 0.05))
            if not events and proc.poll() is not None and not sel.select(timeout=0):
                break
            for key, _ in events:
                if key.fileobj is proc.stdin:
                    try:
                        written += os.write(proc.stdin.fileno(), view[written : written + 65536])
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # the sandbox died before reading everything; its output says why
                        written = len(data)
                    if written >= len(data):
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    return b"".join(chunks), error, False
                chunks.append(chunk)
                budget -= len(chunk)
                if budget <= 0:
                    return b"".join(chunks), error, True  # enough: the rest is dropped when the group is killed
    return b"".join(chunks), error, False


def _stop(proc: subprocess.Popen, is_pid_namespace: bool) -> None:
    """Stop the sandbox so that no process of it is left when ``proc`` has exited, then SIGKILL the group.

    bwrap: SIGKILL the namespace's init (bwrap's child); the kernel kills everything inside and
    bwrap exits once it has reaped that init. (Killing bwrap itself would return at once while
    ``--die-with-parent`` tears the namespace down in the background.) rlimit: SIGTERM the
    supervisor, which kills the code's processes, escaped ones included, and waits for them.
    """
    try:
        targets = children_of(proc.pid) if is_pid_namespace else []
        for pid in targets:
            os.kill(pid, signal.SIGKILL)
        if not targets:
            proc.send_signal(signal.SIGTERM if not is_pid_namespace else signal.SIGKILL)
        proc.wait(timeout=_GRACE_S)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group id outlives its leader while members remain
    except (ProcessLookupError, PermissionError):
        pass


def remove_tree(path: str) -> None:
    """Delete ``path``; retry while something writes into it, restore permissions the code removed."""
    for _ in range(50):
        if not os.path.lexists(path):
            return
        for root, dirs, _files in os.walk(path):
            for name in dirs:
                sub = os.path.join(root, name)
                if not os.path.islink(sub):
                    try:
                        os.chmod(sub, 0o700)
                    except OSError:
                        pass
        shutil.rmtree(path, ignore_errors=True)
        if os.path.lexists(path):
            time.sleep(0.01)
    if os.path.lexists(path):
        raise OSError(f"could not remove the sandbox folder {path}")
