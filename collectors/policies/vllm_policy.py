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
"""

from __future__ import annotations

import os

from tokengym.collectors.policies._lora_sync import (
    AdapterSpec,
    EngineAdapters,
    check_not_adapter,
    lora_engine_kwargs,
    tensor_bytes,
)
from tokengym.collectors.policies._vllm_engine import (
    checkpoint_shapes,
    import_vllm,
    read_checkpoint,
    start_engine,
    stop_engine,
    tied_outputs,
    weight_items,
)
from tokengym.collectors.policies._vllm_requests import (
    check_budgets,
    check_greedy,
    check_head_size,
    check_logprobs_mode,
    empty_result,
    is_unmodified,
    model_dir_config,
    sampling_fields,
    wave_result,
)
from tokengym.collectors.policies._wave_state import RequestSeeds
from tokengym.collectors.policies.protocol import check_fits_env, probe_ids, weights_of
from tokengym.collectors.policies.sampling import SamplingConfig
from tokengym.llm_envs.waves import WaveRequest, WaveResult

__all__ = ["VLLMPolicy"]


class VLLMPolicy:
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

    is_wave_only = True

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
        if sampling is not None and not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        self.seeds, self.version = RequestSeeds(seed), 0
        self.env = getattr(env, "base_env", env)
        self.sampling = sampling or SamplingConfig()
        check_greedy(self.sampling)
        self.is_unmodified = is_unmodified(self.sampling)
        self._vllm = import_vllm()
        if isinstance(model, str | os.PathLike):
            check_head_size(model_dir_config(model), f"the model in {os.fspath(model)!r}")  # before a minute of start-up
            engine_kwargs = dict(engine_kwargs or {})
            check_logprobs_mode(engine_kwargs.get("logprobs_mode", "processed_logprobs"), self.is_unmodified)
            if lora is not None:
                engine_kwargs = lora_engine_kwargs(engine_kwargs, lora)
            self.llm = start_engine(model, max_model_len=int(self.env.max_length), seed=seed, engine_kwargs=engine_kwargs)
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
        self._can_stop_strings = not model_config.skip_tokenizer_init
        self._checkpoint = checkpoint_shapes(model_config.model)
        self._tied = tied_outputs(model_config.hf_config)
        self._base_params = self._sampling_params()
        self.last_update_bytes = 0
        """Bytes of the tensors the last :meth:`update_weights` sent to the engine."""
        self.adapter = None if lora is None else AdapterSpec.of(lora, self._checkpoint)
        self.adapters: EngineAdapters | None = None
        self.adapters = self._adapters()
        self.weight_sync = "full" if lora is None else "merged" if self.adapters is None else "adapter"
        """What an update sends: ``"full"`` weights, the LoRA ``"adapter"``, or the ``"merged"`` weights."""

    def _adapters(self) -> EngineAdapters | None:
        """The engine's adapter versions (version 0 loaded); ``None`` for an engine without LoRA, whose version 0
        is the base with the PEFT model's adapter merged (nothing to load for a zero adapter)."""
        if self.adapter is None:
            return None
        try:
            if self.llm.llm_engine.vllm_config.lora_config is not None:
                return EngineAdapters(self.llm, self.adapter)
            if not self.adapter.is_initial_zero():
                self._load(self.adapter.initial)
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
    def _sampling_params(self):
        s = self.sampling
        kwargs = dict(n=1, logprobs=0, flat_logprobs=True, ignore_eos=True, detokenize=False,
                      skip_special_tokens=False, include_stop_str_in_output=True)  # fmt: skip
        kwargs.update(sampling_fields(s))
        if s.banned_token_ids:
            kwargs["logit_bias"] = {i: -float("inf") for i in s.banned_token_ids}
        return kwargs

    def generate(self, request: WaveRequest) -> WaveResult:
        """Continue every prompt of ``request`` until its turn ends (EOS id, stop string or its budget)."""
        if not isinstance(request, WaveRequest):
            raise TypeError(f"generate takes a WaveRequest (TokenEnv.wave_request()), got {type(request).__name__}")
        n = len(request)
        if self.llm is None:
            raise RuntimeError("this VLLMPolicy is closed; build a new one")
        if n == 0:
            return empty_result(self.is_unmodified, self.version)
        budgets = self._check_request(request)
        params = self._request_params(request, budgets)
        prompts = [{"prompt_token_ids": p.tolist()} for p in request.prompts]
        adapter = None if self.adapters is None else self.adapters.request
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=adapter)
        self.seeds.advance(n)
        return self._result([o.outputs[0] for o in outputs])

    def _check_request(self, request: WaveRequest) -> list[int]:
        return check_budgets(request, self.max_model_len)

    def _request_params(self, request: WaveRequest, budgets: list[int]) -> list:
        base = dict(self._base_params, stop_token_ids=list(request.eos_token_ids))
        if request.stop_strings and self._can_stop_strings:
            base.update(stop=list(request.stop_strings), detokenize=True)
        make = self._vllm.SamplingParams
        seeds = self.seeds.next(len(budgets), greedy=self.sampling.greedy)
        return [make(**base, max_tokens=m, seed=seed) for m, seed in zip(budgets, seeds, strict=True)]

    def _result(self, completions) -> WaveResult:
        log_probs = [None if c.logprobs is None else c.logprobs.logprobs for c in completions]
        return wave_result([c.token_ids for c in completions], log_probs, is_unmodified=self.is_unmodified,
                           version=self.version)  # fmt: skip

    # -- weights --
    def update_weights(self, weights=None) -> int:
        """Load the trainer's weights into the running engine, reset its prefix cache, bump the version.

        Args:
            weights: a ``transformers`` state_dict or a TensorDict of weights (transformers names), all
                of them; ``None`` reloads the engine's checkpoint directory (after the trainer saved to it).
                A LoRA policy takes the PEFT model (or its adapter's tensors): a new adapter version, no
                cache reset (a new adapter name), or the merged weights for an engine without LoRA.
        """
        if self.llm is None:
            raise RuntimeError("this VLLMPolicy is closed; build a new one")
        self._load(weights)
        self.version += 1
        return self.version

    def _load(self, weights) -> None:
        if self.adapters is not None:
            tensors = self.adapter.tensors(weights)
            self.adapters.load(tensors)
            self.last_update_bytes = tensor_bytes(tensors)
            return
        if self.adapter is not None:  # an engine without LoRA: the base checkpoint with the adapter merged
            tensors = self.adapter.tensors(weights)
            weights = self.adapter.merge(read_checkpoint(self.llm.llm_engine.model_config.model), tensors)
        elif weights is None:
            weights = read_checkpoint(self.llm.llm_engine.model_config.model)
        check_not_adapter(weights_of(weights), "the VLLMPolicy")
        items = weight_items(weights, self._checkpoint, self._tied)
        self.last_update_bytes = tensor_bytes(items)
        # vLLM's CPU backend repacks linear weights after loading, so model.load_weights fails on a
        # running engine; the worker's reload path undoes the packing, loads, and packs again
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
        self.llm.reset_prefix_cache()

    # -- state --
    def set_seed(self, seed: int) -> None:
        """Restart the per-request seeds from ``seed``."""
        self.seeds.reseed(seed)

    def collection_state(self) -> dict:
        """Seed, request counter and version (the prefix cache is a cache: it is not saved)."""
        return self.seeds.collection_state(version=self.version)

    def load_collection_state(self, state: dict) -> None:
        """Restore :meth:`collection_state`."""
        self.version = self.seeds.load_collection_state(state)

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

