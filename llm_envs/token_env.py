"""TokenEnv: a TorchRL env where one step is one generated token, for ``B`` parallel slots."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from tensordict import TensorDictBase
from torchrl.envs import EnvBase

from tokengym.llm_envs import keys
from tokengym.llm_envs._decode import ResponseDecoder
from tokengym.llm_envs._env_checks import (
    check_budget,
    check_env_args,
    check_int,
    context_limit,
    eos_ids,
)
from tokengym.llm_envs._loading import PromptLoader, overrides
from tokengym.llm_envs._slots import Slots
from tokengym.llm_envs._step_core import StepCore
from tokengym.llm_envs._stop import StopChecker
from tokengym.llm_envs._turn_ends import TurnEnds
from tokengym.llm_envs.errors import PromptError
from tokengym.llm_envs.image_inputs import ImageInputs, check_processor_fits, encode_images_in_ids
from tokengym.llm_envs.prompts import Prompt, PromptSource
from tokengym.llm_envs.turns.protocol import EnvFacts, HeldEpisode, TurnHandler
from tokengym.llm_envs.turns.render import ChatRenderer
from tokengym.llm_envs.turns.scoring import RewardTurns, turn_handler
from tokengym.llm_envs.vision import text_config
from tokengym.llm_envs.waves import WaveRequest, WaveResult

__all__ = ["TokenEnv", "RewardFn"]

RewardFn = Callable[[list[str], list[str], list[dict]], "Sequence[float] | torch.Tensor"]
_NO_SEQUENCES: dict[int, torch.Tensor] = {}


class TokenEnv(EnvBase):
    """Token-level LLM environment: each step appends one token per slot; finished slots are refilled.

    The observation is O(1) in sequence length (the last token, lengths and ids); the sequence
    itself is written once into a preallocated ``(B, max_length)`` buffer, read through
    :meth:`history` (a KV-cached policy reads it only when it prefills a slot). A turn ends on EOS,
    a stop string or a limit; what happens then is the env's *turn handler*'s answer
    (:mod:`~tokengym.llm_envs.turns`), called once per step for all slots whose turn ended: by default
    ``reward_fn`` scores the response and the episode ends (:class:`~tokengym.llm_envs.turns.RewardTurns`).
    A handler may answer with feedback messages: the env then writes after the model's tokens, in the
    same slot, what the tokenizer's chat template writes there for the same conversation (the rest of
    the assistant turn's close, the messages and the generation prompt) and the episode goes on, up to
    ``max_turns``. No step is emitted for the env's tokens: ``turn`` increases, ``prompt_len`` moves to the
    start of the new turn and ``seq_len`` jumps, so a KV-cached policy prefills just the appended tokens.
    Besides stepping, a whole wave of generated tokens enters through :meth:`wave_request` and
    :meth:`unroll`, with the same termination and rewards.

    Args:
        prompts: a list of strings, chat message lists, token-id lists or mappings with a ``prompt``
            field (other fields become metadata), any iterable of those, a ``datasets.Dataset``, or a
            :class:`~tokengym.llm_envs.prompts.PromptSource`.
        tokenizer: a transformers tokenizer with ``pad_token_id`` and ``eos_token_id``.
        reward_fn: ``fn(responses, prompts, metadata) -> floats`` (one per finished slot), a TRL reward
            function ``f(prompts, completions, **columns)`` (detected by its ``completions`` parameter and
            called as TRL calls it, see :func:`~tokengym.llm_envs.from_trl_reward`), or ``None``.
        turns: the turn handler (:class:`~tokengym.llm_envs.turns.TurnHandler`) instead of ``reward_fn``: it
            scores finished turns and may answer with feedback (multi-turn, tools, external episodes).
        max_turns: turns per episode (>= 1); a multi-turn env also ends a turn on the chat template's
            end-of-turn token (unless ``eos_token_ids`` is given).
        batch_size: number of parallel slots ``B``.
        max_new_tokens: generated tokens per trajectory, all its turns together (``truncated`` when reached).
        max_turn_tokens: generated tokens per turn (TRL's per-generation ``max_completion_length``); a turn
            that reaches it ends there: a single-turn trajectory is ``truncated``, a multi-turn episode goes on
            to its next turn (the env answers it as any finished turn). ``None`` (default): no per-turn limit.
        group_size: samples per prompt; they share ``group_id`` (TRL's ``num_generations``, verl's ``rollout.n``).
        max_length: capacity of a sequence (prompt + response), e.g. the model's context limit;
            defaults to ``model_config``'s limit or the tokenizer's. ``max_new_tokens`` must be below it.
        stop_strings: strings that end a response (``terminated``).
        eos_token_ids: token ids that end a response; defaults to the tokenizer's and the model's
            generation config eos ids.
        model_config: a transformers config, used for the context limit.
        seed: seed of the prompt order (with ``shuffle``).
        shuffle: shuffle a sized prompt source every epoch.
        overlong_prompts: ``"error"`` (default), ``"skip"`` or ``"truncate"`` a prompt of ``max_length`` tokens
            or more (see :class:`~tokengym.llm_envs.prompts.OverlongPrompts`; :attr:`prompt_counts` counts them).
            With a :class:`PromptSource`, set its ``overlong`` instead.
        processor: a vision-language model's processor, for prompts with images (``{"prompt": messages, "images":
            [...]}``): the source renders them through it and each :class:`Prompt` carries its
            :class:`~tokengym.llm_envs.image_inputs.ImageInputs` (see the "Vision-language models" guide). With a
            :class:`PromptSource`, give it to the source instead.

    Example:
        >>> from tokengym.testing import tiny_tokenizer
        >>> tok = tiny_tokenizer()
        >>> env = TokenEnv(["1+1=", "2+2="], tok, batch_size=2, max_new_tokens=3, max_length=32)
        >>> td = env.reset()
        >>> td = env.step(td.set("action", torch.tensor([tok.eos_token_id, 40])))
        >>> td["next", "done"].squeeze(-1).tolist(), td["next", "terminated"].squeeze(-1).tolist()
        ([True, False], [True, False])
    """

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        _show_signature(cls)

    def __init__(
        self,
        prompts: Iterable | PromptSource,
        tokenizer,
        reward_fn: RewardFn | None = None,
        *,
        turns: TurnHandler | None = None,
        max_turns: int = 1,
        batch_size: int = 8,
        max_new_tokens: int = 64,
        max_turn_tokens: int | None = None,
        group_size: int = 1,
        max_length: int | None = None,
        stop_strings: Sequence[str] = (),
        eos_token_ids: Sequence[int] | None = None,
        model_config=None,
        seed: int = 0,
        shuffle: bool = False,
        overlong_prompts: str = "error",
        processor=None,
    ) -> None:
        check_env_args(tokenizer, batch_size=batch_size, max_new_tokens=max_new_tokens, max_turn_tokens=max_turn_tokens,
                       max_turns=max_turns)  # fmt: skip
        turns = turn_handler(reward_fn, turns)
        super().__init__(batch_size=torch.Size([batch_size]))
        if isinstance(prompts, PromptSource):
            if overlong_prompts != "error":
                raise ValueError(f"overlong_prompts={overlong_prompts!r} with a PromptSource: set it on the source, "
                                 "PromptSource(..., overlong=...)")  # fmt: skip
            if processor is not None and processor is not prompts.processor:
                raise ValueError("processor= with a PromptSource: give the processor to the source, "
                                 "PromptSource(..., processor=...)")  # fmt: skip
            self.source = prompts
        else:
            self.source = PromptSource(prompts, tokenizer, group_size=group_size, shuffle=shuffle, seed=seed,
                                       overlong=overlong_prompts, processor=processor)  # fmt: skip
        self.processor = self.source.processor
        check_processor_fits(self.processor, model_config)
        if model_config is not None:  # a vision-language config keeps its limits in its text config
            model_config = text_config(model_config)
        self.tokenizer, self.turns, self.max_turns, self.max_new_tokens = tokenizer, turns, max_turns, max_new_tokens
        self.max_turn_tokens = max_turn_tokens
        self.max_length = max_length if max_length is not None else context_limit(tokenizer, model_config)
        check_int("max_length", self.max_length)
        check_budget(max_new_tokens, self.max_length, is_given=max_length is not None)
        self.source.cap_prompt_length(self.max_length - 1)  # a prompt leaves room for one response token
        self.vocab_size = len(tokenizer)
        if model_config is not None and getattr(model_config, "vocab_size", None):
            self.vocab_size = max(self.vocab_size, int(model_config.vocab_size))
        self.eos_token_ids = eos_ids(tokenizer, model_config, eos_token_ids, self.vocab_size)
        self._renderer = ChatRenderer(tokenizer) if max_turns > 1 else None
        end_of_turn = None if self._renderer is None else self._renderer.end_of_turn_id
        if eos_token_ids is None and end_of_turn is not None:
            self.eos_token_ids = self.eos_token_ids | {end_of_turn}  # the template's end of turn ends a turn
        self._stop = StopChecker(tokenizer, stop_strings, self.vocab_size)
        self._make_specs()
        self._alloc()
        self.turns.bind(self.facts())

    # -- setup --
    def _make_specs(self) -> None:
        specs = keys.make_spec(self.batch_size[0], self.vocab_size, self.max_length)
        self.observation_spec = specs["observation"]
        self.action_spec = specs[keys.ACTION]
        self.reward_spec = specs[keys.REWARD_NAME]
        self.full_done_spec = specs[keys.DONE_NAME]

    def _alloc(self) -> None:
        self._slots = Slots(self.batch_size[0], self.max_length)
        self._turn_ends = TurnEnds(self._slots, self._renderer, max_turns=self.max_turns, max_length=self.max_length,
                                   vocab_size=self.vocab_size, decode=self.decode_responses,
                                   encode=self._encode_observation,
                                   images=None if self.processor is None else self._feedback_images)  # fmt: skip
        self._loader = PromptLoader(self._slots, max_length=self.max_length, vocab_size=self.vocab_size,
                                    encode=self._encode_observation, counts=self._turn_ends.metrics,
                                    wake=self._turn_ends.wake_now)  # fmt: skip
        if self.turns.wants_log_probs:
            self._slots.keep_log_probs()
        eos = torch.tensor(sorted(self.eos_token_ids), dtype=torch.int64)
        self._core = StepCore(self._slots, self._turn_ends, self._stop, eos, self.vocab_size)
        self._reset_td = None
        self._decoder: ResponseDecoder | None = None

    def facts(self) -> EnvFacts:
        """What the turn handler is told about this env (:meth:`TurnHandler.bind`)."""
        limit = getattr(self.source, "max_prompt_length", None)
        return EnvFacts(tokenizer=self.tokenizer, eos_token_ids=frozenset(self.eos_token_ids), max_turns=self.max_turns,
                        max_length=self.max_length, max_new_tokens=self.max_new_tokens,
                        max_turn_tokens=self.max_turn_tokens,
                        max_prompt_length=self.max_length - 1 if limit is None else min(limit, self.max_length - 1),
                        batch_size=self.batch_size[0], group_size=int(getattr(self.source, "group_size", 1)),
                        stop_strings=tuple(self.stop_strings))  # fmt: skip

    def _encode_observation(self, item) -> tuple[torch.Tensor, str, dict, list | None]:
        """Ids, text, metadata and chat messages of an observation a handler serves (a prompt item: a text, chat
        messages, token ids, or a mapping with a ``prompt`` field whose other fields are metadata), encoded as the
        prompt source encodes prompts."""
        ids, text, meta = self.source.encode(item, -1)
        chat = item.get("prompt", item.get("messages")) if isinstance(item, Mapping) else item
        is_chat = isinstance(chat, list | tuple) and bool(chat) and all(isinstance(m, Mapping) for m in chat)
        return ids, text, meta, [dict(m) for m in chat] if is_chat else None

    def _feedback_images(self, ids: torch.Tensor, images, where: str):
        """Rendered feedback ids with their image placeholders expanded, and the images' inputs."""
        return encode_images_in_ids(self.processor, ids, images, where=where)

    def _set_seed(self, seed: int | None) -> None:
        if seed is not None:
            self.source.seed = seed

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" if k == "overlong_prompts" else f"{k}={v}" for k, v in self.config().items())
        return f"{type(self).__name__}({fields})"

    def config(self) -> dict:
        """The env's configuration as ``repr`` shows it (sizes, limits, prompt source, reward, end ids)."""
        source = self.source
        n = len(source.prompts) if getattr(source, "is_sized", False) else "?"
        return {
            "batch_size": self.batch_size[0], "group_size": getattr(source, "group_size", 1),
            "max_new_tokens": self.max_new_tokens, "max_turn_tokens": self.max_turn_tokens, "max_length": self.max_length,
            "prompts": f"{type(source).__name__}({n} items)", "vocab_size": self.vocab_size,
            "eos_token_ids": sorted(self.eos_token_ids), "stop_strings": list(self.stop_strings),
            "overlong_prompts": getattr(getattr(source, "overlong", None), "value", None),
            "turns": _describe(self.turns), "max_turns": self.max_turns,
        }  # fmt: skip

    @property
    def reward_fn(self):
        """The reward function of a single-turn env (``None`` when the turn handler is something else)."""
        return getattr(self.turns, "reward_fn", None)

    @reward_fn.setter
    def reward_fn(self, fn) -> None:
        if not isinstance(self.turns, RewardTurns):
            raise ValueError(f"this env's turns are answered by {type(self.turns).__name__}, not a reward_fn")
        self.turns = RewardTurns(fn)
        self.turns.bind(self.facts())

    @property
    def turn_metrics(self) -> dict[str, float]:
        """The env's turn counters and its turn handler's (:meth:`TurnHandler.metrics`), cumulative: turns that went
        on to a next turn (``feedback_turns``), the feedback tokens written (``feedback_tokens``), episodes ended
        because their feedback did not fit (``feedback_did_not_fit``), episodes a handler failed
        (``failed_episodes``), then the handler's own (``tool_calls``, ``reward_errors``...). Every collector adds them
        to its ``metrics``."""
        return {**self._turn_ends.metrics, **self.turns.metrics()}

    # -- public read-only views --
    @property
    def tokens(self) -> torch.Tensor:
        """The (B, max_length) token buffer: slot ``b`` holds ``seq_len[b]`` tokens. Read-only: do not write."""
        return self._slots.tokens

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Strings that end a turn."""
        return self._stop.stop_strings

    def history(self, slot: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Token ids ``[start, end)`` of ``slot``'s sequence (default: all of it so far); a read-only view."""
        stop = int(self._slots.state[keys.SEQ_LEN][slot]) if end is None else end
        return self._slots.tokens[slot, start:stop]

    def slot_prompt(self, slot: int) -> Prompt | None:
        """The prompt the slot is working on (``None`` once the source is exhausted)."""
        return self._slots.prompts[slot]

    def slot_images(self, slot: int) -> ImageInputs | None:
        """The images ``slot``'s trajectory holds so far (its prompt's, then those its feedback showed), in the order
        their tokens appear; ``None`` without images."""
        return self._slots.images[slot]

    def pop_finished_images(self) -> dict[int, ImageInputs]:
        """The images of multi-turn trajectories that ended since the last call and hold more than their prompt's
        (feedback showed images), by trajectory id; a collector records them in its prompt table."""
        slots = self._slots
        if not slots.finished_images:
            return {}
        out, slots.finished_images = slots.finished_images, {}
        return out

    def response_ids(self, slot: int) -> torch.Tensor:
        """Token ids generated so far in ``slot``'s current turn (a view into ``tokens``)."""
        s = self._slots.state
        return self._slots.tokens[slot, int(s[keys.PROMPT_LEN][slot]) : int(s[keys.SEQ_LEN][slot])]

    def pop_finished_sequences(self) -> dict[int, torch.Tensor]:
        """Full token ids (prompt, turns, feedback) of the episodes finished since the last call, by trajectory
        id (multi-turn envs; a single-turn sequence is its prompt plus its actions, so this is empty then)."""
        slots = self._slots
        if not slots.finished:
            return _NO_SEQUENCES
        out, slots.finished = slots.finished, {}
        return out

    def pop_parts(self) -> list[int]:
        """Trajectory ids that ended since the last call as parts of an episode that goes on in a new trajectory
        (``Turn(new_trajectory=True)``): a TRAJECTORIES collector holds them until their episode's last part."""
        parts = self._slots.parts
        if parts:  # the usual step splits nothing: no new list
            self._slots.parts = []
        return parts

    def held_episode(self, slot: int) -> HeldEpisode | None:
        """What ``slot`` holds, as the turn handler's hooks name it (slot, trajectory and episode ids, prompt);
        ``None`` for an idle slot."""
        prompt = self._slots.prompts[slot]
        return None if prompt is None else HeldEpisode(slot, self.slot_trajectory(slot), self._slots.episodes[slot], prompt)

    def slot_trajectory(self, slot: int) -> int:
        """The trajectory id of ``slot``'s current trajectory."""
        return int(self._slots.state[keys.TRAJ_ID][slot])

    @property
    def turn_close_ids(self) -> torch.Tensor:
        """Ids the chat template closes an assistant turn with (empty for a single-turn env or no template)."""
        return self._renderer.close_ids if self._renderer is not None else torch.zeros(0, dtype=torch.int64)

    def feedback_tokens(self, feedback: str, role: str = "user") -> torch.Tensor:
        """The token ids (a new 1-D int64 tensor) of a ``role`` message ``feedback`` plus the generation prompt, as the
        chat template writes them after an assistant turn (no default system prompt repeated);
        ``"\\n{feedback}\\n"`` without a template. Not the close of the turn before it: see :meth:`feedback_ids`.

        Example:
            >>> from tokengym.testing import tiny_tokenizer
            >>> tok = tiny_tokenizer()
            >>> env = TokenEnv(["1+1="], tok, max_turns=2, batch_size=1, max_new_tokens=8, max_length=64)
            >>> tok.decode(env.feedback_tokens("again"))
            '<|user|>again<|end|><|assistant|>'
        """
        return self._multi_turn_renderer().render([{"role": role, "content": feedback}]).clone()

    def feedback_ids(self, turn_ids: torch.Tensor, feedback, role: str = "user") -> torch.Tensor:
        """What the env writes after a finished turn ``turn_ids``: the rest of the template's turn close
        (:attr:`turn_close_ids` less what the turn already ends with), then the feedback (a text of ``role``
        or chat messages) and the generation prompt.

        Example:
            >>> from tokengym.testing import tiny_tokenizer
            >>> tok = tiny_tokenizer()
            >>> env = TokenEnv(["1+1="], tok, max_turns=2, batch_size=1, max_new_tokens=8, max_length=64)
            >>> end = tok.convert_tokens_to_ids("<|end|>")
            >>> tok.decode(env.feedback_ids(torch.tensor([40, end]), "again", "user"))
            '<|user|>again<|end|><|assistant|>'
            >>> tok.decode(env.feedback_ids(torch.tensor([40]), "again", "user"))  # ended by a stop string
            '<|end|><|user|>again<|end|><|assistant|>'
        """
        messages = [{"role": role, "content": feedback}] if isinstance(feedback, str) else feedback
        return self._multi_turn_renderer().feedback_ids(turn_ids, messages)

    def _multi_turn_renderer(self) -> ChatRenderer:
        if self._renderer is None:
            raise ValueError("a single-turn env (max_turns=1) writes no feedback; build it with max_turns > 1")
        return self._renderer

    @property
    def prompt_counts(self) -> dict[str, int]:
        """Prompt draws left out (``prompts_skipped_overlong``) or truncated (``prompts_truncated``) so far, and
        the turn handler's metrics (``reward_errors``: model answers a verifier raised on, scored 0; all of
        :attr:`turn_metrics` has them too)."""
        return {**self.source.counts, **self.turns.metrics()}

    @property
    def is_exhausted(self) -> bool:
        """True once the prompt source is empty and no slot holds a live trajectory."""
        return self.source.is_exhausted and not (self._slots.waiting or bool(self._slots.state[keys.ACTIVE].any()))

    # -- checkpoints --
    def state_dict(self) -> dict:
        """Everything needed to resume: prompt cursor, slot contents, counters, and the turn handler's
        :meth:`~tokengym.llm_envs.turns.TurnHandler.state_dict` (when it keeps any)."""
        turns = self.turns.state_dict()
        return {"source": self.source.state_dict(), **self._slots.state_dict(), **({"turns": turns} if turns else {})}

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict` (of an env with the same batch size and max_length)."""
        self._slots.load_state_dict(state)
        self.source.load_state_dict(state["source"])
        if "turns" in state:
            self.turns.load_state_dict(state["turns"])

    # -- reset --
    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDictBase:
        if tensordict is not None and keys.RESET in tensordict.keys():
            slots = tensordict.get(keys.RESET).reshape(-1).nonzero().squeeze(-1).tolist()
        else:
            slots = range(self.batch_size[0])
        return self.refill(slots)

    def refill(self, slots: Iterable[int]) -> TensorDictBase:
        """Load the next prompts into ``slots`` (a partial reset) and return the observation of every slot."""
        return self._loader.refill(self.source, self.turns, list(slots))

    def restart(self, slots: Iterable[int]) -> TensorDictBase:
        """Start the trajectories in ``slots`` over from their prompt, under a new trajectory id (their
        tokens so far are dropped: e.g. in-flight work after a weight update). Returns the observation."""
        return self._loader.restart(self.turns, list(slots))

    # -- trees --
    def fork(self, slot: int, into: Sequence[int], *, at: int | None = None,
             sample_ids: Sequence[int] | None = None) -> list[int]:  # fmt: skip
        """Continue copies of ``slot``'s sequence in the free slots ``into`` (a tree's branches); returns their new
        trajectory ids.

        Each branch gets the slot's tokens up to step ``at`` (a number of generated tokens of its trajectory; default:
        all of them), its lengths, turn, budgets, prompt and group, a new trajectory and episode id and sample id
        ``sample_ids[i]`` (default: the slot's). ``at`` may lie anywhere in the slot's current turn; a slot whose
        episode ended at the last step (done, not yet refilled) forks at an earlier step only. The turn handler's
        :meth:`~tokengym.llm_envs.turns.TurnHandler.fork` copies its per-episode state (an agent program's env
        refuses: a running program cannot be copied). ``at=0`` of a slot past its first turn starts fresh episodes of
        its prompt (the prompt's tokens, turn 0, no per-episode state copied: the turn handler sees new episodes, as
        after a refill): the earlier turns' feedback and the handler's state cannot be rolled back to the prompt. A
        free slot is an idle one, or one whose episode ended at the last step (its trajectory is recorded; a refill
        would replace it anyway). Budgets count per trajectory: a branch may generate ``max_new_tokens`` less its
        ``at`` steps.

        Example:
            >>> from tokengym.testing import tiny_tokenizer
            >>> tok = tiny_tokenizer()
            >>> env = TokenEnv(["1+1="], tok, batch_size=2, max_new_tokens=8, max_length=32)
            >>> td = env.reset()
            >>> td = env.step(td.set("action", torch.tensor([40, 41])))["next"]
            >>> obs = env.vacate([1])  # slot 1 idles: a branch goes there
            >>> env.fork(0, [1])  # trajectory 2 continues a copy of slot 0
            [2]
            >>> env.history(1).tolist() == env.history(0).tolist()
            True
        """
        slots, s = self._slots, self._slots.state
        if isinstance(slot, bool) or not isinstance(slot, int):
            raise TypeError(f"slot must be an int (a slot index), got {slot!r}")
        if not 0 <= slot < self.batch_size[0] or slots.prompts[slot] is None:
            raise ValueError(f"slot {slot} holds no trajectory to fork (an idle slot, or outside the {self.batch_size[0]} "
                             "slots)")  # fmt: skip
        if slot in slots.waiting:
            raise ValueError(f"slot {slot} is waiting for its turn handler; fork it once it is woken")
        into = [int(b) for b in into]
        busy = [b for b in into if b == slot or not 0 <= b < self.batch_size[0] or b in slots.waiting
                or (slots.prompts[b] is not None and not bool(slots.done[b]))]  # fmt: skip
        if busy or len(set(into)) != len(into):
            raise ValueError(f"fork into {into}: slots {busy or into} are not free (each must be an idle slot, or one "
                             "whose episode ended at the last step, once, and not the forked slot); vacate() frees "
                             "slots")  # fmt: skip
        resp, seq, start = (int(s[k][slot]) for k in (keys.RESPONSE_LEN, keys.SEQ_LEN, keys.PROMPT_LEN))
        is_done = bool(slots.done[slot])
        at = resp if at is None else at
        first = resp - (seq - start)  # the step where the slot's current turn began
        is_fresh = type(at) is int and at == 0 and first > 0  # from the prompt, past the first turn
        if not is_fresh and (isinstance(at, bool) or not isinstance(at, int) or not first <= at <= resp - is_done):
            raise ValueError(f"slot {slot} forks at a step in [{first}, {resp - is_done}] (its current turn"
                             f"{'; it ended: before its last step' if is_done else ''}) or at 0 (a fresh episode of "
                             f"its prompt), got at={at!r}")  # fmt: skip
        if is_fresh and overrides(self.turns, "serve"):
            raise ValueError(f"slot {slot} cannot start a fresh episode of its prompt at at=0 (past its first turn): "
                             f"{type(self.turns).__name__} serves each episode's first observation; fork in its "
                             f"current turn, at a step in [{first}, {resp - is_done}]")  # fmt: skip
        samples = [int(s[keys.SAMPLE_ID][slot])] * len(into) if sample_ids is None else [int(i) for i in sample_ids]
        if len(samples) != len(into):
            raise ValueError(f"sample_ids has {len(samples)} ids for {len(into)} slots")
        if not into:
            return []
        self._release(into)
        if is_fresh:
            return self._start_fresh(slot, into, samples)
        parent = self.held_episode(slot)
        trajs = slots.fork(slot, into, seq - (resp - at), at, samples)
        if overrides(self.turns, "fork"):
            for b in into:
                self.turns.fork(parent, self.held_episode(b))
        return trajs

    def _start_fresh(self, slot: int, into: list[int], samples: list[int]) -> list[int]:
        """Fresh episodes of ``slot``'s prompt in ``into`` (new trajectory and episode ids, sample ids ``samples``):
        a fork at step 0 of a slot past its first turn (see :meth:`fork`)."""
        slots, prompt = self._slots, self._slots.prompts[slot]
        first = slots.next_traj
        slots.copy_on_write()
        slots.load([(b, dataclasses.replace(prompt, sample_id=s)) for b, s in zip(into, samples, strict=True)])
        for b in into:
            slots.episodes[b] = slots.new_episode()
        slots.any_done = bool(slots.done.any())
        if overrides(self.turns, "refilled"):
            self.turns.refilled(self._loader.held(range(self.batch_size[0])))
        return list(range(first, first + len(into)))

    def vacate(self, slots: Iterable[int]) -> TensorDictBase:
        """Empty ``slots`` without loading a prompt (they idle until a refill or a fork); returns the observation.
        What they held is dropped: an episode that ended is recorded by then, one in flight is lost."""
        rows = [int(b) for b in slots]
        self._slots.copy_on_write()
        self._release(rows)
        for b in rows:
            self._slots.idle(b, is_done=False)
        self._slots.is_reset = True
        return self._slots.reset_observation()

    def observation(self) -> TensorDictBase:
        """Every slot's observation now (after :meth:`fork`: the branches are live, not done)."""
        return self._slots.reset_observation()

    def _release(self, rows: list[int]) -> None:
        """Tell a listening turn handler that the episodes ``rows`` held are let go."""
        if overrides(self.turns, "release"):
            dropped = [h for b in rows if (h := self.held_episode(b)) is not None]
            if dropped:
                self.turns.release(dropped)

    # -- step --
    def step_and_maybe_reset(self, tensordict: TensorDictBase, *,
                             refill: bool = True) -> tuple[TensorDictBase, TensorDictBase]:  # fmt: skip
        """One token per slot, then refill the slots that finished: ``(tensordict with "next", next obs)``.

        Same contract as TorchRL's ``EnvBase.step_and_maybe_reset`` without its generic spec checks
        (the env validates the action itself), so a collector's per-step cost stays small. ``refill=False``: the
        finished slots stay done (a tree forks from them first; then :meth:`refill` or :meth:`vacate` them).
        """
        nxt = self._step(tensordict)
        tensordict.set(keys.NEXT, nxt)
        if self._slots.any_done and refill:
            try:
                return tensordict, self.refill(self._slots.done_slots)
            except PromptError as err:
                err.step = tensordict  # the step itself succeeded: the caller records it
                raise
        return tensordict, self._slots.observation(*self._slots.flags)  # the step's flags, as "next" holds them

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self._core.step(tensordict, self.turns, self)

    def ended_slots(self, done: torch.Tensor) -> list[int] | None:
        """The slots whose ``done`` flag is set, known without reading it when ``done`` is the ``("next", "done")``
        tensor of this env's last step; ``None`` for any other tensor (a transform's flags: read them)."""
        return self._slots.done_slots if self._slots.flags and done is self._slots.flags[0] else None

    def decode_responses(self, rows: list[torch.Tensor]) -> list[str]:
        """The text of response id rows, as ``tokenizer.batch_decode(rows, skip_special_tokens=True)`` gives it
        (vectorized for byte-level BPE tokenizers)."""
        if self._decoder is None:
            self._decoder = ResponseDecoder(self.tokenizer)
        return self._decoder(rows)

    # -- whole waves --
    def wave_request(self) -> WaveRequest:
        """The live slots a generation backend should continue until their turn ends (see :meth:`unroll`).

        Done slots must be refilled first (:meth:`refill`); an exhausted source gives an empty request.
        """
        return self._core.wave_request(self, self.eos_token_ids, self.stop_strings)

    def unroll(self, request: WaveRequest, result: WaveResult, *, width: int | None = None) -> TensorDictBase:
        """The steps (B, T) that stepping the env through ``result``'s tokens gives, built at once.

        Applies the env's own termination (EOS, stop strings, ``max_new_tokens``, ``max_length``;
        tokens past a row's end are dropped, and a row the backend ended without any of these is
        truncated) and rewards (one ``reward_fn`` call for the wave), writes the tokens into the
        buffer and leaves every slot of the wave at its turn's end (done, or continuing to its next
        turn in a multi-turn env). Slots outside the request idle (``active`` False). The result holds
        the observation, ``action``, ``action_log_prob`` (``raw_log_prob`` when given),
        ``policy_version`` and ``("next", ...)`` of every step, zero past each row's end; ``width`` pads it
        to at least that many steps (e.g. a recorder's fixed batch width).
        """
        return self._core.unroll(request, result, self.turns, self, width)

    def unroll_cells(self, request: WaveRequest, result: WaveResult) -> tuple[TensorDictBase, torch.Tensor]:
        """:meth:`unroll` without the padding: ``(steps, counts)``, the wave's real steps as a TensorDict (n,), slot
        by slot (each slot's steps in order), and each slot's number of steps (B,) (0 for slots outside the
        request). ``steps`` equals ``unroll(...)[unroll(...)["active"]]`` key for key; it is built over the real
        steps only, so a wave of turns of very different lengths costs what its tokens cost (a collector of
        multi-turn trajectories asks for it)."""
        return self._core.unroll(request, result, self.turns, self, None, cells=True)

    def close(self, *, raise_if_closed: bool = True) -> None:
        """Close the env and its turn handler (external episodes ended, sessions closed)."""
        self.turns.close()
        super().close(raise_if_closed=raise_if_closed)


def _describe(handler: TurnHandler) -> str:
    name, what = type(handler).__name__, handler.describe()
    return f"{name}()" if what == name else f"{name}({what})"


def _show_signature(cls) -> None:
    """Give ``help(cls)`` and IDEs the constructor's arguments: TorchRL's env metaclass wraps the call in
    ``(*args, **kwargs)``."""
    sig = inspect.signature(cls.__init__)
    cls.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])


_show_signature(TokenEnv)
