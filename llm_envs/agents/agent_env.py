"""Agent programs as token environments: ``make_agent_env(agent, tasks, tokenizer)``.

An agent is user code written against the OpenAI chat API, ``async def agent(client, task) -> reward``. The
env runs one episode per slot (``group_size`` episodes per task, a GRPO group), B at once. Every chat call
is a turn: its first call's messages (and tools, rendered by the chat template) are the slot's prompt; a
later call must repeat the conversation so far and add to it, and only what it adds (tool results, the next
user message) and the generation prompt are rendered and written after the model's own tokens, which are
never re-tokenized. The policy generates the turn through the collector's source (stepping, waves, vLLM, a
server fleet); the reply carries the text, the parsed ``tool_calls``, ``finish_reason`` (``"length"`` when a
limit cut the turn), ``usage`` and the turn's token ids (``choices[0].token_ids``). The reward is the
program's return value (or ``reward_fn(messages, task)``); a program that raises or runs past
``time_limit`` ends its episode with reward 0 and an :class:`AgentError` raised at the slot's refill
(through the collector's ``PromptError`` path: nothing else is lost).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping, Sequence

import torch

from tokengym.llm_envs._env_checks import require_tokenizer
from tokengym.llm_envs.agents.chat_app import RequestRefused
from tokengym.llm_envs.agents.messages import assistant_message, chat_reply, first_difference
from tokengym.llm_envs.agents.runner import AgentRunner, Episode
from tokengym.llm_envs.agents.tool_calls import ParsedTurn, ToolCallParser, tool_parser
from tokengym.llm_envs.errors import PromptError
from tokengym.llm_envs.prompts import Prompt, PromptSource
from tokengym.llm_envs.token_env import TokenEnv
from tokengym.llm_envs.turns.protocol import FinishedTurns, Turn, TurnHandler
from tokengym.llm_envs.turns.render import ChatRenderer

__all__ = ["AgentError", "AgentSource", "AgentTurns", "make_agent_env"]

EPISODE, TASK_INDEX = "episode", "task_index"  # prompt-metadata fields


class AgentError(PromptError):
    """An agent episode failed (the program raised, ran past its time limit, or returned no usable reward);
    only that episode ended, with reward 0."""

    what = "agent episode(s) failed and ended with reward 0"


class AgentSource(PromptSource):
    """Prompts from agent programs: each draw of a task starts one episode and waits for its first chat call,
    whose messages (and tools) rendered by the chat template are the prompt.

    Tasks are drawn in order (``shuffle``, ``epochs``, ``group_size``, sharding and resume as for any
    :class:`~tokengym.llm_envs.prompts.PromptSource`); the prompt's metadata holds ``task_index``, ``episode``
    and, for a mapping task, its fields.
    """

    def __init__(self, runner: AgentRunner, tasks: Sequence, tokenizer, *, group_size: int = 1,
                 shuffle: bool = False, seed: int = 0, epochs: int | None = None,
                 chat_template_kwargs: dict | None = None) -> None:  # fmt: skip
        if isinstance(tasks, str | bytes | Mapping) or not isinstance(tasks, Sequence) or not len(tasks):
            raise TypeError(f"tasks must be a non-empty sequence of task objects (a list), got {type(tasks).__name__}")
        # the base class draws task indices (order, groups, shards, resume); the prompts come from the programs
        super().__init__([{"input_ids": [0], TASK_INDEX: i} for i in range(len(tasks))], tokenizer,
                         group_size=group_size, shuffle=shuffle, seed=seed, epochs=epochs,
                         chat_template_kwargs=chat_template_kwargs)  # fmt: skip
        self.runner, self.tasks = runner, tasks
        self.failures: collections.deque[AgentError] = collections.deque()
        self.group_first: torch.Tensor | None = None  # the first call's ids of the group being drawn
        self.continuations: collections.deque[Prompt] = collections.deque()  # split episodes' next trajectories
        self.counts.update(agent_episodes=0, agent_errors=0)

    def episode_id(self, draw: Prompt) -> int:
        """The episode id of a draw: unique per group and sample."""
        return draw.group_id * self.group_size + draw.sample_id

    def next(self) -> Prompt | None:
        """The first call of a newly started episode as a prompt; first raises the errors of failed episodes."""
        if self.failures:
            raise self.failures.popleft()
        if self.continuations:  # a split episode goes on in a new trajectory
            return self.continuations.popleft()
        draw = super().next()
        return None if draw is None else self.first_call(draw)

    def first_call(self, draw: Prompt) -> Prompt:
        """Start the episode of ``draw`` and render its first chat call."""
        task = self.tasks[draw.index]
        ep = self.runner.start(self.episode_id(draw), task, draw.index)
        self.counts["agent_episodes"] += 1
        kind, value = ep.next_move()
        if kind != "call":
            self.runner.end(ep.id)
            self.counts["agent_errors"] += 1
            what = f"returned {value!r:.60}" if kind == "return" else f"raised {type(value).__name__}: {value}"
            raise AgentError(f"agent {self.runner.name} {what} before its first chat call (episode {ep.id}, task "
                             f"{draw.index}); the slot takes the next episode") from (value if kind == "error" else None)  # fmt: skip
        tools = value.get("tools")
        ids = self.render(value["messages"], tools)
        text = self.tokenizer.decode(ids)
        limit = self.max_prompt_length
        if limit is not None and len(ids) > limit:
            ep.answer(RequestRefused(f"the first request renders to {len(ids)} tokens, more than the {limit} a prompt "
                                     "may have", code="context_length_exceeded"))  # fmt: skip
            self.runner.end(ep.id)
            raise AgentError(f"agent episode {ep.id} (task {draw.index}): its first call renders to {len(ids)} tokens, "
                             f"more than the env's prompt limit {limit}; raise max_length")  # fmt: skip
        self.check_group_prompt(draw, ids, ep)
        ep.messages, ep.tools, ep.wants_log_probs = [dict(m) for m in value["messages"]], tools, bool(value.get("logprobs"))
        meta = {TASK_INDEX: draw.index, EPISODE: ep.id, **(dict(task) if isinstance(task, Mapping) else {})}
        return Prompt(ids, text, meta, draw.index, draw.group_id, draw.sample_id, list(ep.messages))

    def render(self, messages: list, tools) -> torch.Tensor:
        """The ids of a call's whole conversation, as the chat template writes it, with the generation prompt."""
        text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                                  **self.chat_template_kwargs)  # fmt: skip
        return torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)

    def check_group_prompt(self, draw: Prompt, ids: torch.Tensor, ep: Episode) -> None:
        """The episodes of one group (one task draw) must open with the same first call: a batch's prompt table
        holds one prompt per group, and a group's advantages compare answers to one prompt."""
        if draw.sample_id == 0:
            self.group_first = ids
        elif self.group_first is not None and not torch.equal(ids, self.group_first):
            ep.answer(RequestRefused("this episode's first call differs from its group's first episode's",
                                     code="group_prompt_differs"))  # fmt: skip
            self.runner.end(ep.id)
            self.counts["agent_errors"] += 1
            raise AgentError(f"agent {self.runner.name}: episode {ep.id} (task {draw.index}, sample {draw.sample_id}) "
                             f"opened with another first call than sample 0 of its group; the group_size episodes of a "
                             "task must open with the same messages (make the first call depend on the task only, "
                             "e.g. no random system prompt)")  # fmt: skip

    def fail(self, message: str, cause: BaseException | None = None) -> None:
        """Queue an episode's failure, raised at the next draw (the slot's refill)."""
        err = AgentError(message)
        err.__cause__ = cause
        self.counts["agent_errors"] += 1
        self.failures.append(err)


