"""SGLang's native server API as a dialect of the server fleet: :class:`SGLangServerDialect`.

``ServerPolicy(urls, env, dialect=SGLangServerDialect())`` generates on running SGLang servers
(``python -m sglang.launch_server --model-path DIR``) with the fleet, core and weight path every engine shares; this
module is all that is SGLang's. It speaks the API as SGLang documents it:

- ``POST /generate``: ``input_ids``, ``sampling_params`` (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``
  (-1: none), ``min_p``, the penalties, ``min_new_tokens``, ``stop_token_ids``, ``stop``, ``ignore_eos``,
  ``skip_special_tokens``, ``no_stop_trim``, ``sampling_seed``), ``return_logprob``, ``stream``, ``rid`` (the
  request id), ``lora_path`` (an adapter's name); each answer (a server-sent event ``data: {...}`` when streamed,
  ``data: [DONE]`` at the end) holds ``output_ids`` and ``meta_info`` (``id``, ``finish_reason`` ``{"type": "stop" |
  "length" | "abort", ...}`` or ``None``, ``completion_tokens``, ``output_token_logprobs`` as ``[log-prob, token id,
  text]`` triples). A streamed event holds everything the request generated so far (SGLang's default), or only the
  new tokens (servers started with ``--incremental-streaming-output``): :meth:`SGLangServerDialect.take` reads both.
- ``GET /health``, ``GET /get_model_info`` (``model_path``: after ``/update_weights_from_disk`` the directory it
  loaded, so the model a server was started with is read from ``tokenizer_path``; ``is_generation``,
  ``weight_version``),
  ``GET /get_server_info`` (the server's arguments: ``context_length``, ``enable_lora``; ``max_req_input_len``),
  ``POST /detokenize`` (``tokens`` -> ``text``).
- ``POST /update_weights_from_disk`` (``model_path``; answers ``success``, ``message``), ``POST /flush_cache``,
  ``POST /update_weight_version`` (``new_version``), ``POST /abort_request`` (``rid``), ``POST /load_lora_adapter``
  (``lora_name``, ``lora_path``).

Sources: ``docs/basic_usage/native_api.ipynb`` and ``docs/basic_usage/sampling_params.md`` of sgl-project/sglang;
``python/sglang/srt/entrypoints/http_server.py`` (the routes, the stream's events and its ``{"error": {"message"}}``
event), ``python/sglang/srt/managers/io_struct.py`` (``GenerateReqInput``, ``SamplingParams``' ``sampling_seed``) and
``python/sglang/srt/managers/tokenizer_manager_components/output_processor.py`` (``meta_info``, streamed ids).

Log-probs: SGLang reports the log-prob of the temperature-scaled distribution (its default, without
``SGLANG_RETURN_ORIGINAL_LOGPROB``), not renormalized by top-k or top-p, so :meth:`SGLangServerDialect.check` refuses
those (and banned tokens): ``action_log_prob`` must be the log-prob of the distribution sampled from.

SGLang needs CUDA: this dialect is tested against SGLang's documented API served by a test server
(``test/collectors/sglang_api_server.py``: a transformers model behind exactly these endpoints), not against SGLang
itself.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from pathlib import Path

import httpx

from tokengym.collectors.policies._server_checks import (
    check_fleet,
    check_served,
    inspect_with,
    not_this_engine,
)
from tokengym.collectors.policies._server_options import RequestRejected
from tokengym.collectors.policies._server_weights import DirectoryTransport
from tokengym.collectors.policies.sampling import SamplingConfig

__all__ = ["SGLangServerDialect"]

_START = "python -m sglang.launch_server --model-path DIR --host 127.0.0.1 --port 30000"
_KIND = "SGLang's server (python -m sglang.launch_server)"
_NEUTRAL = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
            "min_new_tokens": 0}  # fmt: skip
_FLUSH_TRIES = 50  # /flush_cache refuses while requests run (HTTP 400): tried every 20 ms, then the reload fails


def _from_disk(handle: str) -> list[tuple[str, dict]]:
    """Load the safetensors in directory ``handle`` (SGLang reads the ``*.safetensors`` of ``model_path``)."""
    return [("/update_weights_from_disk", {"model_path": handle})]


class SGLangServerDialect:
    """SGLang's native server API (``/generate`` with token ids), as a
    :class:`~tokengym.collectors.policies.dialects.FleetDialect`.

    Every request is streamed under a ``rid`` of its own, which an abort names (``POST /abort_request``): the stream
    then ends with every token generated, its ``finish_reason`` ``{"type": "abort"}``. Weights are written as
    safetensors and loaded with ``/update_weights_from_disk`` (the servers must see the directory: one host or a
    shared filesystem), then tagged with SGLang's weight version (``/update_weight_version``, read back from
    ``/get_model_info``).

    Example:
        >>> dialect = SGLangServerDialect()
        >>> fields = dialect.wave_fields(dialect.sampling_fields(SamplingConfig()), [2], [])
        >>> row = dialect.row(fields, [5, 6], max_tokens=4, seed=7)
        >>> row["sampling_params"]["top_k"], row["sampling_params"]["max_new_tokens"], row["input_ids"]
        (-1, 4, [5, 6])
        >>> answer = dialect.answer()
        >>> dialect.take(answer, {"output_ids": [9], "meta_info": {"id": "r1", "finish_reason": None,
        ...     "completion_tokens": 1, "output_token_logprobs": [[-0.5, 9, None]]}})
        >>> dialect.resume(row, answer)["input_ids"], dialect.resume(row, answer)["sampling_params"]["max_new_tokens"]
        ([5, 6, 9], 3)
    """

    name = "SGLang"
    generate_path = "/generate"
    health_path = "/health"
    max_stop_strings = None
    reload_hint = ("SGLang loads weights with POST /update_weights_from_disk from the directory the policy writes: the "
                   "server must see it (the same host, or ServerOptions(weights_dir=...) on a shared filesystem)")  # fmt: skip
    initial_weights = "default"  # SGLang's weight version until one is set (--weight-version)
    adapter_hint = "--enable-lora --max-lora-rank {rank} (or more)"

    # -- requests and answers --
    def sampling_fields(self, sampling: SamplingConfig) -> dict:
        """Every sampling field sent (so the model's ``generation_config`` defaults never apply); greedy is
        temperature 0. The engine's own end id is ignored, ids come back untouched."""
        fields = {"ignore_eos": True, "skip_special_tokens": False, "no_stop_trim": True, **_NEUTRAL}
        if sampling.greedy:
            return {**fields, "temperature": 0.0, "top_p": 1.0, "top_k": -1}
        return {**fields, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k or -1}

    def wave_fields(self, base: dict, eos_token_ids: Sequence[int], stop_strings: Sequence[str]) -> dict:
        fields = dict(base, stop_token_ids=list(eos_token_ids))
        if stop_strings:
            fields["stop"] = list(stop_strings)
        return fields

    def row(self, fields: dict, prompt: list[int], max_tokens: int, seed: int | None) -> dict:
        params = dict(fields, max_new_tokens=max_tokens)
        if seed is not None:
            params["sampling_seed"] = seed
        return {"input_ids": prompt, "sampling_params": params, "return_logprob": True}

    def answer(self) -> dict:
        """No token yet; ``rid`` and ``base``: the request streaming into it and the tokens it held before."""
        return {"output_ids": [], "logprobs": [], "finish_reason": None, "rid": None, "base": 0}

    def stream(self, row: dict) -> dict:
        return dict(row, stream=True, rid=f"tokengym-{uuid.uuid4().hex}")

    def take(self, answer: dict, chunk: dict) -> None:
        """Fold one event into ``answer``. An event that holds as many ids as its request generated
        (``completion_tokens``) holds all of them (SGLang's default stream): they replace what that request had sent;
        fewer are the new ones (``--incremental-streaming-output``). An ``"abort"`` end is no end; an error event
        (SGLang streams a request it refuses as ``{"error": {"message": ...}}``) raises ``RequestRejected``."""
        error = chunk.get("error")
        if error is not None:
            message = error.get("message") if isinstance(error, dict) else error
            raise RequestRejected(f"HTTP 400 (an error event in its stream): {str(message)[:500]}", status_code=400)
        meta = chunk.get("meta_info") or {}
        if meta.get("id") != answer["rid"]:  # a new request: the first, or one sent again from the tokens received
            answer["rid"], answer["base"] = meta.get("id"), len(answer["output_ids"])
        ids, generated = list(chunk.get("output_ids") or []), meta.get("completion_tokens")
        if generated is not None and len(ids) == generated:
            del answer["output_ids"][answer["base"] :], answer["logprobs"][answer["base"] :]
        answer["output_ids"] += ids
        answer["logprobs"] += [float(t[0]) for t in meta.get("output_token_logprobs") or []]
        answer["usage"] = generated
        reason = meta.get("finish_reason")
        if reason is not None and reason.get("type") != "abort":
            answer["finish_reason"] = reason

    def reply(self, answer: dict):
        return answer["output_ids"], answer["logprobs"]

    def finished(self, answer: dict) -> bool:
        return answer["finish_reason"] is not None

    def received(self, answer: dict) -> int:
        return len(answer["output_ids"])

    def generated(self, answer: dict) -> int | None:
        return answer.pop("usage", None)

    def resume(self, row: dict, answer: dict) -> dict | None:
        """``row`` from the tokens ``answer`` received: ``input_ids`` and those tokens, ``max_new_tokens`` less them,
        the same ``sampling_seed``; ``None`` (and ``answer`` ended) when its budget is spent or it ended on a stop id."""
        ids, params = answer["output_ids"], row["sampling_params"]
        left = params["max_new_tokens"] - len(ids)
        if left <= 0 or ids[-1] in params.get("stop_token_ids", ()):
            answer["finish_reason"] = {"type": "length"} if left <= 0 else {"type": "stop", "matched": ids[-1]}
            return None
        return dict(row, input_ids=list(row["input_ids"]) + ids, sampling_params=dict(params, max_new_tokens=left))

    # -- start-up checks --
    async def inspect(self, fleet, server, probe_ids: list[int]) -> dict:
        """``/health``, ``/get_model_info``, ``/get_server_info`` (the context) and ``/detokenize`` of ``probe_ids``.
        SGLang's documented API names no vocabulary size: ``vocab_size`` is ``None`` (not checked)."""
        return await inspect_with(fleet, server, lambda call: self._ask(server, call, probe_ids), name=self.name,
                                  start=_START)  # fmt: skip

    async def _ask(self, server, call, ids: list[int]) -> dict:
        try:
            await call("GET", self.health_path)
            model = await call("GET", "/get_model_info")
            info = await call("GET", "/get_server_info")
        except RequestRejected as err:
            if err.status_code == 401:
                raise
            raise ValueError(not_this_engine(server, err, name=self.name, policy="ServerPolicy", server_kind=_KIND)) from err
        except ValueError as err:  # a 200 answer that is not JSON
            why = f"it answered a page that is not JSON ({err})"
            raise ValueError(not_this_engine(server, why, name=self.name, policy="ServerPolicy", server_kind=_KIND)) from err
        if not isinstance(model, dict) or "model_path" not in model or not isinstance(info, dict):
            why = f"GET /get_model_info answered {str(model)[:80]!r}"
            raise ValueError(not_this_engine(server, why, name=self.name, policy="ServerPolicy", server_kind=_KIND))
        if model.get("is_generation") is False:
            raise ValueError(f"SGLang server {server.url} serves {model['model_path']!r} as an embedding model; start "
                             "it with a generation model")  # fmt: skip
        context = info.get("context_length") or (info["max_req_input_len"] + 1 if info.get("max_req_input_len") else None)
        try:
            text = (await call("POST", "/detokenize", {"tokens": ids, "skip_special_tokens": False}))["text"]
        except (httpx.HTTPStatusError, RequestRejected, KeyError, TypeError):
            text = None  # a server without a tokenizer: stop strings are left to the env
        # SGLang points model_path at the last directory /update_weights_from_disk loaded: the directory it was started
        # from (its model and tokenizer) stays its tokenizer_path
        launched = model.get("tokenizer_path") or model["model_path"]
        return {"url": server.url, "model": launched, "root": launched, "max_model_len": context, "vocab_size": None,
                "probe_text": text}  # fmt: skip

    def check(self, answer: dict, env, *, is_unmodified: bool, model: str | None, sampling: SamplingConfig) -> None:
        """Refuse sampling whose log-probs SGLang would not report (top-k, top-p, banned tokens), then the checks every
        server shares (model, context, tokenizer)."""
        if sampling.top_k or sampling.top_p != 1.0 or sampling.banned_token_ids:
            raise ValueError(f"SGLang server {answer['url']} reports log-probs of the temperature-scaled distribution, "
                             f"not of one truncated by top_k={sampling.top_k}, top_p={sampling.top_p} or banned "
                             f"tokens {list(sampling.banned_token_ids)[:5]}, so action_log_prob would not be the "
                             "log-prob of the distribution sampled from; sample with temperature alone "
                             "(SamplingConfig(temperature=...)) or use VLLMServerPolicy")  # fmt: skip
        check_served(answer, env, name=self.name, model=model, sampling=sampling,
                     length_fix="build the env with max_length={positions} or start the server with a larger "
                                "--context-length",
                     tokenizer_fix="save the env's tokenizer into the server's model directory (or give it as "
                                   "--tokenizer-path)")  # fmt: skip

    def check_fleet(self, answers: list[dict]) -> None:
        check_fleet(answers, self.name)

    # -- weights, cache, abort --
    def transport(self, root):
        """Safetensors files in ``root/v{version}``, loaded with ``POST /update_weights_from_disk``."""
        return DirectoryTransport(root, reload=_from_disk)

    async def reset_cache(self, fleet, server) -> None:
        """``POST /flush_cache``; SGLang refuses (HTTP 400) while requests run (another client's): tried for a
        second."""
        for _ in range(_FLUSH_TRIES):
            try:
                await fleet.call(server, "POST", "/flush_cache")
                return
            except RequestRejected as err:
                if err.status_code != 400:
                    raise
            except ValueError:  # a 200 answer in plain text ("Cache flushed. ...")
                return
            await asyncio.sleep(0.02)
        raise OSError(f"{server.url} did not flush its cache after new weights (it answered HTTP 400: requests run)")

    async def held_weights(self, fleet, server) -> str | None:
        answer = await fleet.call(server, "GET", "/get_model_info", retry=True)
        return answer.get("weight_version") if isinstance(answer, dict) else None

    async def tag_weights(self, fleet, server, tag: str) -> None:
        await fleet.call(server, "POST", "/update_weight_version", {"new_version": tag})

    async def abort(self, fleet, server, requests: Sequence) -> bool:
        """``POST /abort_request`` with each request's ``rid``; False where the server has no such route."""
        try:
            await asyncio.gather(*(fleet.call(server, "POST", "/abort_request", {"rid": r["rid"]}) for r in requests))
        except RequestRejected as err:
            if err.status_code in (404, 405):
                return False
            raise
        except ValueError:  # answered 200 with an empty or plain body
            pass
        return True

    # -- what the fleet policy adds: engine failures, LoRA adapters --
    def engine_died(self, message: str) -> bool:
        """SGLang documents no answer that says its engine died: such a server is seen as down (5xx, refused)."""
        return False

    async def takes_adapters(self, fleet, server) -> bool:
        """Whether the server was started with ``--enable-lora`` (``/get_server_info``)."""
        info = await fleet.call(server, "GET", "/get_server_info", retry=True)
        return bool(isinstance(info, dict) and info.get("enable_lora"))

    def adapter_calls(self, handle: str) -> list[tuple[str, dict]]:
        return [("/load_lora_adapter", {"lora_name": Path(handle).name, "lora_path": handle})]

    def name_adapter(self, row: dict, name: str) -> None:
        """SGLang names a request's adapter in ``lora_path`` (a loaded adapter's name)."""
        row["lora_path"] = name
