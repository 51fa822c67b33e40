"""SGLang's server dialect through the same fleet as vLLM's: waves, weights from disk, failover, partial rollouts.

SGLang needs CUDA, so the servers here are the test server of SGLang's documented native API
(``test/collectors/sglang_api_server.py``: a transformers model of ``tokengym.testing`` behind ``/generate``,
``/update_weights_from_disk``, ``/abort_request``, ...), real processes on 127.0.0.1. What is asserted is what the
dialect sends and reads and what the fleet does with it; SGLang itself is not run.
"""

import threading
import time

import httpx
import pytest
import torch
from collector_helpers import assert_log_probs_under_their_versions
from sglang_api_server import SGLangAPIServer

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import (
    FleetDialect,
    RequestRejected,
    SamplingConfig,
    ServerPolicy,
    SGLangServerDialect,
    check_dialect,
)
from tokengym.collectors.policies._server_weights import DirectoryTransport
from tokengym.llm_envs import TokenEnv
from tokengym.testing import tiny_model, tiny_tokenizer

PROMPTS = ["What is 12 + 7?", "hi", "Reverse the string abc:", "a b c d e f g h", "1+1=", "count down 5 4"]
EOS_IDS = list(range(1, 512, 7))  # many end ids: rows stop at different lengths
DIALECT = SGLangServerDialect()


def _chunk(rid, ids, generated, finish=None):
    return {"output_ids": ids, "meta_info": {"id": rid, "finish_reason": finish, "completion_tokens": generated,
                                             "output_token_logprobs": [[-0.1 * t, t, None] for t in ids]}}  # fmt: skip


# -- the dialect alone --
def test_a_request_carries_sglangs_fields_and_none_of_vllms():
    check_dialect(DIALECT, FleetDialect)
    base = DIALECT.sampling_fields(SamplingConfig(temperature=0.7))
    row = DIALECT.stream(DIALECT.row(DIALECT.wave_fields(base, [2, 3], ["\n"]), [5, 6], 8, seed=11))
    params = row["sampling_params"]
    assert row["input_ids"] == [5, 6] and row["return_logprob"] is True and row["stream"] is True
    assert row["rid"].startswith("tokengym-") and row["rid"] != DIALECT.stream(row)["rid"]
    assert params["max_new_tokens"] == 8 and params["sampling_seed"] == 11 and params["temperature"] == 0.7
    assert params["top_k"] == -1 and params["stop_token_ids"] == [2, 3] and params["stop"] == ["\n"]
    assert params["ignore_eos"] is True and params["skip_special_tokens"] is False and params["no_stop_trim"] is True
    sent = set(row) | set(params)
    assert not sent & {"min_tokens", "return_token_ids", "max_tokens", "prompt", "logprobs", "request_id", "seed"}
    greedy = DIALECT.row(DIALECT.sampling_fields(SamplingConfig(greedy=True)), [5], 4, seed=None)
    assert greedy["sampling_params"]["temperature"] == 0.0 and "sampling_seed" not in greedy["sampling_params"]


def test_streamed_events_are_read_whole_or_incremental_and_a_row_resumes_from_its_tokens():
    row = DIALECT.row(DIALECT.wave_fields(DIALECT.sampling_fields(SamplingConfig()), [2], []), [5, 6], 5, seed=1)
    answer = DIALECT.answer()
    DIALECT.take(answer, _chunk("a", [9], 1))
    DIALECT.take(answer, _chunk("a", [9, 8], 2))  # SGLang's default: everything so far
    assert DIALECT.reply(answer) == ([9, 8], [-0.9, -0.8]) and not DIALECT.finished(answer)
    assert DIALECT.generated(answer) == 2 and DIALECT.generated(answer) is None
    again = DIALECT.resume(row, answer)  # its server failed: the rest goes elsewhere, from the tokens received
    assert again["input_ids"] == [5, 6, 9, 8] and again["sampling_params"]["max_new_tokens"] == 3
    assert again["sampling_params"]["sampling_seed"] == 1 and row["input_ids"] == [5, 6]
    DIALECT.take(answer, _chunk("b", [7], 1))  # the new request, incremental or not: appended
    DIALECT.take(answer, _chunk("b", [4], 2))  # --incremental-streaming-output: the new token only
    DIALECT.take(answer, _chunk("b", [7, 4, 2], 3, {"type": "stop", "matched": 2}))
    assert DIALECT.reply(answer)[0] == [9, 8, 7, 4, 2] and DIALECT.finished(answer)
    assert DIALECT.resume(row, answer) is None  # nothing left: it ended
    aborted = DIALECT.answer()
    DIALECT.take(aborted, _chunk("c", [3], 1, {"type": "abort", "message": "Abort in waiting queue"}))
    assert DIALECT.received(aborted) == 1 and not DIALECT.finished(aborted)  # an abort is no end
    with pytest.raises(RequestRejected, match=r"HTTP 400 \(an error event in its stream\): too long"):
        DIALECT.take(DIALECT.answer(), {"error": {"message": "too long"}})


