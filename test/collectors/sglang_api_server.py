"""A test server of SGLang's documented native API, backed by a transformers model: SGLang needs CUDA, this does not.

It serves what :class:`~tokengym.collectors.policies.SGLangServerDialect` speaks, as SGLang's docs give it
(``docs/basic_usage/native_api.ipynb``, ``sampling_params.md``, ``http_server.py``): ``POST /generate`` (``input_ids``,
``sampling_params``, ``return_logprob``, ``stream``, ``rid``; ``output_ids`` and ``meta_info`` back, streamed as
``data: {...}`` events holding everything so far, then ``data: [DONE]``), ``GET /health``, ``GET /get_model_info``,
``GET /get_server_info``, ``POST /detokenize``, ``POST /update_weights_from_disk``, ``POST /flush_cache``,
``POST /update_weight_version``, ``POST /abort_request``. The engine is the model of ``--model`` (``save_pretrained``)
decoding one token per step with its KV cache, every request interleaved with the others on one event loop; a log-prob
is the one of the temperature-scaled distribution, as SGLang reports it. It is not SGLang: no batching, no radix
cache, no LoRA (``enable_lora`` is false).

:class:`SGLangAPIServer` starts it as a real process on 127.0.0.1 (a free port, its own process group, output to a
log file registered for the fleet), as ``LocalVLLMServer`` starts vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tokengym.collectors.policies._server_logs import forget, register
from tokengym.collectors.policies.vllm_server import free_port


class SGLangAPIServer:
    """This module run as a server of ``model_dir`` on 127.0.0.1 (``python sglang_api_server.py --model DIR``).

    Args:
        model_dir: a ``save_pretrained`` directory (model and tokenizer).
        context_length: the context the server reports and enforces.
        step_delay_s: a pause after each decode step (a slower engine: streams stay open long enough to be cut).
    """

    def __init__(self, model_dir, *, context_length: int = 128, step_delay_s: float = 0.0) -> None:
        self.model_dir, self.context_length, self.step_delay_s = str(model_dir), context_length, step_delay_s
        self.port, self.process, self.log_path = free_port(), None, None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> SGLangAPIServer:
        fd, path = tempfile.mkstemp(prefix=f"sglang-api-{self.port}-", suffix=".log")
        self.log_path = Path(path)
        command = [sys.executable, __file__, "--model", self.model_dir, "--port", str(self.port), "--context-length",
                   str(self.context_length), "--step-delay", str(self.step_delay_s)]  # fmt: skip
        with os.fdopen(fd, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
        register(self.url, self.log_path)
        return self

    def wait(self, timeout_s: float = 120.0) -> SGLangAPIServer:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the SGLang API test server exited: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the SGLang API test server was not healthy after {timeout_s:.0f} s")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Signal its process group (SIGKILL after 10 s) and remove its log."""
        process, self.process = self.process, None
        forget(self.url, self.log_path)
        if process is not None:
            try:
                os.killpg(process.pid, sig)
                process.wait(timeout=10)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL at once (a crashed host, as the client sees it)."""
        self.stop(signal.SIGKILL)


# -- the server process --
class Engine:
    """The model, its weights' directory and version, and the requests to abort."""

    def __init__(self, model_dir: str, context_length: int, step_delay_s: float) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.launched, self.model_path, self.weight_version = model_dir, model_dir, "default"
        self.context_length, self.step_delay_s = context_length, step_delay_s
        self.aborted: set[str] = set()
        self.running: set[str] = set()

    def sample(self, logits, params: dict, generator) -> tuple[int, float]:
        torch = self.torch
        temperature = float(params.get("temperature", 1.0))
        if temperature == 0.0:
            token = int(logits.argmax())
            return token, float(logits.log_softmax(-1)[token])
        scaled = (logits / temperature).log_softmax(-1)  # what SGLang reports
        probs = scaled.exp()
        top_k, top_p, min_p = int(params.get("top_k", -1)), float(params.get("top_p", 1.0)), float(params.get("min_p", 0))
        if top_k > 0:
            probs[probs < probs.topk(top_k).values[-1]] = 0
        if top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p * probs.sum()
            probs[order[drop]] = 0
        if min_p > 0:
            probs[probs < min_p * probs.max()] = 0
        token = int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
        return token, float(scaled[token])

    async def generate(self, body: dict):
        """Yield the answer after each decode step (everything so far), the last one with its ``finish_reason``."""
        torch = self.torch
        ids, params = list(body.get("input_ids") or []), dict(body.get("sampling_params") or {})
        rid = body.get("rid") or f"req-{time.monotonic_ns()}"
        budget = int(params.get("max_new_tokens", 128))
        if not ids or len(ids) + budget > self.context_length:
            raise ValueError(f"The input ({len(ids)} tokens) plus max_new_tokens ({budget}) is longer than the "
                             f"model's context length ({self.context_length} tokens).")  # fmt: skip
        generator = torch.Generator().manual_seed(int(params.get("sampling_seed", time.monotonic_ns())))
        self.running.add(rid)
        try:
            async for answer in self._decode(rid, ids, params, budget, generator):
                yield answer
        finally:
            self.running.discard(rid)
            self.aborted.discard(rid)

    async def _decode(self, rid, ids, params, budget, generator):
        torch = self.torch
        stop_ids, stops = set(params.get("stop_token_ids") or ()), params.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        eos = None if params.get("ignore_eos") else self.tokenizer.eos_token_id
        out, logprobs, past, x, finish = [], [], None, torch.tensor([ids]), None
        while finish is None:
            if rid in self.aborted:
                finish = {"type": "abort", "message": "Abort in waiting queue"}
                break
            with torch.no_grad():
                result = self.model(x, past_key_values=past, use_cache=True)
            past = result.past_key_values
            token, logprob = self.sample(result.logits[0, -1].float(), params, generator)
            out.append(token)
            logprobs.append(logprob)
            x = torch.tensor([[token]])
            text = self.tokenizer.decode(out, skip_special_tokens=False)
            if token in stop_ids or token == eos:
                finish = {"type": "stop", "matched": token}
            elif any(s in text for s in stops):
                finish = {"type": "stop", "matched": next(s for s in stops if s in text)}
            elif len(out) >= budget:
                finish = {"type": "length", "length": budget}
            yield self.answer(rid, ids, out, logprobs, finish)
            await asyncio.sleep(self.step_delay_s)
        if finish["type"] == "abort":
            yield self.answer(rid, ids, out, logprobs, finish)

    def answer(self, rid, ids, out, logprobs, finish) -> dict:
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": len(out),
                "cached_tokens": 0, "weight_version": self.weight_version,
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, out, strict=True)]}  # fmt: skip
        return {"text": self.tokenizer.decode(out, skip_special_tokens=False), "output_ids": list(out), "meta_info": meta}

    def load(self, model_path: str) -> tuple[bool, str]:
        from safetensors.torch import load_file

        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            return False, f"Failed to get weights iterator: {model_path} (no safetensors files)."
        tensors = {}
        for f in files:
            tensors.update(load_file(str(f)))
        missing, unexpected = self.model.load_state_dict(tensors, strict=False)
        if unexpected:
            return False, f"Failed to update weights: unexpected tensors {unexpected[:3]}."
        self.model_path = model_path
        return True, "Succeeded to update model weights."