class AgentTurns(TurnHandler):
    """The turn handler of an agent env: answers each finished turn's chat call, then waits for the program's
    next move (its next call continues the episode, its return ends it with that reward).

    Args:
        source: the env's :class:`AgentSource`.
        parser: the tool-call parser (``None``: plain text replies).
        reward_fn: ``reward_fn(messages, task) -> float`` when the program returns ``None``.
        eos_token_ids: ids that end a turn (left out of the reply's text).
        max_length: the env's capacity (a call whose messages do not fit is refused, the episode ends).
    """

    name = "the agent env"

    wants_log_probs = True  # replies carry each token's log-prob when the agent asks (logprobs=True)

    @property
    def may_split(self) -> bool:
        """True with ``on_rewrite="split"``: a call that rewrites the history starts a new trajectory."""
        return self.runner.on_rewrite == "split"

    def __init__(self, source: AgentSource, *, parser: ToolCallParser | None, reward_fn: Callable | None,
                 eos_token_ids: set[int] = frozenset(), max_length: int | None = None) -> None:  # fmt: skip
        self.source, self.runner, self.parser, self.reward_fn = source, source.runner, parser, reward_fn
        self.eos_token_ids, self.max_length = set(eos_token_ids), max_length
        self.renderer = ChatRenderer(source.tokenizer)
        self.tallies = {"malformed_tool_calls": 0, "refused_calls": 0}
        self.continuing: set[int] = set()  # split episodes whose next trajectory is not in a slot yet

    @property
    def temperature(self) -> float | None:
        """The sampling temperature the env tells its programs (``make_agent_env(..., temperature=)``); a collector
        refuses a policy sampling at another."""
        return self.runner.temperature

    @property
    def counts(self) -> dict[str, int]:
        """Malformed tool calls (answered as text), calls refused at a limit, history rewrites refused."""
        return {**self.tallies, **self.runner.counts}

    def describe(self) -> str:
        return f"agent={self.runner.name}, transport={self.runner.transport!r}"

    def end_turns(self, turns: FinishedTurns) -> list[Turn]:
        episodes = [self.runner.episodes.get(int(m[EPISODE])) for m in turns.metadata]
        for i, ep in enumerate(episodes):  # answer every call first: the programs go on together
            if ep is not None:
                ep.answer(self.reply(turns, i, ep))
        return [self.next_turn(turns, i, ep) for i, ep in enumerate(episodes)]

    def reply(self, turns: FinishedTurns, i: int, ep: Episode) -> dict:
        """The chat completion of finished turn ``i``, appended to the episode's conversation."""
        ids = turns.response_ids[i]
        ended = turns.ended[i]
        body = ids[:-1] if ended and len(ids) and int(ids[-1]) in self.eos_token_ids else ids
        text = self.source.tokenizer.decode(body, skip_special_tokens=True)
        parsed = self.parser.parse(text) if self.parser is not None else ParsedTurn(text)
        if parsed.malformed is not None:
            self.tallies["malformed_tool_calls"] += 1
        finish = "length" if not ended else "tool_calls" if parsed.tool_calls else "stop"
        message = assistant_message(parsed.content, parsed.tool_calls)
        ep.messages.append(message)
        history = len(turns.history(i))
        log_probs = turns.log_probs(i) if ep.wants_log_probs else None
        tokens = None if log_probs is None else self.source.tokenizer.convert_ids_to_tokens(ids.tolist())
        return chat_reply(self.runner.model, message, finish, prompt_tokens=history - len(ids), token_ids=ids.tolist(),
                          log_probs=log_probs, tokens=tokens)  # fmt: skip

    def next_turn(self, turns: FinishedTurns, i: int, ep: Episode | None) -> Turn:
        """Wait for the program's next move after turn ``i``: a call (the episode goes on), a return or an error."""
        if ep is None:
            self.source.fail(f"agent episode {turns.metadata[i].get(EPISODE)} is not running (ended, or the env was "
                             f"restored from a checkpoint); {turns.describe(i)} ended with reward 0")  # fmt: skip
            return Turn(0.0, done=True)
        while True:
            kind, value = ep.next_move()
            if kind == "return":
                self.runner.end(ep.id)
                return Turn(self.reward(ep, value, turns.turns[i]), done=True)
            if kind == "error":
                self.runner.end(ep.id)
                self.source.fail(f"agent {self.runner.name} failed in episode {ep.id} (task {ep.task_index}) after "
                                 f"turn {turns.turns[i]}: {type(value).__name__}: {value}; that episode ended with "
                                 "reward 0, the others go on", value)  # fmt: skip
                return Turn(0.0, done=True)
            if self.may_split and first_difference(ep.messages, value["messages"]) is not None:
                turn = self.split(ep, value, turns.prompts[i])
                if turn is not None:
                    return turn
                continue
            new = value["messages"][len(ep.messages) :]
            ids = None if turns.is_final[i] else self.renderer.feedback_ids(turns.response_ids[i], new)
            if ids is None or (self.max_length is not None and len(turns.history(i)) + len(ids) + 1 > self.max_length):
                self.tallies["refused_calls"] += 1
                why = ("the episode reached its turn or token limit (max_turns / max_new_tokens / the context)"
                       if ids is None else f"the conversation would outgrow the context ({self.max_length} tokens)")  # fmt: skip
                ep.answer(RequestRefused(f"{why}: the env ends episode {ep.id} here; return the reward",
                                         code="context_length_exceeded"))  # fmt: skip
                continue
            ep.messages, ep.wants_log_probs = [dict(m) for m in value["messages"]], bool(value.get("logprobs"))
            return Turn(0.0, feedback=ids)

    def split(self, ep: Episode, request: dict, prompt: Prompt) -> Turn | None:
        """A call that rewrites the history: this trajectory ends (a part of the episode) and the episode goes on in
        a new one, whose prompt is the call's whole conversation rendered (``None``: it does not fit, refused)."""
        ids = self.source.render(request["messages"], request.get("tools"))
        limit = self.source.max_prompt_length
        if limit is not None and len(ids) > limit:
            self.tallies["refused_calls"] += 1
            ep.answer(RequestRefused(f"the rewritten conversation renders to {len(ids)} tokens, more than the "
                                     f"{limit} a trajectory's prompt may have", code="context_length_exceeded"))  # fmt: skip
            return None
        self.runner.counts["history_splits"] += 1
        self.continuing.add(ep.id)
        ep.messages, ep.wants_log_probs = [dict(m) for m in request["messages"]], bool(request.get("logprobs"))
        self.source.continuations.append(Prompt(ids, self.source.tokenizer.decode(ids), prompt.metadata, prompt.index,
                                                prompt.group_id, prompt.sample_id, list(ep.messages)))  # fmt: skip
        return Turn(0.0, new_trajectory=True)

    def reward(self, ep: Episode, value, turn: int) -> float:
        if value is None and self.reward_fn is not None:
            value = self.reward_fn(list(ep.messages), ep.task)
        try:
            reward = float(value)
        except (TypeError, ValueError):
            reward = math.nan
        if not math.isfinite(reward):
            self.source.fail(f"agent {self.runner.name} returned {value!r:.60} in episode {ep.id} (task "
                             f"{ep.task_index}); return a finite number (the reward), or pass reward_fn=; that "
                             "episode ended with reward 0")  # fmt: skip
            return 0.0
        return reward

    def release(self, prompts: list[Prompt]) -> None:
        for prompt in prompts:
            if int(prompt.metadata[EPISODE]) not in self.continuing:  # a split episode goes on in a new trajectory
                self.runner.end(int(prompt.metadata[EPISODE]))

    def refilled(self, held: list[Prompt]) -> None:
        kept = {int(p.metadata[EPISODE]) for p in held}
        self.continuing -= kept
        for episode_id in set(self.runner.episodes) - kept - self.continuing:
            self.runner.end(episode_id)

    def restart(self, prompts: list[Prompt]) -> None:
        for prompt in prompts:  # the program starts over; its first call must be the slot's prompt again
            draw = Prompt(prompt.ids, prompt.text, {}, prompt.index, prompt.group_id, prompt.sample_id)
            try:
                again = self.source.first_call(draw)
            except AgentError as err:
                self.source.failures.append(err)
                continue
            if not torch.equal(again.ids, prompt.ids):
                self.runner.end(int(prompt.metadata[EPISODE]))
                self.source.fail(f"agent episode {prompt.metadata[EPISODE]} started over with another first call; "
                                 "it ended (restart needs a program whose first call depends only on its task)")  # fmt: skip

    def close(self) -> None:
        self.runner.close()