def test_a_server_policy_needs_a_dialect_and_a_transport_needs_the_engines_calls(tmp_path):
    env = TokenEnv(PROMPTS, tiny_tokenizer(), batch_size=2, max_new_tokens=4, max_length=64)
    with pytest.raises(TypeError, match=r"ServerPolicy needs the servers' dialect: pass dialect=VLLMServerDialect\(\)"):
        ServerPolicy("http://127.0.0.1:9", env)  # refused before a connection is tried
    transport = DirectoryTransport(tmp_path)
    with pytest.raises(ValueError, match=r"built without reload, so no server can be told to load .*transport\(root\)"):
        transport.load_calls(transport.publish([("w", torch.ones(2))], 1))
    assert DIALECT.transport(tmp_path).load_calls("/w/v1") == [("/update_weights_from_disk", {"model_path": "/w/v1"})]


# -- on running test servers of SGLang's API --
class Fleet:
    def __init__(self, tmp_path_factory):
        self.tok = tiny_tokenizer()
        self.model = tiny_model(self.tok)
        self.path = tmp_path_factory.mktemp("sglang_model")
        self.model.save_pretrained(self.path)
        self.tok.save_pretrained(self.path)
        self.servers = [SGLangAPIServer(self.path, step_delay_s=0.005) for _ in range(2)]

    def env(self, **kwargs):
        kwargs = {"batch_size": 4, "max_new_tokens": 12, "max_length": 64, "eos_token_ids": EOS_IDS, **kwargs}
        return TokenEnv(PROMPTS, self.tok, model_config=self.model.config, **kwargs)

    def policy(self, env, servers=None, **kwargs):
        urls = [s.url for s in (servers or self.servers)]
        return ServerPolicy(urls, env, dialect=SGLangServerDialect(), **kwargs)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fleet = Fleet(tmp_path_factory)
    try:
        for server in fleet.servers:
            server.launch()
        for server in fleet.servers:
            server.wait()
        yield fleet
    finally:
        for server in fleet.servers:
            server.stop()


def _assert_teacher_forced(result, request, model, teacher_forcing):
    for i, prompt in enumerate(request.prompts):
        n = int(result.lengths[i])
        torch.testing.assert_close(result.log_probs[i, :n], teacher_forcing(model, prompt, result.actions[i, :n]),
                                   atol=2e-4, rtol=0)  # fmt: skip


def test_waves_on_the_fleet_are_the_tiny_models_teacher_forced_log_probs(fleet, teacher_forcing):
    env = fleet.env()
    policy = fleet.policy(env, seed=3)
    try:
        env.reset()
        request = env.wave_request()
        result = policy.generate(request)
        assert result.finished is None and int(result.lengths.min()) >= 1
        _assert_teacher_forced(result, request, fleet.model, teacher_forcing)
        assert all(s.answered > 0 for s in policy.fleet.servers)  # the wave was spread over both servers
        batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=8, source="wave")))
        assert_log_probs_under_their_versions(batch, {0: fleet.model}, env, atol=2e-4)
    finally:
        policy.close()


