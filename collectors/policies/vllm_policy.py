"""VLLMPolicy: a vLLM engine generating whole waves for a TokenEnv, token ids in and token ids out.

Log-prob semantics (the engine runs with vLLM's ``logprobs_mode="processed_logprobs"``):

- ``action_log_prob`` (``WaveResult.log_probs``): the log-prob of the sampled token under the
  distribution vLLM sampled from, after banned tokens, temperature, top-k and top-p: the same quantity
  :class:`~tokengym.collectors.policies.TransformersPolicy` writes. Greedy decoding reports the model's
  log-prob (vLLM's greedy path applies no temperature), so greedy needs temperature 1 and no top-k / top-p.
- ``raw_log_prob`` (``WaveResult.raw_log_probs``): the log-prob under the unmodified model. A vLLM
  engine returns one kind of log-prob, so it is given only when the sampling leaves the distribution
  unmodified (temperature 1, no top-k / top-p / banned tokens), where both are the same number;
  otherwise it is ``None`` (score the batch teacher-forced for it). An engine started with
  ``logprobs_mode="raw_logprobs"`` (vLLM's default, for an ``LLM`` you pass in) works only with such
  unmodified sampling.

Termination stays the env's: vLLM stops on the env's EOS ids (its own EOS is ignored), on the stop
strings when the engine has a tokenizer, and at each slot's budget; :meth:`TokenEnv.unroll` re-checks
every rule on the returned tokens.

Partial rollouts: a wave drives the engine step by step, as ``LLM.generate`` does (the same requests, so the same
tokens), and can stop between two steps: when weights are published during it (``interrupt``, set by the collector) or
once ``WaveRequest.min_finished`` rows ended (over-sampling). The rows not finished are aborted and come back with the
tokens and log-probs they have (``WaveResult.finished``); the env continues each in the next wave, under the new weights.
"""

from __future__ import annotations

import os

from tokengym.collectors.policies._checkpoints import checkpoint_shapes, read_checkpoint, tied_outputs
from tokengym.collectors.policies._lora_sync import (
    AdapterSpec,
    EngineAdapters,
    lora_engine_kwargs,
    tensor_bytes,
)
from tokengym.collectors.policies._vllm_dialect import VLLMEngineDialect
from tokengym.collectors.policies._vllm_engine import import_vllm, start_engine, stop_engine
from tokengym.collectors.policies._vllm_requests import (
    check_head_size,
    check_logprobs_mode,
    model_dir_config,
)
from tokengym.collectors.policies._wave_core import WaveCore, full_items, update_tensors, weight_sync_of
from tokengym.collectors.policies.dialects import EngineDialect, check_dialect
from tokengym.collectors.policies.protocol import check_fits_env, probe_ids
from tokengym.collectors.policies.sampling import SamplingConfig
from tokengym.llm_envs.waves import WaveRequest

__all__ = ["VLLMPolicy"]


