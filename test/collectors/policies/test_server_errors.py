"""Errors that name the cause, as a user of VLLMServerPolicy and LocalVLLMServer meets them, on real processes.

The module starts, in parallel: a vLLM server of ``tiny_model(tok)`` (head size 16: vLLM's CPU attention cannot
run it, but the server loads it and comes up), and a server that cannot start (an impossible memory fraction,
whose log ends with a consequence rather than the cause). A foreign HTTP server is
``python -m http.server``. The head-size server's engine is killed by the test that shows an engine dying: the
tests run in order.
"""

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from tokengym.collectors.policies import LocalVLLMServer, ServerOptions, VLLMServerPolicy
from tokengym.collectors.policies.vllm_server import free_port
from tokengym.llm_envs import TokenEnv
from tokengym.testing import tiny_model, tiny_tokenizer

SMALL_KV = ["--max-model-len", "128", "--kv-cache-memory-bytes", str(1 << 24)]


class Servers:
    def __init__(self, tmp_path_factory):
        self.tok = tiny_tokenizer()
        self.head16 = tiny_model(self.tok)  # the default size: head size 16
        self.dir = tmp_path_factory.mktemp("head16")
        self.head16.save_pretrained(self.dir)
        self.tok.save_pretrained(self.dir)
        self.served = LocalVLLMServer(self.dir, args=SMALL_KV)
        # vLLM's CPU backend reserves --gpu-memory-utilization of all memory, more than is free: it refuses to start
        self.greedy = LocalVLLMServer(self.dir, args=["--max-model-len", "128", "--gpu-memory-utilization", "0.99"],
                                      keep_log=True)  # fmt: skip
        self.all = [self.served, self.greedy]

    def env(self):
        return TokenEnv(["hi", "1+1="], self.tok, batch_size=2, max_new_tokens=4, max_length=64,
                        model_config=self.head16.config)  # fmt: skip

    def policy(self, url, **options):
        return VLLMServerPolicy(url, self.env(), options=ServerOptions(api_key=self.served.api_key, **options))


@pytest.fixture(scope="module")
def servers(tmp_path_factory, running_servers):
    servers = Servers(tmp_path_factory)
    with running_servers(servers.all, wait=[servers.served]):  # the other one's failing start is a test
        yield servers


@pytest.fixture(scope="module")
def foreign_server(tmp_path_factory):
    """``python -m http.server``: an HTTP server that is not vLLM (its 404 is an HTML page)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                            cwd=tmp_path_factory.mktemp("www"), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    yield url
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def _health(url) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status
    except OSError as err:
        return getattr(err, "code", -1)


# -- VLLMServerPolicy at construction --
def test_a_served_model_whose_head_size_cpu_attention_cannot_run_is_refused(servers):
    with pytest.raises(ValueError, match=r"the model vLLM server http://127\.0\.0\.1:\d+ serves \(.*head16.*\) has attention "
                                         r"head size 16 .* cannot run .*engine would die.*size='small'"):  # fmt: skip
        servers.policy(servers.served.url)
    assert _health(servers.served.url) == 200  # refused before any request reached its engine


def test_a_url_with_v1_gets_a_hint(servers):
    url = servers.served.url
    with pytest.raises(ValueError, match=rf"server URL '{url}/v1/' ends with /v1, .* pass '{url}'"):
        servers.policy([url + "/v1/"])


def test_a_foreign_http_server_is_not_a_vllm_server(servers, foreign_server):
    with pytest.raises(ValueError, match=rf"{foreign_server} is not a vLLM server \(.*HTTP 404: a text/html page") as caught:
        servers.policy(foreign_server)
    message = str(caught.value)
    assert "<html" not in message.lower() and "<!doctype" not in message.lower() and "check the port" in message


def test_an_engine_that_died_is_named_with_its_log(servers, tmp_path):
    # the model directory is not visible here (a server on another path or host): nothing to check the head size
    # on, so the construction's first generation request reaches the engine, which dies
    hidden = tmp_path / "elsewhere"
    servers.dir.rename(hidden)
    try:
        with pytest.raises(ValueError, match=r"failed while tokengym checked it: .*its engine died \(HTTP 500: "
                                             r"EngineCore.*the cause is in its log ") as caught:  # fmt: skip
            servers.policy(servers.served.url)
    finally:
        hidden.rename(servers.dir)
    log = servers.served.log_path
    assert str(log) in str(caught.value)
    assert "head_dim=16" in log.read_text()  # the cause is where the message says
    servers.served.stop()
    assert not log.exists()  # stopped: its log is removed


# -- LocalVLLMServer --
def test_a_failed_start_quotes_the_root_cause_not_the_last_line(servers):
    with pytest.raises(RuntimeError) as caught:
        servers.greedy.wait()
    message = str(caught.value)
    cause = message.split("its first error (the root cause): ")[1].splitlines()[0]
    assert cause.startswith("ValueError: Available memory on node") and "--gpu-memory-utilization" in cause
    assert "Engine core initialization failed" in message.split("ends:")[1]  # the last lines name a consequence
    log = servers.greedy.log_path
    assert f"kept in {log}" in message and cause in log.read_text()  # keep_log=True: kept
    log.unlink()


def test_a_server_never_launched_leaves_no_log(servers):
    port = free_port()
    server = LocalVLLMServer(servers.dir, port=port)
    server.stop()  # never launched: nothing made, nothing to remove
    assert server.log_path is None
    assert not [f for f in os.listdir(tempfile.gettempdir()) if f.startswith(f"vllm-server-{port}-")]
