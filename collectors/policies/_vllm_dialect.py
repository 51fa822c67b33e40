"""vLLM's dialects: its OpenAI-compatible server (:class:`VLLMServerDialect`) and its in-process engine
(:class:`VLLMEngineDialect`), the two engines behind :class:`~tokengym.collectors.policies.VLLMServerPolicy` and
:class:`~tokengym.collectors.policies.VLLMPolicy` (protocols in :mod:`tokengym.collectors.policies.dialects`).

Both send the same sampling fields and read the same processed log-probs, so a wave means the same on either: the
same prompt, budget and seed give the same tokens. On a server every sampling field is sent, so its
``generation_config`` defaults never apply; banned tokens go as ``logit_bias`` -100 (vLLM clamps a bias to +-100):
a banned token then keeps ``exp(-100)`` of its weight, below float32 resolution of every log-prob reported unless
its logit beats the others by ~80. In the engine they are ``-inf``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from pathlib import Path

from tokengym.collectors.policies._server_options import RequestRejected
from tokengym.collectors.policies._vllm_requests import sampling_fields
from tokengym.collectors.policies.sampling import SamplingConfig

__all__ = ["VLLMEngineDialect", "VLLMServerDialect"]

_NEUTRAL = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0}  # fmt: skip
_BANNED_BIAS = -100.0  # vLLM clamps logit_bias to [-100, 100]
_ABORTED = "abort"  # the finish reason of a request stopped before its end (vLLM's FinishReason.ABORT)
_RESET_TRIES = 50  # a prefix-cache reset refused while blocks are held is retried every 20 ms, then forced
_INITIAL_WEIGHTS = "default"  # vLLM's weight version until one is set (``/update_weight_version``)
_ENGINE_DIED = ("EngineCore", "EngineDead")  # what vLLM's 500 answers say once its engine process failed


def _reload_calls(handle: str) -> list[tuple[str, dict]]:
    """Reload the safetensors in directory ``handle`` through the server's workers."""
    return [("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": handle}})]


