"""run_python under both sandboxes: results, limits, input checks, and what each run leaves behind.

The isolation tests (escaped children, other processes' environ, network) are in test_python_isolation.py.
"""

import glob
import os
import tempfile
import time

import pytest

import tokengym
from tokengym.llm_envs.tools import ToolRegistry, python_tool, run_python

SANDBOXES = ["bwrap", "rlimit"]  # bwrap runs for real: CI installs bubblewrap (make test)

ROOMY = 60.0  # the timeout of code that should finish: no loaded machine reaches it (5 s once did)


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_output_errors_and_which_sandbox_ran(sandbox):
    ok = run_python("import sys; print(6 * 7); print('warn', file=sys.stderr)", timeout_s=ROOMY, sandbox=sandbox)
    assert (ok.output, ok.error, ok.is_truncated, ok.sandbox) == ("42\nwarn\n", None, False, sandbox)
    crash = run_python("def f():\n    raise ValueError('boom')\nf()", timeout_s=ROOMY, sandbox=sandbox)
    assert crash.error == "exit code 1" and crash.output.startswith("Traceback (most recent call last):\n  File \"main.py\"")
    assert "ValueError: boom" in crash.output and "_supervisor" not in crash.output and "<string>" not in crash.output
    assert run_python("import sys; sys.exit(3)", timeout_s=ROOMY, sandbox=sandbox).error == "exit code 3"
    assert run_python("import os; os.kill(os.getpid(), 9)", timeout_s=ROOMY, sandbox=sandbox).error == "killed by signal 9"
    syntax = run_python("def f(:\n  pass", timeout_s=ROOMY, sandbox=sandbox)
    assert syntax.error == "exit code 1" and "SyntaxError" in syntax.output
    main = run_python("import sys, __main__; print(__name__, sys.argv, __main__.__file__, 'run_python' in dir())",
                      timeout_s=ROOMY, sandbox=sandbox)  # fmt: skip
    assert main.output == "__main__ ['main.py'] main.py False\n"


def test_auto_picks_bwrap_where_it_works():
    sandbox = run_python("print(1)", timeout_s=ROOMY).sandbox
    assert sandbox == "bwrap", "bubblewrap is missing or unusable: `make test` installs it (apt) where it can"


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_timeout_memory_and_output_limits(sandbox):
    slow = run_python("while True:\n    pass", timeout_s=1.0, sandbox=sandbox)
    assert slow.error == "timeout after 1 s"  # killed at its timeout (an unkilled loop would never return)
    big = run_python("x = bytearray(4 * 1024 ** 3)", memory_mb=256, timeout_s=ROOMY, sandbox=sandbox)
    assert big.error == "exit code 1" and "MemoryError" in big.output
    flood = run_python("while True:\n    print('y' * 1000)", timeout_s=5.0, max_output_chars=100, sandbox=sandbox)
    assert flood.is_truncated and flood.error is None and flood.output == "y" * 100
    quiet = run_python("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(1.5)", timeout_s=ROOMY, sandbox=sandbox)
    assert quiet.error is None  # closing stdout early is not a timeout
    huge_file = run_python("open('f', 'wb').write(b'0' * (3 * 1024 * 1024))", max_file_mb=1, timeout_s=ROOMY, sandbox=sandbox)
    assert huge_file.error is not None  # RLIMIT_FSIZE: SIGXFSZ kills the writer


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_code_of_200_kb_goes_through_stdin(sandbox):
    code = "x = 0\n" + "x += 1\n" * 30_000 + "print(x)\n"
    assert len(code.encode()) > 200_000  # argv would fail ("Argument list too long") above ~128 KB
    assert run_python(code, timeout_s=30.0, sandbox=sandbox).output == "30000\n"
    assert run_python("import sys; print(repr(sys.stdin.read()))", timeout_s=ROOMY, sandbox=sandbox).output == "''\n"


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_nul_bytes_and_lone_surrogates(sandbox):
    with pytest.raises(ValueError, match="code contains a NUL byte at index 8"):
        run_python("print(1)\x00", timeout_s=ROOMY, sandbox=sandbox)
    with pytest.raises(ValueError, match=r"lone surrogate '\\ud800' at index 7"):
        run_python("print('\ud800')", timeout_s=ROOMY, sandbox=sandbox)
    out = run_python("import sys; sys.stdout.buffer.write(b'a\\x00b\\xff\\n')", timeout_s=ROOMY, sandbox=sandbox).output
    assert out == "a\x00b\ufffd\n"  # NUL in the output is kept, invalid UTF-8 is replaced
    registry = ToolRegistry({"python": python_tool(sandbox=sandbox)})
    assert registry.run_text("<tool>python: print(1)\x00</tool>").startswith("error: python: code contains a NUL")
    assert registry.metrics["tool_failures"] == 1


