"""OpenEnv errors that name the cause, against real servers: nothing listening, a session limit below the env's
batch size (openenv-core's ``max_concurrent_envs``), a server killed mid-episode; the wording says what failed."""

import logging
import time

import pytest
from adapter_helpers import Server

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import TransformersPolicy
from tokengym.errors import EpisodeError, PromptError
from tokengym.llm_envs.adapters import make_openenv_env
from tokengym.llm_envs.errors import refill_failures

END_IDS = list(range(1, 512, 7))


def _env(url, tok, lm, **kwargs):
    kwargs = {"batch_size": 4, "max_turns": 3, "max_new_tokens": 24, "max_length": 256, "eos_token_ids": END_IDS,
              "model_config": lm.config, "timeout_s": 10.0, **kwargs}  # fmt: skip
    return make_openenv_env(url, tok, **kwargs)


def test_nothing_listening_fails_at_construction(tok):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"OpenEnv server http://127\.0\.0\.1:1 cannot be reached \(GET /health: "
                                         r".*Connection.*\); start it .* or fix the URL"):  # fmt: skip
        make_openenv_env("http://127.0.0.1:1", tok, batch_size=2)
    assert time.perf_counter() - start < 5


def test_a_session_limit_below_the_batch_size_is_named(tok, lm, caplog):
    caplog.set_level(logging.WARNING, logger="tokengym")
    server = Server("openenv", args=["--max-concurrent", "2"])
    try:
        env = _env(server.url, tok, lm, batch_size=4)
        with pytest.raises(PromptError) as caught:
            env.reset()
        cause = caught.value.__cause__
        assert isinstance(cause, EpisodeError) and cause.what == "episode(s) could not start"
        message = str(cause)
        for part in ("the server refused a new session at reset", "Server at capacity: 2/2 sessions active",
                     "it allows 2 concurrent sessions (openenv's max_concurrent_envs)", "(2 open now)",
                     "start the server with max_concurrent_envs >= the env's batch_size or build the env with "
                     "batch_size <= 2"):  # fmt: skip
            assert part in message, (part, message)
        assert f"ws://127.0.0.1:{server.port}/ws" in message
        logged = [r for r in caplog.records if r.name.startswith("tokengym.") and "could not start" in r.getMessage()]
        assert len(logged) == 2 and all(r.levelno == logging.WARNING for r in logged)  # two slots over the limit
        assert len(env.turns.backend.live) == 2  # the two sessions the server took go on
        env.close()
    finally:
        server.stop()


def test_a_server_that_went_away_is_worded_so(tok, lm, caplog):
    caplog.set_level(logging.WARNING, logger="tokengym")
    server = Server("openenv")
    try:
        env = _env(server.url, tok, lm, batch_size=2)
        collector = TokenCollector(env, TransformersPolicy(lm, env), mode="steps", batch_size=2)
        iterator = iter(collector)
        next(iterator)
        server.stop()  # SIGKILL mid-episode: the sessions' connections break
        with pytest.raises(PromptError) as caught:
            for _ in range(100):
                next(iterator)
        cause = caught.value.__cause__
        assert isinstance(cause, EpisodeError) and cause.what == "episode(s) lost their server: it went away"
        assert "went away" in str(cause) and f"ws://127.0.0.1:{server.port}/ws" in str(cause)
        assert any("went away" in r.getMessage() for r in caplog.records if r.name.startswith("tokengym."))
        collector.shutdown()
    finally:
        server.stop()


def test_a_refill_says_what_failed():
    failed = [(0, EpisodeError("episode 3 could not start on X: SessionClosed: ...", what="episode(s) could not start")),
              (1, EpisodeError("episode 4 failed at turn 1 on X: ServerGone: ...",
                               what="episode(s) lost their server: it went away")),
              (2, EpisodeError("episode 5 could not start on X: ...", what="episode(s) could not start")),
              (3, PromptError("prompt 7 has 900 tokens"))]  # fmt: skip
    message = refill_failures(failed)
    assert message.startswith("2 episode(s) could not start, 1 episode(s) lost their server: it went away, 1 prompt(s) "
                              "could not be loaded and were skipped (slot 0: episode 3 could not start on X")  # fmt: skip
