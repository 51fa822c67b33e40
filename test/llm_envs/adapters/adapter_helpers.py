"""Helpers of the adapter tests: collecting, decoding turns, test servers on free ports (stopped by process group)."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tokengym.collectors import TokenCollector
from tokengym.llm_envs import keys

SERVER = Path(__file__).with_name("openenv_server.py")
SOURCES = ("step", "wave", "vllm")


def collect(env, policy, kind, *, trajectories, max_batches=50):
    """TRAJECTORIES batches with at least ``trajectories`` trajectories in all."""
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=env.batch_size[0], source=kind)
    batches, n = [], 0
    for batch in collector:
        batches.append(batch)
        n += batch.shape[0]
        if n >= trajectories or len(batches) >= max_batches:
            break
    return batches


def turn_texts(tok, batch, row):
    """The decoded response of each turn of trajectory ``row`` (special tokens skipped, as the env decodes)."""
    mask, turn, action = batch[keys.MASK][row], batch[keys.TURN][row], batch[keys.ACTION][row]
    return [tok.decode(action[mask & (turn == t)], skip_special_tokens=True) for t in turn[mask].unique().tolist()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process (``openenv_server.py --mode ...``) on a free port of 127.0.0.1, in its own process group."""

    def __init__(self, mode="openenv", timeout_s=60.0, *, args=()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, str(SERVER), "--port", str(self.port), "--mode", mode, *args],
                                     start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not self.is_up(mode):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"test server ({mode}) did not come up on port {self.port}")
            time.sleep(0.1)

    def is_up(self, mode) -> bool:
        try:
            if mode == "openenv":
                with urllib.request.urlopen(f"{self.url}/health", timeout=1):
                    return True
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def stop(self):
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def gym_episode(env, actions, seed=0):
    """``env.reset(seed=seed)`` (a GymTokenEnv) and then ``actions`` until the episode ends: [reset, *steps]."""
    out = [env.reset(seed=seed)]
    for action in actions:
        out.append(env.step(action))
        if out[-1][2] or out[-1][3]:
            break
    return out
