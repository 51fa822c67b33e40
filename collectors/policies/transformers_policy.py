"""TransformersPolicy: a transformers causal LM stepping a TokenEnv one token at a time, with a KV cache per slot."""

from __future__ import annotations

import threading

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from transformers import (
    DynamicCache,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from tokengym.collectors.policies._lora_sync import AdapterSpec, check_not_adapter, tensor_bytes
from tokengym.collectors.policies.compiled_decode import CompiledDecode
from tokengym.collectors.policies.graph_decode import GraphDecode
from tokengym.collectors.policies.kv_cache import SlotKVCache
from tokengym.collectors.policies.lora import is_lora_model, merged_weights
from tokengym.collectors.policies.prefix_store import DEFAULT_PREFIX_CACHE_BYTES, group_by_prompt
from tokengym.collectors.policies.protocol import Weights, check_fits_env, weights_of
from tokengym.collectors.policies.sampling import SamplingConfig, sample_tokens
from tokengym.collectors.policies.static_kv_cache import StaticSlotKVCache, static_capacity
from tokengym.collectors.policies.static_waves import step_wave
from tokengym.collectors.policies.vision_inputs import check_vision, slot_images, with_banned
from tokengym.llm_envs import keys
from tokengym.llm_envs.devices import generator_device, input_device, output_device, seeded_generator
from tokengym.llm_envs.vision import text_config, vision_token_ids
from tokengym.llm_envs.waves import WaveRequest, WaveResult

__all__ = ["TransformersPolicy"]


def _base_env(env):
    return getattr(env, "base_env", env)


class TransformersPolicy(TensorDictModuleBase):
    """Chooses the next token of every slot of a :class:`~tokengym.llm_envs.TokenEnv`, a step or a wave at a time.

    A :class:`~tokengym.collectors.policies.protocol.StepPolicy` and a
    :class:`~tokengym.collectors.policies.protocol.WavePolicy`; its :meth:`collection_state` holds the KV
    cache, and ``state_dict()`` is the module's (the model's weights).

    The prompt of a slot is prefilled once, when its trajectory id changes (the env refilled it);
    every later step is one incremental forward of the whole batch over the cache. Tokens the env
    inserts (multi-turn feedback) are prefilled when ``seq_len`` jumps; the model's own tokens are
    never re-tokenized or re-run.

    The model's device decides where the policy works: the KV cache on the model's devices, sampling on the logits'
    device with a generator there (seeded with ``seed``: the same seed gives the same tokens on the same device),
    log-probs in float32 whatever the model's dtype. What it writes into the step's TensorDict is on the host, with
    the env's slot state: each step copies the sampled ids and log-probs to the host in one copy. Build the policy
    after moving the model (``model.to("cuda")``); a model moved later raises a ``ValueError``.

    A ``peft`` LoRA model works as it is: a weight update then copies only the adapter's tensors into it
    (:func:`~tokengym.collectors.policies.adapter_weights`; ``weight_sync`` is ``"adapter"``).

    Args:
        model: a transformers causal LM (``use_cache`` support required), or a PEFT LoRA model of one.
        env: the env whose ``tokens`` buffer holds the prompts (a ``TransformedEnv`` of one works).
        sampling: a :class:`SamplingConfig`.
        seed: seed of the sampling generator.
        return_raw_log_prob: also write ``keys.RAW_LOG_PROB`` (model log-prob at temperature 1).
        share_prefixes: compute a shared prompt once: slots refilled together with the same prompt (a group's
            samples) prefill it once and copy the cache rows, a wave prefills each distinct prompt once; False
            prefills every row.
        prefix_cache_bytes: bytes of recent prompts' keys and values kept for the later samples of their groups
            (slots refilled at different times); 0 keeps none.
        decode: how a step decodes: ``"dynamic"`` (the default: a cache as wide as the longest live slot, grown by a
            column per step), ``"static"`` (buffers allocated once for the env's ``max_length`` and a quarter more,
            every step the same shapes: :class:`StaticSlotKVCache`; the same tokens and log-probs), ``"graph"``
            (the static step and its sampling captured in one CUDA graph and replayed: :class:`GraphDecode`; CUDA
            only, not with a LoRA model) or ``"compile"`` (the static step and its sampling compiled whole with
            ``torch.compile(mode="reduce-overhead")``: :class:`CompiledDecode`; CUDA graphs on CUDA, Inductor's
            kernels on the CPU; the first step of a policy compiles; not with a LoRA model).

    Example:
        >>> from tokengym.llm_envs import TokenEnv
        >>> from tokengym.testing import tiny_tokenizer, tiny_model
        >>> tok = tiny_tokenizer(); model = tiny_model(tok)
        >>> env = TokenEnv(["1+1="], tok, batch_size=2, max_new_tokens=4, model_config=model.config)
        >>> policy = TransformersPolicy(model, env, seed=0)
        >>> td = policy(env.reset())
        >>> td["action"].shape, td["action_log_prob"].dtype
        (torch.Size([2]), torch.float32)
    """

    in_keys = [keys.TOKEN, keys.SEQ_LEN, keys.TRAJ_ID, keys.ACTIVE]
    out_keys = [keys.ACTION, keys.ACTION_LOG_PROB, keys.POLICY_VERSION]
    supports_cache_state = True

    def __init__(
        self,
        model,
        env,
        *,
        sampling: SamplingConfig | None = None,
        seed: int = 0,
        return_raw_log_prob: bool = False,
        share_prefixes: bool = True,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
        decode: str = "dynamic",
    ) -> None:
        super().__init__()
        if sampling is not None and not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        _check_model(model)
        if input_device(model).type == "meta":
            raise ValueError(_META.format(what="TransformersPolicy got a model whose weights are on the meta device"))
        self.model, self.sampling = model, sampling or SamplingConfig()
        # not a submodule: state_dict(), parameters() and .to() are the model's alone
        object.__setattr__(self, "env", _base_env(env))
        self.is_vision = check_vision(model, self.env, decode)
        if self.is_vision:  # placeholders the processor writes: never sampled
            self.sampling = with_banned(self.sampling, vision_token_ids(model))
        config = text_config(model.config)
        positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        check_fits_env(self.env, type(model).__name__, vocab_size=int(config.vocab_size), positions=positions,
                       sampling=self.sampling, takes_images=self.is_vision,
                       length_fix="build the env with model_config=model.config (or max_length <= {positions})")  # fmt: skip
        self.return_raw_log_prob = return_raw_log_prob
        self._sharing = {"share_prefixes": bool(share_prefixes), "prefix_cache_bytes": prefix_cache_bytes}
        if return_raw_log_prob:
            self.out_keys = [*self.out_keys, keys.RAW_LOG_PROB]
        self.adapter = AdapterSpec.of(model) if is_lora_model(model) else None
        self.decode = _check_decode(decode, model, self.adapter)
        self.graph = None
        """The :class:`GraphDecode` of ``decode="graph"`` or the :class:`CompiledDecode` of ``decode="compile"`` (their
        ``captures`` and ``capture_seconds``), else ``None``."""
        self.weight_sync = "full" if self.adapter is None else "adapter"
        """What an update sends: ``"adapter"`` (a LoRA model: the adapter's tensors) or ``"full"`` (every weight)."""
        self.last_update_bytes = 0
        """Bytes of the tensors the last :meth:`update_weights` copied in (0: the model was trained in place)."""
        self.version = 0
        self.interrupt = threading.Event()
        """Set (by a collector, when weights are published from another thread): the wave in progress stops after
        the token it is generating, its rows unfinished (``WaveResult.finished``), and goes on in the next wave
        under the new weights (partial rollouts). Cleared by the collector when it applies the update."""
        self._version_tensor: torch.Tensor | None = None
        self._version_stamped = -1  # the version _version_tensor holds (no tensor read per step)
        self.generator = seeded_generator(output_device(model), seed)
        get = getattr(model, "get_input_embeddings", None)
        # the module outlives .to(): its weight's device is read per step; not a submodule (state_dict is the model's)
        object.__setattr__(self, "_embedding", get() if callable(get) else None)
        self.reset_cache()

    def reset_cache(self) -> None:
        """Drop every cached slot; the next call prefills all slots from the env's token buffer."""
        if getattr(self, "cache", None) is None:
            self._new_cache()
        else:
            self.cache.clear()  # no new cache: that probes the model for its layer shapes

    # -- stepping --
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Write ``action``, ``action_log_prob`` and ``policy_version`` for every slot."""
        token, seq_len = tensordict.get(keys.TOKEN), tensordict.get(keys.SEQ_LEN)
        traj, active = tensordict.get(keys.TRAJ_ID), tensordict.get(keys.ACTIVE)
        self._check_placement()
        self.cache.sync(self.env.tokens, seq_len, traj, active)  # the env's read-only buffer: new prefixes only
        if self.graph is not None:  # the decode step and its sampling in one replayed graph
            action, logp, raw = self.graph.step(token, active)
        else:
            logits = self.cache.decode(token, active)  # idle rows attend to their own token: finite, and ignored
            action, logp, raw = sample_tokens(logits, self.sampling, self.generator,
                                              with_raw_log_prob=self.return_raw_log_prob)  # fmt: skip
        if not action.is_cpu:  # the env's state is on the host: one device-to-host copy per step
            action, logp, raw = _to_host(action, logp, raw)
        tensordict.set(keys.ACTION, action)
        tensordict.set(keys.ACTION_LOG_PROB, logp)
        if self._version_tensor is None or self._version_stamped != self.version:
            self._version_tensor, self._version_stamped = torch.full_like(action, self.version), self.version
        tensordict.set(keys.POLICY_VERSION, self._version_tensor)  # shared: nobody writes it in place
        if self.return_raw_log_prob:
            tensordict.set(keys.RAW_LOG_PROB, raw)
        return tensordict

    def fork(self, parents: list[int], children: list[int], lengths: list[int], trajs: list[int]) -> None:
        """Slots ``children`` continue copies of ``parents``' sequences (``lengths`` tokens) as trajectories ``trajs``
        (:meth:`~tokengym.llm_envs.TokenEnv.fork`, a tree's branches): their KV cache rows are copied from the
        parents' rows up to the fork (:meth:`SlotKVCache.copy_rows`), no forward; call it before the next step."""
        self.cache.fork(parents, children, lengths, trajs)

    def _new_cache(self) -> None:
        """A KV cache for the model as it is now (its layers' shapes and dtype probed), every slot to prefill."""
        self._dtype = _weight_dtype(self.model, self._embedding)
        B = self.env.batch_size[0]
        if self.decode == "dynamic":
            images = slot_images(self.env) if self.is_vision else None
            self.cache = SlotKVCache(self.model, B, images=images, **self._sharing)
            return
        capacity = static_capacity(self.env.tokens.shape[-1])
        self.cache = StaticSlotKVCache(self.model, B, capacity=capacity, **self._sharing)
        if self.decode in _STEPS:  # the decode step and its sampling captured (CUDA graph) or compiled
            self.graph = _STEPS[self.decode](self.cache, self.sampling, self.generator,
                                             with_raw=self.return_raw_log_prob)  # fmt: skip

    def _check_placement(self) -> None:
        weight = getattr(self._embedding, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.device == self.cache.device and weight.dtype == self._dtype:
            return  # every step: attribute reads, no device sync (the full lookup costs ~6 us)
        device = input_device(self.model)  # an offloaded embedding (meta weights) runs on its hook's device
        if device.type == "meta":
            raise ValueError(_META.format(what=f"TransformersPolicy was built with its model on {self.cache.device}, "
                                               "the model's weights are now on the meta device"))  # fmt: skip
        if device != self.cache.device:
            raise ValueError(f"TransformersPolicy was built with its model on {self.cache.device}, the model is now on "
                             f"{device}: build the policy after moving the model (model.to({str(device)!r}))")  # fmt: skip
        if _weight_dtype(self.model, self._embedding) != self._dtype:
            # cast after the policy was built (model.half()): the cached keys and values are of the old dtype, so a
            # new cache of the new one; every slot is prefilled again from the env's tokens on this step
            self._new_cache()

    # -- teacher-forced log-probs --
    @torch.no_grad()
    def teacher_forced_log_probs(self, batch: TensorDictBase, *, with_entropy: bool = False):
        """Log-probs (N, T) of every step's action in a TRAJECTORIES batch, in one teacher-forced forward.

        Uses the sampling temperature (not top-k / top-p), so with an unfiltered sampler it
        reproduces ``action_log_prob`` of a batch collected under the same weights. With
        ``with_entropy`` also returns the per-step entropy (N, T). Padding steps hold 0. Memory: the last hidden
        states and one chunk of logits (:class:`ChunkedCategorical`), never (N, T, V).
        """
        from tokengym.collectors.policies.sequence_actor import SequenceActor

        actor = SequenceActor(self.model, pad_token_id=self.env.tokenizer.pad_token_id,
                              temperature=self.sampling.temperature)  # fmt: skip
        home = batch.get(keys.ACTION).device  # what comes back is on the batch's device
        dist = actor.chunked_dist(batch)  # the output layer per chunk of steps: no (N, T, V) logits
        if dist is not None:
            picked = dist.log_prob(batch.get(keys.ACTION).to(dist.index.device)).to(home)  # 0 on padding
            return (picked, dist.entropy().to(home)) if with_entropy else picked
        logp = actor.logits(batch).log_softmax(-1)  # (N, T, V) on the model's device
        mask = batch.get(keys.MASK).to(logp.device)
        picked = logp.gather(-1, batch.get(keys.ACTION).to(logp.device)[..., None]).squeeze(-1) * mask
        if not with_entropy:
            return picked.to(home)
        entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1) * mask  # -inf logits (padding, banned): p log p = 0
        return picked.to(home), entropy.to(home)

    # -- whole waves (generate-then-unroll) --
    @torch.no_grad()
    def generate(self, request: WaveRequest) -> WaveResult:
        """One ``model.generate`` call continuing every sequence of ``request`` (left-padded); with
        ``decode="static"``, ``"graph"`` or ``"compile"`` the wave runs on the stepping path's fixed-shape step
        instead (``static_waves.step_wave``: the same tokens for the same generator state uncaptured, one replayed
        graph per token on CUDA). A vision-language model's waves run on that step over its
        dynamic cache, each row prefilled with its slot's images.

        Sampling goes through the same :func:`sample_tokens` and generator as stepping, so a wave is
        token-for-token what stepping would produce from the same state. When :attr:`interrupt` is set the wave
        stops after the token being generated (checked between decode steps, no host synchronization); rows that
        had not ended are returned unfinished.
        """
        self._check_placement()
        n = len(request)
        if self.interrupt.is_set():  # an update is waiting: generate nothing, every row goes on after it
            return WaveResult(actions=torch.zeros(n, 0, dtype=torch.int64), lengths=torch.zeros(n, dtype=torch.int64),
                              log_probs=torch.zeros(n, 0), version=self.version,
                              finished=torch.zeros(n, dtype=torch.bool))  # fmt: skip
        if self.decode != "dynamic" and n <= self.env.batch_size[0]:  # the stepping path's fixed-shape step
            actions, logp, raw = step_wave(self.cache, request, sampling=self.sampling, generator=self.generator,
                                           with_raw=self.return_raw_log_prob, interrupt=self.interrupt, graph=self.graph,
                                           pad_token_id=self.env.tokenizer.pad_token_id)  # fmt: skip
        elif self.is_vision:  # the stepping path's step over the wave's rows, each prefilled with its slot's images
            images, slots = self.cache.images, request.slots.tolist()
            self.cache.images = lambda row: images(slots[row]) if row < len(slots) else None
            try:
                actions, logp, raw = step_wave(self.cache, request, sampling=self.sampling, generator=self.generator,
                                               with_raw=self.return_raw_log_prob, interrupt=self.interrupt,
                                               pad_token_id=self.env.tokenizer.pad_token_id)  # fmt: skip
            finally:
                self.cache.images = images
        else:
            actions, logp, raw = self._generate(request)
        T = actions.shape[1]
        is_eos = torch.isin(actions, torch.tensor(request.eos_token_ids, dtype=torch.int64))
        first_eos = torch.where(is_eos, torch.arange(T), T).min(1).values
        out_len = torch.minimum(torch.minimum(first_eos + 1, torch.full_like(first_eos, T)), request.max_new_tokens)
        finished = None
        if T < int(request.max_new_tokens.max()):  # stopped early: every row at an end id, or interrupted
            finished = (first_eos < T) | (request.max_new_tokens <= T)
            finished = None if bool(finished.all()) else finished
        return WaveResult(actions=actions, lengths=out_len, log_probs=logp, raw_log_probs=raw,
                          version=self.version, finished=finished)  # fmt: skip

    def _generate(self, request: WaveRequest):
        """``model.generate`` over the wave (left-padded): (actions, log-probs, raw log-probs) (n, T) on the host."""
        n = len(request)
        lengths = torch.tensor([len(p) for p in request.prompts], dtype=torch.int64)
        width = int(lengths.max())
        prompts = torch.full((n, width), self.env.tokenizer.pad_token_id, dtype=torch.int64)
        mask = torch.zeros(n, width, dtype=torch.int64)
        for i, ids in enumerate(request.prompts):  # one copy per sequence and wave, never per step
            prompts[i, width - len(ids) :] = ids
            mask[i, width - len(ids) :] = 1
        packed = torch.stack([prompts, mask]).to(self.cache.device, non_blocking=True)  # one host-to-device copy
        prompts, mask = packed[0], packed[1]
        shared = self._shared_prompts(request.prompts, prompts, mask)  # None: nothing to share
        sampler = _SamplingProcessor(self.sampling, self.generator, with_raw=self.return_raw_log_prob)
        self.model.generate(
            input_ids=prompts, attention_mask=mask, max_new_tokens=int(request.max_new_tokens.max()),
            do_sample=False, logits_processor=LogitsProcessorList([sampler]), eos_token_id=list(request.eos_token_ids),
            pad_token_id=self.env.tokenizer.pad_token_id, num_beams=1, use_cache=True,
            stopping_criteria=StoppingCriteriaList(self._stops(request)),
            **({} if shared is None else {"past_key_values": shared}),
        )  # fmt: skip
        actions, logp = torch.stack(sampler.actions, dim=1), torch.stack(sampler.log_probs, dim=1)  # (B, T)
        raw = torch.stack(sampler.raw_log_probs, dim=1) if self.return_raw_log_prob else None
        if actions.device.type != "cpu":  # the wave's rows go to the host in one copy
            actions, logp, raw = _to_host(actions, logp, raw)
        return actions, logp, raw

    def _stops(self, request: WaveRequest) -> list[StoppingCriteria]:
        """What may stop a wave early: an interrupt (a weight update waits), enough rows finished (long tails)."""
        stops: list[StoppingCriteria] = [_Interrupted(self.interrupt)]
        if request.min_finished is not None and request.min_finished < len(request):
            stops.append(_EnoughFinished(request, self.cache.device))
        return stops

    def _shared_prompts(self, ids: list[torch.Tensor], prompts: torch.Tensor, mask: torch.Tensor) -> DynamicCache | None:
        """A wave's prompt cache with each distinct prompt prefilled once (all but its last token) and its rows
        repeated for every sequence of it; ``generate`` then starts from it. ``None`` when every prompt differs."""
        if not self.cache.share_prefixes or prompts.shape[1] < 2:
            return None
        groups = list(group_by_prompt(ids).values())
        if len(groups) == len(ids):
            return None
        of = [0] * len(ids)  # the distinct prompt of each sequence
        for u, members in enumerate(groups):
            for i in members:
                of[i] = u
        index = torch.tensor([members[0] for members in groups] + of).to(prompts.device, non_blocking=True)
        rep, of = index[: len(groups)], index[len(groups) :]
        head = mask[rep, :-1]
        sub = DynamicCache(config=self.model.config)
        self.model(input_ids=prompts[rep, :-1], attention_mask=head, position_ids=(head.cumsum(-1) - 1).clamp(min=0),
                   past_key_values=sub, logits_to_keep=1)  # fmt: skip
        shared = DynamicCache(config=self.model.config)
        for i, layer in enumerate(sub.layers):
            at = of.to(layer.keys.device)
            shared.update(layer.keys[at], layer.values[at], i)
        return shared

    # -- the TokenPolicy protocol --
    def update_weights(self, weights: Weights | None = None) -> int:
        """Copy ``weights`` into the model (a state_dict, a TensorDict of weights or a module; ``None``: the
        model was updated in place), drop the KV cache (live slots are re-prefilled under the new weights)
        and bump the version.

        A LoRA policy takes the adapter only (the PEFT model, its ``adapter_weights`` or its ``state_dict()``)
        and copies it into its model's adapter; a policy on a plain model given a PEFT model loads its
        :func:`~tokengym.collectors.policies.lora.merged_weights`.
        """
        if weights is self.model:  # trained in place
            weights = None
        self.last_update_bytes = 0
        if weights is not None and self.adapter is not None:
            tensors = self.adapter.tensors(weights)
            self.adapter.load_into(self.model, tensors)
            self.last_update_bytes = tensor_bytes(tensors)
        elif weights is not None:
            weights = weights_of(merged_weights(weights) if is_lora_model(weights) else weights)
            check_not_adapter(weights, "TransformersPolicy's model")
            weights = _loadable(self.model, weights)
            self.model.load_state_dict(weights)
            self.last_update_bytes = tensor_bytes(weights)
        self.reset_cache()
        self.version += 1
        return self.version

    def set_seed(self, seed: int) -> None:
        """Reseed the sampling generator."""
        self.generator.manual_seed(seed)

    def close(self) -> None:
        """Drop the KV cache (the model stays the caller's)."""
        self.reset_cache()

    def collection_state(self, *, include_cache: bool = True) -> dict:
        """Collection state to checkpoint: sampling generator, version and the KV cache (not the weights).

        The cache is saved rather than rebuilt on resume: a re-prefill gives log-probs that differ in
        the last bits, and a resumed run must yield exactly what the uninterrupted one would have.
        ``include_cache=False`` leaves it out (for a real model it is gigabytes): resume re-prefills.
        """
        out = {"generator": self.generator.get_state(), "generator_device": generator_device(self.generator),
               "version": self.version}  # fmt: skip
        if include_cache:
            out["cache"] = self.cache.state_dict()
        return out

    def load_collection_state(self, state: dict) -> None:
        """Restore :meth:`collection_state` (without a saved cache, every live slot is re-prefilled).

        The generator's state belongs to the device it ran on: a checkpoint of a policy on CUDA loads into a policy
        on CUDA (load the file with ``torch.load(path, map_location="cpu", weights_only=True)`` where the checkpoint's
        tensors must not land on a GPU; the KV cache goes back to the model's device).
        """
        saved, mine = state.get("generator_device", "cpu"), generator_device(self.generator)
        if saved != mine:
            raise ValueError(f"this checkpoint's sampling generator ran on {saved}, this policy samples on {mine}: "
                             f"resume on a {saved} model (the same seed draws other tokens on another device), or "
                             "start a new run with set_seed()")  # fmt: skip
        self.generator.set_state(state["generator"].cpu())
        self.version = int(state["version"])
        self.reset_cache()
        if state.get("cache") is not None:
            self.cache.load_state_dict(state["cache"])


def _to_host(action: torch.Tensor, logp: torch.Tensor, raw: torch.Tensor | None):
    """``action``, ``logp`` and ``raw`` copied to the host with one host synchronization and no kernel: the log-probs
    go first, without waiting, into pinned memory; the ids' blocking copy then waits for the stream, theirs included."""
    floats = [logp] if raw is None else [logp, raw]
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in floats]
    for host, t in zip(pinned, floats, strict=True):
        host.copy_(t, non_blocking=True)
    action = action.cpu()  # the step's one synchronization
    return action, pinned[0], None if raw is None else pinned[1]


class _Interrupted(StoppingCriteria):
    """Stops ``generate`` after the current token once ``event`` is set (a weight update waits)."""

    def __init__(self, event: threading.Event) -> None:
        self.event, self.go_on = event, None  # go_on: the all-False answer, made once per wave

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        if self.event.is_set():
            return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if self.go_on is None:
            self.go_on = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return self.go_on


class _EnoughFinished(StoppingCriteria):
    """Stops ``generate`` once ``request.min_finished`` rows ended their turn (an end id, or their budget): the
    other rows come back unfinished and go on in the next wave. Counted on the device (no host synchronization)."""

    def __init__(self, request: WaveRequest, device: torch.device) -> None:
        self.eos = torch.tensor(request.eos_token_ids, dtype=torch.int64, device=device)
        self.budget = request.max_new_tokens.to(device)
        self.k, self.steps, self.finished = int(request.min_finished), 0, None

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.steps += 1
        ended = torch.isin(input_ids[:, -1], self.eos) | (self.budget <= self.steps)
        self.finished = ended if self.finished is None else self.finished | ended
        return (self.finished.sum() >= self.k).expand(input_ids.shape[0])


class _SamplingProcessor(LogitsProcessor):
    """Samples inside ``generate`` with tokengym's sampler; returns one-hot scores so greedy picks it."""

    def __init__(self, config: SamplingConfig, generator: torch.Generator, *, with_raw: bool) -> None:
        self.config, self.generator, self.with_raw = config, generator, with_raw
        self.actions: list[torch.Tensor] = []
        self.log_probs: list[torch.Tensor] = []
        self.raw_log_probs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        action, logp, raw = sample_tokens(scores, self.config, self.generator, with_raw_log_prob=self.with_raw)
        self.actions.append(action)
        self.log_probs.append(logp)
        self.raw_log_probs.append(raw)
        out = torch.full_like(scores, -float("inf"))
        return out.scatter_(-1, action[:, None], 0.0)


_META = ("{what} (a model built without its weights: device='meta', init_empty_weights(), to('meta')): there is "
         "nothing to run: load the weights (from_pretrained(name), or model.to_empty(device='cpu') then "
         "model.load_state_dict(weights)) and build the policy on a model with its weights loaded")


def _weight_dtype(model, embedding) -> torch.dtype | None:
    """The dtype the model computes in, as cheaply as it can be read: its input embedding's weight, else its first
    floating-point parameter's (``None`` when it has none)."""
    weight = getattr(embedding, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


_DECODES = ("dynamic", "static", "graph", "compile")
_STEPS = {"graph": GraphDecode, "compile": CompiledDecode}  # the decodes whose step is captured or compiled


def _check_decode(decode, model, adapter) -> str:
    if decode not in _DECODES:
        raise ValueError(f"decode must be one of {_DECODES}, got {decode!r}")
    if decode == "graph":
        device = input_device(model)
        if device.type != "cuda":
            raise ValueError(f"decode='graph' captures the decode step in a CUDA graph; the model is on {device}: "
                             "use decode='static' (the same fixed-shape step, uncaptured) or move the model to CUDA "
                             "before building the policy")  # fmt: skip
    if decode in _STEPS and adapter is not None:
        raise ValueError(f"decode={decode!r} does not take a LoRA model (an adapter swap would leave the "
                         f"{'graph' if decode == 'graph' else 'compiled step'} on the old adapter's tensors): use "
                         "decode='static', or merge the adapter (model.merge_and_unload()) for generation")  # fmt: skip
    return decode


def _check_model(model) -> None:
    if not hasattr(model, "config") or not callable(model):
        raise TypeError(f"model must be a transformers causal LM, got {type(model).__name__}")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{type(model).__name__} is encoder-decoder; TransformersPolicy needs a causal LM")
    if getattr(model.config, "use_cache", True) is False:
        raise ValueError(
            f"{type(model).__name__}.config.use_cache is False; set model.config.use_cache = True "
            "(TransformersPolicy decodes incrementally with a KV cache)"
        )


def _loadable(model, weights: dict) -> dict:
    """``weights`` without the non-persistent buffers (rotary ``inv_freq``) a ``TensorDict.from_module`` holds:
    ``load_state_dict`` refuses names outside the module's ``state_dict()``."""
    persistent = model.state_dict().keys()
    buffers = {name for name, _ in model.named_buffers()}
    return {k: v for k, v in weights.items() if k in persistent or k not in buffers}
