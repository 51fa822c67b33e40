"""Start-up checks of a vLLM server against the env and the sampling: what the server says, and what it means.

:func:`inspect_server` asks one server what it is: ``/health``; ``/v1/models`` (model id, ``max_model_len``);
``/server_info`` (its log-prob mode, where the server exposes it: ``VLLM_SERVER_DEV_MODE=1``); the
vocabulary size (vLLM names it when a request's ``logit_bias`` holds an id past the vocabulary); a
one-token probe restricted to one allowed id, whose log-prob is exactly 0 when the server reports
processed log-probs; and ``/detokenize`` of probe ids spread over the vocabulary (the server finds stop
strings in the text it decodes, so it must decode as the env's tokenizer does). It returns a
plain dict, :func:`check_server` compares it with the env and the sampling and raises a ``ValueError``
naming the server and the fix for anything that would give wrong tokens or log-probs.
"""

from __future__ import annotations

import re

import httpx

from tokengym.collectors.policies._server_fleet import Server, ServerFleet
from tokengym.collectors.policies._server_options import RequestRejected
from tokengym.collectors.policies._vllm_requests import check_logprobs_mode

__all__ = ["check_fleet", "check_server", "inspect_server", "probe_ids"]

_VOCAB = re.compile(r"Vocabulary size: (\d+)")


