"""The program that runs inside the sandbox: sets the limits, runs the tool's code from stdin, reaps every descendant.

:mod:`tokengym.llm_envs.tools.python_sandbox` runs this file's text with
``python -I -S -c TEXT MEMORY_MB CPU_S MAX_FILE_MB REAP``. It applies the rlimits to itself (so
the parent can start it without a ``preexec_fn``, which would force a slow ``fork`` of a large
trainer process), reads the whole code from stdin (code of any size: nothing goes through
``argv``), points stdin at ``/dev/null``, forks, and runs the code as ``__main__`` in the child.

With ``REAP=1`` (what :func:`run_python` passes, in both sandboxes) it is a Linux child subreaper:
when the child ends, orphaned descendants (double fork + ``setsid`` included) have been re-parented
here, and it kills them before it exits with the child's status; a ``SIGTERM`` (the parent's
timeout) kills the child and the descendants the same way. Under bubblewrap the PID namespace would
kill them too, but only after bwrap has reported the exit: reaping here is what makes them gone
when the parent hears of it.
Importing the module does nothing (:func:`children_of` is also used by the parent).
"""

import _signal as signal  # the C module: `signal` would import enum and functools on every call
import os
import sys

_PR_SET_CHILD_SUBREAPER = 36


class _Stop(Exception):
    pass


def _stop(signum, frame):
    raise _Stop


def children_of(parent: int) -> list[int]:
    """Pids whose parent is ``parent`` (Linux ``/proc``; empty elsewhere)."""
    kids = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return kids
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == parent:
            kids.append(int(name))
    return kids


def _kill_descendants() -> None:
    """SIGKILL every child until none is left (each round, the grandchildren are re-parented here)."""
    for _ in range(1000):
        kids = children_of(os.getpid())
        if not kids:
            break
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in kids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def _set_limits(memory_mb: int, cpu_s: int, max_file_mb: int) -> None:
    import resource

    for limit, value in ((resource.RLIMIT_AS, memory_mb * 1024 * 1024), (resource.RLIMIT_CPU, cpu_s),
                         (resource.RLIMIT_FSIZE, max_file_mb * 1024 * 1024), (resource.RLIMIT_CORE, 0)):  # fmt: skip
        resource.setrlimit(limit, (value, value))


def _become_subreaper() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the parent still kills the process group


def _run_code(code: bytes) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    import builtins
    import types

    main = types.ModuleType("__main__")  # a fresh __main__, as `python main.py` would give the code
    main.__file__, main.__builtins__ = "main.py", builtins
    sys.modules["__main__"] = main
    sys.argv = ["main.py"]
    sys.stdout.reconfigure(line_buffering=True)  # prints and a traceback arrive in the order written
    try:
        exec(compile(code, "main.py", "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as err:  # print the traceback without this file's frame, as `python main.py` would
        import traceback

        traceback.print_exception(type(err), err, err.__traceback__.tb_next)
        sys.stderr.flush()
        sys.exit(1)


def _wait_for(pid: int) -> int:
    """Exit status of ``pid`` (negative: killed by that signal); a SIGTERM here kills it first."""
    try:
        while True:
            done, wait_status = os.wait()  # also reaps orphans re-parented here
            if done == pid:
                return os.waitstatus_to_exitcode(wait_status)
    except _Stop:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return -signal.SIGKILL


def _main(memory_mb: int, cpu_s: int, max_file_mb: int, is_reaper: bool) -> None:
    _set_limits(memory_mb, cpu_s, max_file_mb)
    code = sys.stdin.buffer.read()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if is_reaper:
        _become_subreaper()
    signal.signal(signal.SIGTERM, _stop)
    pid = os.fork()
    if pid == 0:
        _run_code(code)
        sys.exit(0)
    status = _wait_for(pid)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup below must finish
    if is_reaper:
        _kill_descendants()
    sys.stdout.flush()
    if status < 0:  # die by the same signal, so that the parent reports it
        try:
            signal.signal(-status, signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # SIGKILL and SIGSTOP cannot be caught: their action is the default already
        os.kill(os.getpid(), -status)
    os._exit(status if status >= 0 else 128 - status)


if __name__ == "__main__":
    _main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1")