class VLLMServerDialect:
    """vLLM's OpenAI-compatible server (``/v1/completions`` with token ids, ``VLLM_SERVER_DEV_MODE=1`` endpoints).

    A :class:`~tokengym.collectors.policies.dialects.FleetDialect`. Every request is streamed under a request id of
    its own; an abort names those ids (``POST /abort_requests``), so the server ends each stream with the tokens it
    generated, and a server shared with other clients stops only this fleet's requests. The weights a server holds
    are tagged with vLLM's weight version (``POST /update_weight_version``, read by ``GET /weight_info``).
    """

    name = "vLLM"
    generate_path = "/v1/completions"
    health_path = "/health"
    max_stop_strings = 4  # the OpenAI completions API (and vLLM's) refuses more
    reload_hint = ("weight reload needs a server started with VLLM_SERVER_DEV_MODE=1 (it opens /collective_rpc and "
                   "/reset_prefix_cache)")  # fmt: skip
    initial_weights = _INITIAL_WEIGHTS

    def sampling_fields(self, sampling: SamplingConfig) -> dict:
        fields = {**_NEUTRAL, **sampling_fields(sampling), "n": 1, "logprobs": 0, "ignore_eos": True,
                  "skip_special_tokens": False, "include_stop_str_in_output": True, "return_token_ids": True}  # fmt: skip
        if sampling.banned_token_ids:
            fields["logit_bias"] = {str(i): _BANNED_BIAS for i in sampling.banned_token_ids}
        return fields

    def wave_fields(self, base: dict, eos_token_ids: Sequence[int], stop_strings: Sequence[str]) -> dict:
        fields = dict(base, stop_token_ids=list(eos_token_ids))
        if stop_strings:
            fields["stop"] = list(stop_strings[: self.max_stop_strings])
        return fields

    def row(self, fields: dict, prompt: list[int], max_tokens: int, seed: int | None) -> dict:
        return dict(fields, prompt=prompt, max_tokens=max_tokens, seed=seed)

    def finished(self, answer: dict) -> bool:
        return answer["choices"][0].get("finish_reason") is not None  # None: aborted, the tokens so far

    def reply(self, answer: dict):
        choice = answer["choices"][0]
        return choice["token_ids"], (choice.get("logprobs") or {}).get("token_logprobs")

    # -- streaming (the fleet streams every request: a row keeps what it received when it is aborted) --
    def answer(self) -> dict:
        """An answer with no token yet, in the shape of a whole one (``reply`` and ``finished`` read both)."""
        return {"choices": [{"token_ids": [], "logprobs": {"token_logprobs": []}, "finish_reason": None}]}

    def stream(self, row: dict) -> dict:
        """``row`` streamed: one server-sent event per step, its new token ids and their log-probs, then the usage
        (the tokens the server generated); under a request id of its own, which :meth:`abort` names."""
        return dict(row, stream=True, stream_options={"include_usage": True},
                    request_id=f"tokengym-{uuid.uuid4().hex}")  # fmt: skip

    def take(self, answer: dict, chunk: dict) -> None:
        """Fold one streamed chunk into ``answer``; an error event raises (``RequestRejected`` for a 4xx code, else
        ``OSError``: the server failed, the row goes on elsewhere from its tokens). An aborted request's last chunk
        (``finish_reason`` ``"abort"``) is no end: the row stays unfinished."""
        error = chunk.get("error")
        if error is not None:
            code, message = int(error.get("code") or 500), str(error.get("message"))[:500]
            if code < 500:
                raise RequestRejected(f"HTTP {code}: {message}", status_code=code)
            raise OSError(f"HTTP {code} (an error event in its stream): {message}")
        usage = chunk.get("usage")
        if usage is not None:
            answer["usage"] = int(usage.get("completion_tokens") or 0)
        if not chunk.get("choices"):  # the usage chunk
            return
        part, into = chunk["choices"][0], answer["choices"][0]
        ids = part.get("token_ids") or []
        into["token_ids"] += ids
        if ids:
            into["logprobs"]["token_logprobs"] += (part.get("logprobs") or {}).get("token_logprobs") or []
        if part.get("finish_reason") not in (None, _ABORTED):
            into["finish_reason"] = part["finish_reason"]

    def received(self, answer: dict) -> int:
        """Tokens ``answer`` holds."""
        return len(answer["choices"][0]["token_ids"])

    def generated(self, answer: dict) -> int | None:
        """The usage the last stream reported (tokens the server generated for it), then forgotten."""
        return answer.pop("usage", None)

    def resume(self, row: dict, answer: dict) -> dict | None:
        """``row`` continued from the tokens ``answer`` received (its server failed mid-stream): prompt and tokens,
        the budget less those tokens, the same seed. ``None`` (and ``answer`` marked ended) when nothing is left: its
        budget is spent or its last token is an end id."""
        choice = answer["choices"][0]
        ids = choice["token_ids"]
        left = row["max_tokens"] - len(ids)
        if left <= 0 or ids[-1] in row.get("stop_token_ids", ()):
            choice["finish_reason"] = "length" if left <= 0 else "stop"
            return None
        return dict(row, prompt=list(row["prompt"]) + ids, max_tokens=left)

    async def inspect(self, fleet, server, probe_ids: list[int]) -> dict:
        from tokengym.collectors.policies._vllm_checks import inspect_server

        return await inspect_server(fleet, server, probe_ids)

    def check(self, answer: dict, env, *, is_unmodified: bool, model: str | None, sampling: SamplingConfig) -> None:
        from tokengym.collectors.policies._vllm_checks import check_server

        check_server(answer, env, is_unmodified=is_unmodified, model=model, sampling=sampling)

    def check_fleet(self, answers: list[dict]) -> None:
        from tokengym.collectors.policies._server_checks import check_fleet

        check_fleet(answers, self.name)

    def transport(self, root):
        """Safetensors files that each server reloads through its workers (``POST /collective_rpc``
        ``reload_weights``, ``VLLM_SERVER_DEV_MODE=1``)."""
        from tokengym.collectors.policies._server_weights import DirectoryTransport

        return DirectoryTransport(root, reload=_reload_calls)

    # -- what the fleet policy adds (FleetDialect): engine failures, LoRA adapters --
    adapter_hint = "--enable-lora --max-lora-rank {rank} (or more) and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"

    def engine_died(self, message: str) -> bool:
        """vLLM's 500 answers name its ``EngineCore`` (or ``EngineDead``) once its engine process failed."""
        return any(word in message for word in _ENGINE_DIED)

    async def takes_adapters(self, fleet, server) -> bool:
        """Whether ``/v1/load_lora_adapter`` exists (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``): a GET answers 405."""
        try:
            await fleet.call(server, "GET", "/v1/load_lora_adapter")
        except RequestRejected as err:
            if err.status_code == 401:
                raise
            return err.status_code == 405  # the route exists (it takes POST)
        return True

    def adapter_calls(self, handle: str) -> list[tuple[str, dict]]:
        # in place: a server that already holds this name (a revived one) loads it again instead of refusing
        return [("/v1/load_lora_adapter", {"lora_name": Path(handle).name, "lora_path": handle, "load_inplace": True})]

    def name_adapter(self, row: dict, name: str) -> None:
        """vLLM names the adapter of a request as its ``model``."""
        row["model"] = name

    async def reset_cache(self, fleet, server) -> None:
        """Drop every cached prefix (KV computed under the old weights would be reused otherwise).

        The server refuses while blocks are still held (a request that just finished, one still running
        for another client): retry for up to a second, then preempt running requests."""
        for attempt in range(_RESET_TRIES + 1):
            query = "?reset_running_requests=true" if attempt == _RESET_TRIES else ""
            answer = await fleet.call(server, "POST", "/reset_prefix_cache" + query)
            if answer is None or answer.get("success", True):
                return
            await asyncio.sleep(0.02)
        raise OSError(f"{server.url} did not reset its prefix cache after new weights (it answered success=false)")

    async def abort(self, fleet, server, requests: Sequence) -> bool:
        """``POST /abort_requests`` with the requests' ids (vLLM's engine ids: ``cmpl-{request_id}-0``): each stream
        then ends with an ``"abort"`` chunk, every token generated before it streamed. False where the server has no
        such endpoint (started without ``VLLM_SERVER_DEV_MODE=1``, or an older vLLM)."""
        ids = [f"cmpl-{r['request_id']}-0" for r in requests]
        try:
            await fleet.call(server, "POST", "/abort_requests", {"request_ids": ids})
        except RequestRejected as err:
            if err.status_code in (404, 405):
                return False
            raise
        return True

    async def held_weights(self, fleet, server) -> str | None:
        """vLLM's weight version (``GET /weight_info``): ``"default"`` until one is set; ``None`` where the server
        has no such endpoint."""
        try:
            answer = await fleet.call(server, "GET", "/weight_info", retry=True)
        except RequestRejected as err:
            if err.status_code in (404, 405):
                return None
            raise
        return None if not isinstance(answer, dict) else answer.get("weight_version")

    async def tag_weights(self, fleet, server, tag: str) -> None:
        """Set vLLM's weight version (``POST /update_weight_version``); a server without the endpoint keeps none."""
        try:
            await fleet.call(server, "POST", "/update_weight_version", {"new_version": tag})
        except RequestRejected as err:
            if err.status_code not in (404, 405):
                raise