def probe_ids(tokenizer, n: int = 2048) -> list[int]:
    """About ``n`` ids spread evenly over ``tokenizer``'s vocabulary (specials included)."""
    size = len(tokenizer)
    return list(range(0, size, max(1, size // n)))


async def inspect_server(fleet: ServerFleet, server: Server, ids: list[int]) -> dict:
    """What ``server`` says about itself (see the module docstring); raises ``ValueError`` when it cannot be
    reached or serves no model."""
    try:
        await fleet.call(server, "GET", "/health")
        models = (await fleet.call(server, "GET", "/v1/models"))["data"]
    except (httpx.HTTPError, OSError) as err:
        raise ValueError(f"vLLM server {server.url} cannot be reached ({type(err).__name__}: {err}); start it "
                         "(tokengym.collectors.LocalVLLMServer, or python -m vllm.entrypoints.openai.api_server "
                         "--model DIR ...) or fix the URL") from err  # fmt: skip
    if len(models) != 1:
        raise ValueError(f"vLLM server {server.url} serves {len(models)} models ({[m['id'] for m in models]}); "
                         "tokengym needs one model per server")  # fmt: skip
    answer = {"url": server.url, "model": models[0]["id"], "root": models[0].get("root"),
              "max_model_len": models[0].get("max_model_len"), "logprobs_mode": None}  # fmt: skip
    try:
        info = await fleet.call(server, "GET", "/server_info?config_format=json")
        answer["logprobs_mode"] = info["vllm_config"]["model_config"]["logprobs_mode"]
        answer["dev_mode"] = bool(info.get("vllm_env", {}).get("VLLM_SERVER_DEV_MODE", False))
    except (httpx.HTTPStatusError, RequestRejected, KeyError, TypeError):
        answer["dev_mode"] = False  # /server_info exists only with VLLM_SERVER_DEV_MODE=1
    answer["vocab_size"] = await _vocab_size(fleet, server)
    answer["probe_log_prob"] = await _probe_log_prob(fleet, server)
    try:
        answer["probe_text"] = (await fleet.call(server, "POST", "/detokenize", {"tokens": ids}))["prompt"]
    except (httpx.HTTPStatusError, RequestRejected, KeyError):
        answer["probe_text"] = None  # a server without a tokenizer: stop strings are left to the env
    answer["probe_ids"] = ids
    return answer


async def _vocab_size(fleet: ServerFleet, server: Server) -> int | None:
    body = {"prompt": [0], "max_tokens": 1, "logit_bias": {str(2**31 - 1): 0.0}}
    try:
        await fleet.call(server, "POST", "/v1/completions", body)
    except RequestRejected as err:
        match = _VOCAB.search(str(err))
        return int(match.group(1)) if match else None
    return None


async def _probe_log_prob(fleet: ServerFleet, server: Server) -> float:
    """Log-prob of a token sampled from a distribution restricted to it: 0 in processed mode."""
    body = {"prompt": [0], "max_tokens": 1, "logprobs": 0, "allowed_token_ids": [0], "temperature": 1.0, "top_k": 0,
            "top_p": 1.0, "min_p": 0.0, "seed": 0}  # fmt: skip
    answer = await fleet.call(server, "POST", "/v1/completions", body)
    return float(answer["choices"][0]["logprobs"]["token_logprobs"][0])


def check_server(answer: dict, env, *, is_unmodified: bool, model: str | None = None) -> None:
    """Raise a ``ValueError`` naming the server and the fix when ``answer`` (:func:`inspect_server`) does
    not fit ``env`` or would report log-probs of another distribution than the one sampled from.

    Example:
        >>> from tokengym.llm_envs import TokenEnv
        >>> from tokengym.testing import tiny_tokenizer
        >>> env = TokenEnv(["hi"], tiny_tokenizer(), max_length=64)
        >>> answer = {"url": "http://h:8000", "model": "m", "max_model_len": 32, "vocab_size": 512,
        ...           "logprobs_mode": "processed_logprobs", "probe_log_prob": 0.0}
        >>> check_server(answer, env, is_unmodified=True)
        Traceback (most recent call last):
        ...
        ValueError: vLLM server http://h:8000: max_model_len 32 is shorter than the env's max_length 64: ...
    """
    url = answer["url"]
    if model is not None and answer["model"] != model:
        raise ValueError(f"vLLM server {url} serves {answer['model']!r}, not {model!r}; point the policy at "
                         "servers of one model (or pass model=None)")  # fmt: skip
    mode = answer.get("logprobs_mode")
    if mode is None:  # not exposed: the probe tells processed log-probs (exactly 0 for a single allowed id)
        mode = "processed_logprobs" if answer["probe_log_prob"] == 0.0 else "not processed_logprobs (probed)"
    check_logprobs_mode(mode, is_unmodified, where=f"vLLM server {url}")
    max_model_len = answer.get("max_model_len")
    if max_model_len is not None and int(max_model_len) < env.max_length:
        raise ValueError(
            f"vLLM server {url}: max_model_len {max_model_len} is shorter than the env's max_length {env.max_length}: "
            f"long prompts would not fit; build the env with max_length={max_model_len} or start the server with "
            "a larger --max-model-len"
        )
    vocab = answer.get("vocab_size")
    if vocab is not None and vocab < len(env.tokenizer):
        raise ValueError(f"vLLM server {url}: its model has vocab_size {vocab}, smaller than the env tokenizer's "
                         f"{len(env.tokenizer)}: the server's model and the env's tokenizer do not match")  # fmt: skip
    if vocab is not None and vocab > env.vocab_size:
        raise ValueError(f"vLLM server {url}: its model can emit ids up to {vocab - 1} but the env accepts "
                         f"[0, {env.vocab_size}); build the env with model_config=model.config")  # fmt: skip
    text = answer.get("probe_text")
    if text is not None and text != env.tokenizer.decode(answer["probe_ids"]):
        raise ValueError(f"vLLM server {url}: its tokenizer decodes ids differently from the env's (stop strings "
                         "would be found in the wrong places); save the env's tokenizer into the server's model "
                         "directory")  # fmt: skip


def check_fleet(answers: list[dict]) -> None:
    """All servers must serve the same model with the same limits."""
    first = answers[0]
    for a in answers[1:]:
        for field in ("model", "max_model_len", "vocab_size"):
            if a.get(field) != first.get(field):
                raise ValueError(f"vLLM servers {first['url']} and {a['url']} differ in {field} ({first.get(field)!r} "
                                 f"vs {a.get(field)!r}); every server of a fleet serves the same model")  # fmt: skip
