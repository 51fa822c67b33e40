"""What the tool's code must not reach: processes that outlive it, other processes' environment, the network.

Bounded probes only: every spawned process sleeps 30 seconds at most (long enough that a machine under load does
not end it before the check, which would hide a survivor), and the only network
target is a socket this test opens on 127.0.0.1. Each probe has a control showing that it detects
the thing it looks for (a process seen while the tool runs; the rlimit fallback, which is not a
security boundary, reading what bwrap hides).
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

import tokengym
from tokengym.llm_envs import tools
from tokengym.llm_envs.tools import run_python

SANDBOXES = ["bwrap", "rlimit"]
ROOMY = 60.0  # the timeout of a probe that should finish: no loaded machine reaches it (5 s once did)

# the tool's code starts a process whose command line carries MARKER (visible in the host's /proc),
# waits until it runs, holds for HOLD seconds, then returns normally
_FORKED = """
import os, sys, time
if os.fork() == 0:
    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(30)", "{marker}"])
time.sleep({hold})
print("returning")
"""
_DOUBLE_FORK_SETSID = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(30)", "{marker}"])
    os._exit(0)
os.wait()
time.sleep({hold})
print("returning")
"""


def _pids_with(marker: str) -> list[int]:
    """Host pids whose command line contains ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                    found.append(int(name))
            except OSError:
                pass
    return found


@pytest.mark.parametrize("sandbox", SANDBOXES)
@pytest.mark.parametrize(
    ("template", "how"),
    [(_FORKED, "normal return"), (_DOUBLE_FORK_SETSID, "normal return"), (_DOUBLE_FORK_SETSID, "timeout")],
    ids=["fork", "double-fork-setsid", "double-fork-setsid-timeout"],
)
def test_no_child_survives_the_tool(sandbox, template, how):
    marker = f"tokengym-probe-{uuid.uuid4().hex}"
    # outcomes, not timings: a normal return has all the time a loaded machine needs (the sandbox's start-up
    # included); a timed-out one holds far past its timeout, long enough for its child to have started
    timeout = 60.0 if how == "normal return" else 6.0
    hold = 1.5 if how == "normal return" else 25
    code = template.format(marker=marker, hold=hold)
    seen_while_running = []
    box = {}
    worker = threading.Thread(target=lambda: box.update(result=run_python(code, timeout_s=timeout, sandbox=sandbox)))
    worker.start()
    while not seen_while_running and worker.is_alive():  # looked for as long as the tool runs
        seen_while_running = _pids_with(marker)
        time.sleep(0.05)
    worker.join()
    result = box["result"]
    assert seen_while_running, "control: the probe process was never seen while the tool ran"
    if how == "normal return":
        assert (result.output, result.error) == ("returning\n", None)
    else:
        assert result.error == "timeout after 6 s"
    assert _pids_with(marker) == [], f"a child of the tool survived it ({sandbox}, {how})"
    time.sleep(0.3)
    assert _pids_with(marker) == []


# an orphan of the code says who adopted it: the supervisor (which kills and reaps every descendant before it exits,
# so none is alive when run_python returns), or bwrap's namespace init (which kills them only after bwrap has
# reported the exit: a survivor seen once under load)
_ADOPTER = """
import os, sys, time
supervisor = os.getppid()
r, w = os.pipe()
middle = os.fork()
if middle == 0:
    middle = os.getpid()
    if os.fork() == 0:
        while os.getppid() == middle:  # until the middle process has exited and this one is adopted
            time.sleep(0.01)
        os.write(w, str(os.getppid()).encode())
        time.sleep(30)
    os._exit(0)