class VLLMEngineDialect:
    """vLLM's in-process ``vllm.LLM`` (``SamplingParams`` per request, weights through the workers' reload).

    Args:
        llm: the running ``vllm.LLM``.
        sampling_params: ``vllm.SamplingParams``.
    """

    name = "vLLM"
    max_stop_strings = None

    def __init__(self, llm, sampling_params) -> None:
        self.llm, self.make_params = llm, sampling_params

    def sampling_fields(self, sampling: SamplingConfig) -> dict:
        fields = dict(n=1, logprobs=0, flat_logprobs=True, ignore_eos=True, detokenize=False,
                      skip_special_tokens=False, include_stop_str_in_output=True)  # fmt: skip
        fields.update(sampling_fields(sampling))
        if sampling.banned_token_ids:
            fields["logit_bias"] = {i: -float("inf") for i in sampling.banned_token_ids}
        return fields

    def wave_fields(self, base: dict, eos_token_ids: Sequence[int], stop_strings: Sequence[str]) -> dict:
        fields = dict(base, stop_token_ids=list(eos_token_ids))
        if stop_strings:
            fields.update(stop=list(stop_strings), detokenize=True)
        return fields

    def row(self, fields: dict, prompt: list[int], max_tokens: int, seed: int | None) -> tuple:
        return {"prompt_token_ids": prompt}, self.make_params(**fields, max_tokens=max_tokens, seed=seed)

    def finished(self, answer) -> bool:
        return answer.finish_reason != _ABORTED

    def reply(self, answer):
        return answer.token_ids, None if answer.logprobs is None else answer.logprobs.logprobs

    def generate(self, rows: list, adapter=None, *, should_stop=None) -> list:
        """The engine driven step by step, as ``LLM.generate`` drives it (same requests in the same order: the same
        tokens), so that it can stop between two steps; then each row not finished is aborted and answered with the
        tokens it has (``finish_reason`` ``"abort"``)."""
        engine, n = self.llm.llm_engine, len(rows)
        internal, row_of = self._add_requests(rows, adapter)
        answers: list = [None] * n
        done = 0
        try:
            while done < n and not (should_stop is not None and should_stop(done)):
                for output in engine.step():
                    i = row_of.get(output.request_id)
                    if i is not None and output.finished:
                        answers[i], done = output.outputs[0], done + 1
            return [_aborted_answer(engine, internal[i]) if a is None else a for i, a in enumerate(answers)]
        finally:  # rows stopped early (or a step that failed) leave the engine
            stopped = [internal[i] for i, a in enumerate(answers) if a is None]
            if stopped:
                engine.abort_request(stopped, internal=True)

    def _add_requests(self, rows: list, adapter) -> tuple[list[str], dict[str, int]]:
        """Add one request per row, in order, as ``LLM.generate`` adds them (its request ids, prompts rendered by its
        renderer); only finished rows are reported by ``step`` (``FINAL_ONLY``, no per-step output objects)."""
        from vllm.renderers.inputs.preprocess import parse_model_prompt
        from vllm.sampling_params import RequestOutputKind

        llm, engine = self.llm, self.llm.llm_engine
        inputs = llm.renderer.render_cmpl([parse_model_prompt(llm.model_config, r[0]) for r in rows],
                                          llm.renderer.default_cmpl_tok_params)  # fmt: skip
        internal, row_of = [], {}
        try:
            for i, (prompt, (_, params)) in enumerate(zip(inputs, rows, strict=True)):
                params.output_kind = RequestOutputKind.FINAL_ONLY
                request_id = str(next(llm.request_counter))
                internal.append(engine.add_request(request_id, prompt, params, lora_request=adapter))
                row_of[request_id] = i
        except BaseException:
            engine.abort_request(internal, internal=True)
            raise
        return internal, row_of

    def reload(self, items: list) -> None:
        # vLLM's CPU backend repacks linear weights after loading, so model.load_weights fails on a
        # running engine; the worker's reload path undoes the packing, loads, and packs again
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})

    def reset_cache(self) -> None:
        self.llm.reset_prefix_cache()


def _aborted_answer(engine, request_id: str):
    """The answer vLLM gives a request aborted now: its tokens and log-probs so far (vLLM's async engine streams the same
    output to a client that aborts; the offline engine keeps it in the request's state)."""
    from vllm.v1.engine import FinishReason

    state = engine.output_processor.request_states[request_id]
    return state.make_request_output([], None, FinishReason.ABORT, None).outputs[0]