def app(engine: Engine):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def generate(request):
        body = await request.json()
        if body.get("stream"):

            async def events():
                try:
                    async for out in engine.generate(body):
                        yield b"data: " + json.dumps(out).encode() + b"\n\n"
                except ValueError as err:
                    yield b"data: " + json.dumps({"error": {"message": str(err)}}).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        try:
            answers = [answer async for answer in engine.generate(body)]
        except ValueError as err:
            return JSONResponse({"object": "error", "message": str(err), "type": "Bad Request", "code": 400}, 400)
        return JSONResponse(answers[-1])

    async def health(request):
        return Response(status_code=200)

    async def model_info(request):
        return JSONResponse({"model_path": engine.model_path, "tokenizer_path": engine.launched, "is_generation": True,
                             "preferred_sampling_params": None, "weight_version": engine.weight_version})  # fmt: skip

    async def server_info(request):
        return JSONResponse({"model_path": engine.model_path, "tokenizer_path": engine.launched,
                             "context_length": engine.context_length, "enable_lora": False,
                             "max_req_input_len": engine.context_length - 1, "weight_version": engine.weight_version,
                             "version": "tokengym-test-server"})  # fmt: skip

    async def detokenize(request):
        body = await request.json()
        text = engine.tokenizer.decode(body["tokens"], skip_special_tokens=body.get("skip_special_tokens", True))
        return JSONResponse({"text": text})

    async def update_weights_from_disk(request):
        ok, message = engine.load((await request.json())["model_path"])
        return JSONResponse({"success": ok, "message": message, "num_paused_requests": 0}, 200 if ok else 400)

    async def flush_cache(request):
        return Response("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                        "waiting requests, the operation will not be performed.)\n", 200)  # fmt: skip

    async def update_weight_version(request):
        engine.weight_version = (await request.json())["new_version"]
        return JSONResponse({"success": True, "message": f"Weight version updated to {engine.weight_version}",
                             "new_version": engine.weight_version})  # fmt: skip

    async def abort_request(request):
        rid = (await request.json())["rid"]
        if rid in engine.running:  # a request not known (yet) is left alone, as SGLang does
            engine.aborted.add(rid)
        return Response(status_code=200)

    return Starlette(routes=[
        Route("/generate", generate, methods=["POST", "PUT"]),
        Route("/health", health), Route("/get_model_info", model_info), Route("/get_server_info", server_info),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/update_weight_version", update_weight_version, methods=["POST"]),
        Route("/abort_request", abort_request, methods=["POST"]),
    ])  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--context-length", type=int, default=128)
    parser.add_argument("--step-delay", type=float, default=0.0)
    args = parser.parse_args()
    import uvicorn

    uvicorn.run(app(Engine(args.model, args.context_length, args.step_delay)), host="127.0.0.1", port=args.port,
                log_level="warning")  # fmt: skip