class VLLMPolicy(WaveCore):
    """Generates every live slot's turn of a :class:`~tokengym.llm_envs.TokenEnv` with a vLLM engine.

    A :class:`~tokengym.collectors.policies.protocol.WavePolicy` (``TokenCollector(..., source="wave")``):
    prompts go in as the env's token ids (no re-tokenization), responses come back as token ids with
    per-token log-probs. Each request gets its own seed (policy seed and a request counter), so a run
    is reproducible and resumes from :meth:`collection_state`.

    Args:
        model: a local model directory (``save_pretrained`` of the model, and of the tokenizer for stop
            strings), or a ``vllm.LLM`` you built (it stays yours: :meth:`close` does not shut it down).
        env: the env whose slots it continues (checks vocabulary and context limit against it).
        sampling: a :class:`~tokengym.collectors.policies.SamplingConfig`.
        seed: seed of the engine and of the per-request sampling seeds.
        engine_kwargs: extra ``vllm.LLM`` arguments for an engine built from a directory (e.g.
            ``enforce_eager=True``, ``kv_cache_memory_bytes``, ``gpu_memory_utilization``).
        lora: the PEFT LoRA model being trained (or its ``peft.LoraConfig``) when ``model`` is its base: every
            wave is sampled with the adapter of the last update (version 0: the PEFT model's adapter, or a zero one),
            and an update sends the adapter alone, loaded under a new name (``weight_sync`` ``"adapter"``). An
            engine built here gets ``enable_lora=True`` and the adapter's rank; one without LoRA
            (``engine_kwargs={"enable_lora": False}``, or an ``LLM`` built without it) gets the base weights with
            the adapter merged at each update (``"merged"``, the cost of a full update).

    Raises:
        ImportError: vLLM is not installed (the message names the extra).
        ValueError: missing model directory, a vocabulary or context limit that does not fit the env,
            or sampling vLLM cannot honour.

    Example:
        >>> import contextlib, io, shutil, tempfile
        >>> from tokengym.llm_envs import TokenEnv
        >>> from tokengym.testing import tiny_tokenizer, tiny_model
        >>> tok = tiny_tokenizer(); model = tiny_model(tok, size="small")  # vLLM's CPU kernels need head_dim >= 32
        >>> path = tempfile.mkdtemp(); model.save_pretrained(path); _ = tok.save_pretrained(path)
        >>> env = TokenEnv(["1+1="], tok, batch_size=2, max_new_tokens=4, model_config=model.config)
        >>> with contextlib.redirect_stdout(io.StringIO()):  # vLLM logs its start-up to stdout
        ...     policy = VLLMPolicy(path, env, engine_kwargs={"enforce_eager": True, "kv_cache_memory_bytes": 1 << 24})
        >>> _ = env.reset(); request = env.wave_request()
        >>> result = policy.generate(request)
        >>> result.actions.shape[0], bool((result.lengths >= 1).all()), result.raw_log_probs is not None
        (2, True, True)
        >>> policy.update_weights(model.state_dict())
        1
        >>> policy.close(); shutil.rmtree(path)
    """

    def __init__(
        self,
        model,
        env,
        *,
        sampling: SamplingConfig | None = None,
        seed: int = 0,
        engine_kwargs: dict | None = None,
        lora=None,
    ) -> None:
        super().__init__(env, sampling, seed)
        self._vllm = import_vllm()
        if isinstance(model, str | os.PathLike):
            check_head_size(model_dir_config(model), f"the model in {os.fspath(model)!r}")  # before a minute of start-up
            engine_kwargs = dict(engine_kwargs or {})
            check_logprobs_mode(engine_kwargs.get("logprobs_mode", "processed_logprobs"), self.is_unmodified)
            if lora is not None:
                engine_kwargs = lora_engine_kwargs(engine_kwargs, lora)
            self.llm = start_engine(model, max_model_len=int(self.env.max_length), seed=seed, engine_kwargs=engine_kwargs,
                                    max_rows=int(self.env.batch_size[0]))  # fmt: skip
            self.is_engine_owned = True
        elif isinstance(model, self._vllm.LLM):
            if engine_kwargs:
                raise ValueError("engine_kwargs apply to an engine built from a directory; got a vllm.LLM already built")
            self.llm, self.is_engine_owned = model, False
        else:
            raise TypeError(f"model must be a model directory (str or os.PathLike) or a vllm.LLM, got {type(model).__name__}")
        try:
            self._check_engine()
        except ValueError:
            self.close()
            raise
        model_config = self.llm.llm_engine.model_config
        self.dialect = VLLMEngineDialect(self.llm, self._vllm.SamplingParams)
        check_dialect(self.dialect, EngineDialect)
        self.can_stop_strings = not model_config.skip_tokenizer_init
        self._checkpoint = checkpoint_shapes(model_config.model)
        self._tied = tied_outputs(model_config.hf_config)
        self._base = self.dialect.sampling_fields(self.sampling)
        self.last_update_bytes = 0
        """Bytes of the tensors the last :meth:`update_weights` sent to the engine."""
        self.adapter = None if lora is None else AdapterSpec.of(lora, self._checkpoint)
        self.adapters: EngineAdapters | None = None
        takes_adapters = self.llm.llm_engine.vllm_config.lora_config is not None
        self.weight_sync = weight_sync_of(lora, takes_adapters)
        """What an update sends: ``"full"`` weights, the LoRA ``"adapter"``, or the ``"merged"`` weights."""
        self.adapters = self._adapters()

    def _adapters(self) -> EngineAdapters | None:
        """The engine's adapter versions (version 0 loaded); ``None`` for an engine without LoRA, whose version 0
        is the base with the PEFT model's adapter merged (nothing to load for a zero adapter)."""
        try:
            if self.weight_sync == "adapter":
                return EngineAdapters(self.llm, self.adapter)
            if self.weight_sync == "merged" and not self.adapter.is_initial_zero():
                self.push_weights(self.adapter.initial, 0)
        except ValueError:
            self.close()
            raise
        return None

    def _check_engine(self) -> None:
        model_config = self.llm.llm_engine.model_config
        check_head_size(model_config.hf_config.to_dict(), "the engine's model")
        self.max_model_len = int(model_config.max_model_len)
        check_logprobs_mode(model_config.logprobs_mode, self.is_unmodified)
        # the engine's tokenizer only finds stop strings; without one the env alone does
        probe = None if model_config.skip_tokenizer_init else self.llm.get_tokenizer().decode(probe_ids(self.env.tokenizer))
        check_fits_env(self.env, "the vLLM engine's model", vocab_size=int(model_config.hf_config.vocab_size),
                       positions=self.max_model_len, sampling=self.sampling, probe_text=probe,
                       length_fix="build the env with max_length={positions} or the engine with a larger max_model_len",
                       tokenizer_fix=f"save the env's tokenizer into the model directory ({model_config.tokenizer})")  # fmt: skip

    # -- generation --
    def check_open(self) -> None:
        if self.llm is None:
            raise RuntimeError("this VLLMPolicy is closed; build a new one")

    def send_wave(self, request: WaveRequest, rows: list) -> tuple[list, int]:
        with self.wave_lock:
            adapter = None if self.adapters is None else self.adapters.request
            return self.dialect.generate(rows, adapter, should_stop=self.should_stop(request)), self.version

    # -- weights --
    def push_weights(self, weights, version: int) -> None:
        model_dir = self.llm.llm_engine.model_config.model
        if weights is None and self.weight_sync == "full":
            weights = read_checkpoint(model_dir)
        tensors = update_tensors(weights, spec=self.adapter, sync=self.weight_sync, checkpoint_dir=model_dir)
        if self.adapters is not None:  # a new adapter name: no cache reset (vLLM keys its prefix cache by adapter)
            self.adapters.load(tensors)
            self.last_update_bytes = tensor_bytes(tensors)
            return
        items = full_items(tensors, shapes=self._checkpoint, tied=self._tied, owner="the VLLMPolicy")
        self.last_update_bytes = tensor_bytes(items)
        self.dialect.reload(items)
        self.dialect.reset_cache()

    def close(self) -> None:
        """Stop the engine if this policy started it (an ``LLM`` passed in stays the caller's).

        vLLM's shutdown (also run when an engine is garbage-collected) tears down the process-wide
        distributed state every in-process engine uses, so a stopped engine is kept until no engine a
        ``VLLMPolicy`` started still runs; then all are shut down and their memory freed. An ``LLM``
        you built yourself in the same process must outlive them.
        """
        llm, self.llm = getattr(self, "llm", None), None
        adapters, self.adapters = getattr(self, "adapters", None), None
        if adapters is not None:
            adapters.close()
        if llm is not None and self.is_engine_owned:
            stop_engine(llm)