def test_a_policy_refuses_sampling_whose_log_probs_sglang_does_not_report(fleet):
    with pytest.raises(ValueError, match=r"SGLang server http://127.0.0.1:\d+ reports log-probs of the temperature-"
                                         r"scaled distribution, not of one truncated by top_k=5"):  # fmt: skip
        fleet.policy(fleet.env(), sampling=SamplingConfig(top_k=5))
    with pytest.raises(ValueError, match=r"max_length=256 tokens but SGLang server \S+ has 128 positions; .*--context-length"):
        fleet.policy(fleet.env(max_length=256))


def test_weights_from_disk_reach_every_server_and_tag_it(fleet, teacher_forcing):
    env = fleet.env()
    policy = fleet.policy(env, seed=4)
    new = tiny_model(fleet.tok, seed=1)
    try:
        assert policy.update_weights(new.state_dict()) == 1
        for server in fleet.servers:  # SGLang's weight version, as its /get_model_info says
            info = httpx.get(server.url + "/get_model_info", timeout=60).json()
            assert info["weight_version"] == policy.weights_tag(1) and info["model_path"].endswith("v00000001")
        env.reset()
        request = env.wave_request()
        result = policy.generate(request)
        assert result.version == 1
        _assert_teacher_forced(result, request, new, teacher_forcing)
        assert policy.counts()["server_reloads"] == 2
    finally:
        policy.update_weights(fleet.model.state_dict())
        policy.close()
    # a new policy sees servers an earlier run updated: it reloads their checkpoint (the directory they started from)
    again = fleet.policy(env)
    try:
        assert {httpx.get(s.url + "/get_model_info", timeout=60).json()["weight_version"] for s in fleet.servers} == {"default"}
    finally:
        again.close()


def test_an_interrupt_aborts_the_rows_by_rid_and_the_next_wave_goes_on_from_their_tokens(fleet, teacher_forcing):
    env = fleet.env(max_new_tokens=60, max_length=128, eos_token_ids=[])
    policy = fleet.policy(env, seed=5)
    try:
        env.reset()
        request = env.wave_request()
        policy.interrupt.set()  # set before the wave: it stops at its first event
        stopped = policy.generate(request)
        assert stopped.finished is not None and not bool(stopped.finished.any())
        assert 1 <= int(stopped.lengths.sum()) < 4 * 60
        _assert_teacher_forced(stopped, request, fleet.model, teacher_forcing)
        assert policy.counts()["server_discarded_tokens"] == 0  # every aborted stream was read to its end
        env.unroll(request, stopped)
        policy.interrupt.clear()
        after = env.wave_request()
        left = {int(b): 60 - int(n) for b, n in zip(request.slots, stopped.lengths, strict=True)}
        assert after.max_new_tokens.tolist() == [left[int(b)] for b in after.slots]
        result = policy.generate(after)
        assert result.finished is None and result.lengths.tolist() == after.max_new_tokens.tolist()
        _assert_teacher_forced(result, after, fleet.model, teacher_forcing)
    finally:
        policy.close()


def test_a_server_killed_mid_wave_hands_its_rows_on_from_their_tokens(fleet, teacher_forcing, caplog):
    """Runs last: it kills server 1. Its rows go on on server 0 from what they received (the dialect's resume)."""
    env = fleet.env(max_new_tokens=60, max_length=128, eos_token_ids=[])
    policy = fleet.policy(env, seed=6)
    try:
        env.reset()
        request = env.wave_request()
        out = {}
        wave = threading.Thread(target=lambda: out.setdefault("result", policy.generate(request)))
        wave.start()
        victim = policy.fleet.servers[1]
        deadline = time.monotonic() + 60
        while victim.streamed < 8 and time.monotonic() < deadline:
            time.sleep(0.005)
        fleet.servers[1].kill()
        wave.join(120)
        result = out["result"]
        assert result.finished is None and int(result.lengths.min()) >= 1  # every row ended its turn
        _assert_teacher_forced(result, request, fleet.model, teacher_forcing)
        counts = policy.counts()
        assert counts["server_failovers"] == 1 and counts["servers_up"] == 1
        assert counts["failover_kept_tokens"] > 0 and counts["retried_requests"] >= 1
        assert f"SGLang server {fleet.servers[1].url} marked down" in caplog.text  # the fleet names the engine
    finally:
        policy.close()