def test_rlimit_working_directory_is_always_removed(monkeypatch):
    monkeypatch.setenv("TOKENGYM_SECRET", "x")
    code = ("import os; print(os.getcwd()); print(sorted(os.environ))\n"
            "os.makedirs('locked/deep'); open('locked/deep/f', 'w').write('x'); os.chmod('locked/deep', 0)\n"
            "os.chmod('locked', 0)")  # fmt: skip
    result = run_python(code, timeout_s=ROOMY, sandbox="rlimit")
    cwd, names = result.output.splitlines()
    assert result.error is None and "tokengym_py_" in cwd and not os.path.exists(cwd)
    assert names == str(["HOME", "LANG", "PATH", "PYTHONIOENCODING", "TMPDIR"])


_ESCAPED_WRITER = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:  # an escaped grandchild writing into the working directory for up to 5 s
        end = time.time() + 5
        while time.time() < end:
            open(f"f{time.time_ns()}", "w").close()
    os._exit(0)
os.wait()
time.sleep(0.3)
print(os.getcwd())
"""


def test_rlimit_folder_removed_although_an_escaped_child_writes_into_it():
    result = run_python(_ESCAPED_WRITER, timeout_s=ROOMY, sandbox="rlimit")
    assert result.error is None and "tokengym_py_" in result.output
    cwd = result.output.strip()
    assert not os.path.exists(cwd)
    time.sleep(0.3)
    assert not os.path.exists(cwd)


def test_bwrap_run_leaves_no_host_folder():
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "tokengym_py_*")))
    result = run_python("import os; open('f', 'w').write('x'); print(os.getcwd(), sorted(os.environ))", timeout_s=ROOMY, sandbox="bwrap")
    assert result.output == "/tmp ['HOME', 'LANG', 'PATH', 'PWD', 'PYTHONIOENCODING', 'TMPDIR']\n"
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "tokengym_py_*"))) == before


def test_bwrap_filesystem_is_read_only_and_private():
    code = ("import errno, os\n"
            "for path in ['/usr/x', '/etc/x', '/x', '/tmp/x']:\n"
            "    try:\n        open(path, 'w').close()\n        print('wrote', path)\n"
            "    except OSError as err:\n        print(errno.errorcode[err.errno])\n"
            "print(os.path.exists(os.path.expanduser('~root/.bashrc')), os.path.exists(%r))")  # fmt: skip
    out = run_python(code % os.path.dirname(tokengym.__file__), timeout_s=ROOMY, sandbox="bwrap").output.splitlines()
    assert out == ["EROFS", "EROFS", "EROFS", "wrote /tmp/x", "False False"]
    assert run_python("print(open('/etc/passwd').read())", timeout_s=ROOMY, sandbox="rlimit").output.startswith("root:")  # control


def test_bad_arguments():
    with pytest.raises(TypeError, match="code must be a str, got bytes"):
        run_python(b"print(1)")
    with pytest.raises(ValueError, match="timeout_s must be a number >= 0.01, got 0"):
        run_python("1", timeout_s=0)
    with pytest.raises(ValueError, match=r"sandbox must be one of \['auto', 'bwrap', 'rlimit'\], got 'docker'"):
        run_python("1", sandbox="docker")
    with pytest.raises(ValueError, match="sandbox must be one of"):
        python_tool(sandbox="docker")