def make_agent_env(agent: Callable, tasks: Sequence, tokenizer, *, tool_parser_name: str | ToolCallParser | None = "hermes",
                   reward_fn: Callable | None = None, time_limit: float | None = None, transport: str = "asgi",
                   temperature: float | None = 1.0, max_turns: int = 8, group_size: int = 1, shuffle: bool = False,
                   seed: int = 0, epochs: int | None = None, chat_template_kwargs: dict | None = None,
                   on_rewrite: str = "error", **env_kwargs) -> TokenEnv:  # fmt: skip
    """A :class:`~tokengym.llm_envs.TokenEnv` whose episodes are runs of ``agent`` on ``tasks`` (see the module).

    Args:
        agent: ``async def agent(client, task) -> float``: ``client`` is an ``openai.AsyncOpenAI`` answered by the
            env (a plain function gets an ``openai.OpenAI``; it needs ``transport="http"``).
        tasks: the task objects (any Python objects; a mapping's fields travel in the prompt metadata).
        tokenizer: the policy's tokenizer, with a chat template (rendering ``tools=`` for tool use).
        tool_parser_name: the model's tool-call format (``"hermes"`` / ``"qwen2.5"``), a parser, or ``None``.
        reward_fn: ``reward_fn(messages, task) -> float`` used when the program returns ``None``.
        time_limit: seconds an episode's program may run; past it the episode ends with an :class:`AgentError`.
        transport: ``"asgi"`` (in-process, default) or ``"http"`` (127.0.0.1, ``env.turns.runner.base_url``).
        temperature: the collector's sampling temperature: a call asking for another one is refused
            (``None``: not checked).
        max_turns: chat calls per episode.
        group_size: episodes per task (a GRPO group shares ``group_id``).
        shuffle, seed, epochs, chat_template_kwargs: the task order and the first call's rendering, as for a
            :class:`~tokengym.llm_envs.prompts.PromptSource`.
        on_rewrite: a call that does not continue its episode (the program dropped or edited earlier messages):
            ``"error"`` refuses it naming the first differing message; ``"split"`` ends the trajectory there and
            goes on in a new one from the call's whole conversation rendered, each part carrying the episode's reward
            and ``group_id`` / ``sample_id`` (a TRAJECTORIES collector releases the parts with the episode's last
            trajectory; :class:`~tokengym.transforms.GroupAdvantage` counts an episode once). Counted in
            ``history_rewrites`` / ``history_splits``.
        **env_kwargs: the other :class:`~tokengym.llm_envs.TokenEnv` arguments (``batch_size``, ``max_new_tokens``,
            ``max_turn_tokens``, ``max_length``, ``stop_strings``, ``model_config``...).

    Example:
        >>> from tokengym.testing import tiny_tokenizer
        >>> async def agent(client, task):
        ...     reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task}])
        ...     return float(len(reply.choices[0].message.content) > 0)
        >>> env = make_agent_env(agent, ["1+1=", "2+2="], tiny_tokenizer(), batch_size=2, max_new_tokens=8, max_length=64)
        >>> td = env.reset()
        >>> td = env.step(td.set("action", torch.tensor([40, env.tokenizer.eos_token_id])))
        >>> td["next", "done"].squeeze(-1).tolist(), td["next", "reward"].squeeze(-1).tolist()
        ([False, True], [0.0, 0.0])
        >>> env.close()
    """
    require_tokenizer("make_agent_env", tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("make_agent_env needs a tokenizer with a chat_template (the calls are chat messages); set "
                         "tokenizer.chat_template")  # fmt: skip
    parser = tool_parser(tool_parser_name)
    if on_rewrite not in ("error", "split"):
        raise ValueError(f"on_rewrite must be 'error' or 'split', got {on_rewrite!r}")
    runner = AgentRunner(agent, transport=transport, time_limit=time_limit, temperature=temperature, on_rewrite=on_rewrite,
                         max_turn_tokens=env_kwargs.get("max_turn_tokens"),
                         stop_strings=tuple(env_kwargs.get("stop_strings", ())))  # fmt: skip
    source = AgentSource(runner, tasks, tokenizer, group_size=group_size, shuffle=shuffle, seed=seed, epochs=epochs,
                         chat_template_kwargs=chat_template_kwargs)  # fmt: skip
    turns = AgentTurns(source, parser=parser, reward_fn=reward_fn)
    env = TokenEnv(source, tokenizer, turns=turns, max_turns=max_turns, **env_kwargs)
    turns.eos_token_ids, turns.max_length = set(env.eos_token_ids), env.max_length
    return env
