"""vLLM's start-up checks of a server against the env and the sampling: what the server says, and what it means.

:func:`inspect_server` asks one server what it is: ``/health``; ``/v1/models`` (model id, ``max_model_len``);
``/server_info`` (its log-prob mode and device, where the server exposes it: ``VLLM_SERVER_DEV_MODE=1``); the
model's head size, from the ``config.json`` of the served model directory when it is a directory here (or
``ServerOptions.checkpoint_dir``): vLLM's CPU attention runs a fixed set and its engine dies at the first
request of another, so this is checked before any request reaches the engine; the
vocabulary size (vLLM names it when a request's ``logit_bias`` holds an id past the vocabulary); a
one-token probe restricted to one allowed id, whose log-prob is exactly 0 when the server reports
processed log-probs; and ``/detokenize`` of probe ids spread over the vocabulary (the server finds stop
strings in the text it decodes, so it must decode as the env's tokenizer does). It returns a
plain dict, :func:`check_server` compares it with the env (through the neutral skeleton of :mod:`._server_checks`,
which every server dialect shares) and the sampling and raises a ``ValueError`` naming the server and the fix for
anything that would give wrong tokens or log-probs.

An HTTP server that is not vLLM (``/health`` or ``/v1/models`` missing, or not vLLM's answer) is named so, and
a server whose engine died while answering is described so, with its log when this process started it.

A server that refuses the policy's key (or its lack of one) fails at the first guarded call, ``/v1/models``,
with a :class:`~tokengym.collectors.policies._server_options.RequestRejected` (a ``ValueError``) saying so.
When the policy has a key, :func:`inspect_server` also asks ``/server_info`` without it: a server that
answers has its development endpoints open to anyone who can reach it, and :func:`check_server` warns.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import httpx

from tokengym.collectors.policies._server_checks import check_served, inspect_with, not_this_engine
from tokengym.collectors.policies._server_fleet import Server, ServerFleet
from tokengym.collectors.policies._server_options import RequestRejected
from tokengym.collectors.policies._vllm_requests import check_head_size, check_logprobs_mode, model_dir_config
from tokengym.collectors.policies.sampling import SamplingConfig
from tokengym.collectors.policies.server_guard import KEY_VARIABLE, MIDDLEWARE

__all__ = ["check_server", "inspect_server"]

_START = ("tokengym.collectors.policies.LocalVLLMServer, or python -m vllm.entrypoints.openai.api_server --model DIR "
          "...")  # fmt: skip
_SERVER = ("vLLM's OpenAI-compatible server (python -m vllm.entrypoints.openai.api_server, or "
           "tokengym.collectors.policies.LocalVLLMServer)")  # fmt: skip

_VOCAB = re.compile(r"Vocabulary size: (\d+)")


async def inspect_server(fleet: ServerFleet, server: Server, ids: list[int]) -> dict:
    """What ``server`` says about itself (see the module docstring), ``ids`` being the env tokenizer's
    ``probe_ids``; raises ``ValueError`` when it cannot be reached, is not a vLLM server, serves no model, serves
    one whose head size its CPU attention cannot run, or its engine died. Every call is free of side effects and
    is sent once more when its connection fails."""
    return await inspect_with(fleet, server, lambda call: _inspect(fleet, server, call, ids), name="vLLM", start=_START)


async def _inspect(fleet: ServerFleet, server: Server, call, ids: list[int]) -> dict:
    try:
        await call("GET", "/health")
        models = await call("GET", "/v1/models")
    except RequestRejected as err:
        if err.status_code == 401:
            raise
        raise ValueError(_not_vllm(server, err)) from err
    except ValueError as err:  # a 200 answer that is not JSON
        raise ValueError(_not_vllm(server, f"it answered a page that is not JSON ({err})")) from err
    if not isinstance(models, dict) or not isinstance(models.get("data"), list):
        raise ValueError(_not_vllm(server, f"GET /v1/models answered {str(models)[:80]!r}, not a list of models"))
    models = [m for m in models["data"] if not m.get("parent")]  # LoRA adapters list the base model as parent
    if len(models) != 1:
        raise ValueError(f"vLLM server {server.url} serves {len(models)} models ({[m['id'] for m in models]}); "
                         "tokengym needs one model per server")  # fmt: skip
    answer = {"url": server.url, "model": models[0]["id"], "root": models[0].get("root"),
              "max_model_len": models[0].get("max_model_len"), "logprobs_mode": None}  # fmt: skip
    try:
        info = await call("GET", "/server_info?config_format=json")
        answer["logprobs_mode"] = info["vllm_config"]["model_config"]["logprobs_mode"]
        answer["dev_mode"] = bool(info.get("vllm_env", {}).get("VLLM_SERVER_DEV_MODE", False))
        answer["device"] = (info["vllm_config"].get("device_config") or {}).get("device")
    except (httpx.HTTPStatusError, RequestRejected, KeyError, TypeError, AttributeError) as err:
        if getattr(err, "status_code", None) == 401:
            raise
        answer["dev_mode"] = False  # /server_info exists only with VLLM_SERVER_DEV_MODE=1
    _check_served_head_size(answer, fleet.options.checkpoint_dir)
    answer["is_open"] = False
    if answer["dev_mode"] and fleet.has_key:
        try:
            answer["is_open"] = await fleet.is_open(server, "/server_info")
        except (httpx.HTTPError, OSError):
            pass  # it answered the same path a moment ago: a probe that fails proves nothing either way
    answer["vocab_size"] = await _vocab_size(call)
    answer["probe_log_prob"] = await _probe_log_prob(call)
    try:
        answer["probe_text"] = (await call("POST", "/detokenize", {"tokens": ids}))["prompt"]
    except (httpx.HTTPStatusError, RequestRejected, KeyError):
        answer["probe_text"] = None  # a server without a tokenizer: stop strings are left to the env
    return answer


def _not_vllm(server: Server, why) -> str:
    return not_this_engine(server, why, name="vLLM", policy="VLLMServerPolicy", server_kind=_SERVER)


def _check_served_head_size(answer: dict, checkpoint_dir: str | None) -> None:
    """Refuse a served model whose head size vLLM's CPU attention cannot run, before any request reaches its engine
    (where its config can be read here: ``checkpoint_dir`` or the server's model directory)."""
    local = checkpoint_dir or answer.get("root")
    if not local or not Path(local, "config.json").is_file():
        return
    device = answer.get("device")
    is_cpu = None if device is None else device == "cpu"  # not exposed: the server runs this host's vLLM build
    check_head_size(model_dir_config(local), f"the model vLLM server {answer['url']} serves ({local})", is_cpu=is_cpu)


async def _vocab_size(call) -> int | None:
    body = {"prompt": [0], "max_tokens": 1, "logit_bias": {str(2**31 - 1): 0.0}}
    try:
        await call("POST", "/v1/completions", body)
    except RequestRejected as err:
        match = _VOCAB.search(str(err))
        return int(match.group(1)) if match else None
    return None


async def _probe_log_prob(call) -> float:
    """Log-prob of a token sampled from a distribution restricted to it: 0 in processed mode."""
    body = {"prompt": [0], "max_tokens": 1, "logprobs": 0, "allowed_token_ids": [0], "temperature": 1.0, "top_k": 0,
            "top_p": 1.0, "min_p": 0.0, "seed": 0}  # fmt: skip
    answer = await call("POST", "/v1/completions", body)
    return float(answer["choices"][0]["logprobs"]["token_logprobs"][0])


def check_server(answer: dict, env, *, is_unmodified: bool, model: str | None = None,
                 sampling: SamplingConfig | None = None) -> None:  # fmt: skip
    """Raise a ``ValueError`` naming the server and the fix when ``answer`` (:func:`inspect_server`) does
    not fit ``env`` and ``sampling`` or would report log-probs of another distribution than the one sampled from.

    Example:
        >>> from tokengym.llm_envs import TokenEnv
        >>> from tokengym.testing import tiny_tokenizer
        >>> env = TokenEnv(["hi"], tiny_tokenizer(), max_new_tokens=8, max_length=64)
        >>> answer = {"url": "http://h:8000", "model": "m", "max_model_len": 32, "vocab_size": 512,
        ...           "logprobs_mode": "processed_logprobs", "probe_log_prob": 0.0}
        >>> check_server(answer, env, is_unmodified=True)
        Traceback (most recent call last):
        ...
        ValueError: the env holds sequences of up to max_length=64 tokens but vLLM server http://h:8000 has 32 positions; ...
    """
    url = answer["url"]
    if answer.get("is_open"):
        warnings.warn(f"vLLM server {url} answers its development endpoints (/server_info) without a key although "
                      "this policy sends one: anyone who can reach it can replace its weights and drive its "
                      f"workers (/collective_rpc); start it with --middleware {MIDDLEWARE} and {KEY_VARIABLE} (as "
                      "LocalVLLMServer does), or keep it on a private interface", stacklevel=4)  # fmt: skip
    mode = answer.get("logprobs_mode")
    if mode is None:  # not exposed: the probe tells processed log-probs (exactly 0 for a single allowed id)
        mode = "processed_logprobs" if answer["probe_log_prob"] == 0.0 else "not processed_logprobs (probed)"
    check_logprobs_mode(mode, is_unmodified, where=f"vLLM server {url}")
    check_served(answer, env, name="vLLM", model=model, sampling=sampling,
                 length_fix="build the env with max_length={positions} or start the server with a larger --max-model-len",
                 tokenizer_fix="save the env's tokenizer into the server's model directory")  # fmt: skip