os.waitpid(middle, 0)
os.close(w)
adopter = int(os.read(r, 32))
print("supervisor" if adopter == supervisor else f"pid {adopter}, not the supervisor {supervisor}")
"""


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_the_supervisor_adopts_and_reaps_the_codes_orphans(sandbox):
    result = run_python(_ADOPTER, timeout_s=ROOMY, sandbox=sandbox)
    assert (result.output, result.error) == ("supervisor\n", None)


@pytest.fixture
def trainer_with_secret():
    """A process started with a secret in its environment, standing in for the trainer (and its parent chain)."""
    secret = f"s3cret-{uuid.uuid4().hex}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, "TOKENGYM_SECRET": secret})  # fmt: skip
    yield proc.pid, secret
    proc.kill()
    proc.wait()


_READ_ENVIRONS = """
import os
hits = []
for pid in [{pids}] + [int(p) for p in os.listdir("/proc") if p.isdigit()]:
    try:
        if b"{secret}" in open(f"/proc/{{pid}}/environ", "rb").read():
            hits.append(pid)
    except OSError:
        pass
print(sorted(set(hits)), os.environ.get("TOKENGYM_SECRET"))
"""


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_environ_of_other_processes(sandbox, trainer_with_secret):
    pid, secret = trainer_with_secret
    code = _READ_ENVIRONS.format(pids=f"{pid}, {os.getpid()}, {os.getppid()}", secret=secret)
    out = run_python(code, timeout_s=ROOMY, sandbox=sandbox).output
    if sandbox == "bwrap":
        assert out == "[] None\n"  # its own /proc: no host process is visible
    else:
        assert out == f"[{pid}] None\n"  # control: the fallback is no boundary, the probe does read environs


# the caller: imports only the sandbox modules (no torch), then lets the tool look for its own secret
_CALLER = """
import json, os, sys, types
sandbox, packages = sys.argv[1], json.loads(sys.argv[2])
for name, path in packages:
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module
from tokengym.llm_envs.tools.python_sandbox import run_python
probe = (
    "import os\\n"
    "hits = []\\n"
    f"for pid in [{os.getpid()}] + [int(p) for p in os.listdir('/proc') if p.isdigit()]:\\n"
    "    try:\\n"
    f"        hits += [pid] if {os.environ['TOKENGYM_SECRET'].encode()!r} in open(f'/proc/{{pid}}/environ', 'rb').read() else []\\n"
    "    except OSError:\\n"
    "        pass\\n"
    "print(sorted(set(hits)))\\n"
)
print(os.getpid(), run_python(probe, timeout_s=60.0, sandbox=sandbox).output, end="")
"""


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_environ_of_the_calling_process(sandbox):
    """The process calling run_python has a secret in its environment from its start, as a trainer would."""
    packages = [("tokengym", os.path.dirname(tokengym.__file__)),
                ("tokengym.llm_envs", os.path.dirname(os.path.dirname(tools.__file__))),
                ("tokengym.llm_envs.tools", os.path.dirname(tools.__file__))]  # fmt: skip
    env = {**os.environ, "TOKENGYM_SECRET": uuid.uuid4().hex}
    done = subprocess.run([sys.executable, "-c", _CALLER, sandbox, json.dumps(packages)], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    caller, hits = done.stdout.split(" ", 1)
    if sandbox == "bwrap":
        assert hits == "[]\n"  # the caller's /proc/<pid>/environ is out of reach
    else:
        assert hits == f"[{caller}]\n"  # control: under rlimit the probe does read the caller's environ


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_network(sandbox):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n"
                "    print('connected')\nexcept OSError as err:\n    print(type(err).__name__)")  # fmt: skip
        out = run_python(code, timeout_s=ROOMY, sandbox=sandbox).output
    if sandbox == "bwrap":
        assert out == "ConnectionRefusedError\n"  # its own network namespace: nothing listens on its loopback
    else:
        assert out == "connected\n"  # control: the fallback shares the host's network


def test_bwrap_has_no_capabilities_and_sees_only_itself():
    code = ("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
            "print([line.split()[1] for line in open('/proc/self/status') if line.startswith('CapEff')])")  # fmt: skip
    pids, caps = run_python(code, timeout_s=ROOMY, sandbox="bwrap").output.splitlines()
    assert pids == "[1, 2, 3]"  # bwrap's init, the supervisor, the tool's code
    assert caps == "['0000000000000000']"
