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

The env is a plain :class:`~tokengym.llm_envs.TokenEnv`: its prompt source draws the tasks (order, groups, shards,
resume) and its turn handler, :class:`AgentTurns`, uses only the turn-handler protocol: it starts a program and
renders its first call when a slot needs an episode (``serve``), answers calls and fails an episode with
``Turn.failed``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

from tokengym.llm_envs._env_checks import require_tokenizer
from tokengym.llm_envs.agents.chat_app import RequestRefused
from tokengym.llm_envs.agents.messages import assistant_message, chat_reply, first_difference
from tokengym.llm_envs.agents.runner import AgentRunner, Episode
from tokengym.llm_envs.agents.tool_calls import ParsedTurn, ToolCallParser, tool_parser
from tokengym.llm_envs.errors import EpisodeError
from tokengym.llm_envs.prompts import Prompt, PromptSource
from tokengym.llm_envs.token_env import TokenEnv
from tokengym.llm_envs.turns.protocol import EnvFacts, FinishedTurns, HeldEpisode, Turn, TurnHandler
from tokengym.llm_envs.turns.render import ChatRenderer

__all__ = ["AgentError", "AgentTurns", "make_agent_env", "task_prompts"]

EPISODE, TASK_INDEX = "episode", "task_index"  # prompt-metadata fields


class AgentError(EpisodeError):
    """An agent episode failed (the program raised, ran past its time limit, or returned no usable reward);
    only that episode ended, with reward 0."""

    what = "agent episode(s) failed and ended with reward 0"


def task_prompts(tasks: Sequence, tokenizer, **options) -> PromptSource:
    """The prompt source of agent tasks: it draws task indices (``group_size``, ``shuffle``, ``seed``, ``epochs``,
    sharding and resume as for any :class:`~tokengym.llm_envs.prompts.PromptSource`); :meth:`AgentTurns.serve`
    makes each draw an episode."""
    if isinstance(tasks, str | bytes | Mapping) or not isinstance(tasks, Sequence) or not len(tasks):
        raise TypeError(f"tasks must be a non-empty sequence of task objects (a list), got {type(tasks).__name__}")
    return PromptSource([{"input_ids": [0], TASK_INDEX: i} for i in range(len(tasks))], tokenizer, **options)


class AgentTurns(TurnHandler):
    """The turn handler of an agent env: starts a program per episode and renders its first call (:meth:`serve`),
    answers each finished turn's chat call, then waits for the program's next move (its next call continues the
    episode, its return ends it with that reward, an error fails it).

    Args:
        runner: runs the programs.
        tasks: the task objects (a draw's ``task_index`` picks one).
        parser: the tool-call parser (``None``: plain text replies).
        reward_fn: ``reward_fn(messages, task) -> float`` when the program returns ``None``.
        chat_template_kwargs: extra arguments of ``tokenizer.apply_chat_template`` for the calls.
    """

    name = "the agent env"

    wants_log_probs = True  # replies carry each token's log-prob when the agent asks (logprobs=True)

    def __init__(self, runner: AgentRunner, tasks: Sequence, *, parser: ToolCallParser | None,
                 reward_fn: Callable | None, chat_template_kwargs: dict | None = None) -> None:  # fmt: skip
        self.runner, self.tasks, self.parser, self.reward_fn = runner, tasks, parser, reward_fn
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.renderer: ChatRenderer | None = None
        self.tallies = {"agent_episodes": 0, "agent_errors": 0, "malformed_tool_calls": 0, "refused_calls": 0}
        self.continuing: set[int] = set()  # split episodes whose next trajectory is not in a slot yet
        self.broken: dict[int, AgentError] = {}  # restarted episodes whose program could not start over
        self.group_first: torch.Tensor | None = None  # the first call's ids of the group being drawn

    def bind(self, facts: EnvFacts) -> None:
        super().bind(facts)
        self.renderer = ChatRenderer(facts.tokenizer)

    @property
    def may_split(self) -> bool:
        """True with ``on_rewrite="split"``: a call that rewrites the history starts a new trajectory."""
        return self.runner.on_rewrite == "split"

    @property
    def temperature(self) -> float | None:
        """The sampling temperature the env tells its programs (``make_agent_env(..., temperature=)``); a collector
        refuses a policy sampling at another."""
        return self.runner.temperature

    def metrics(self) -> dict[str, float]:
        """Programs started, episodes failed, malformed tool calls (answered as text), calls refused at a limit,
        history rewrites refused and split."""
        return {**self.tallies, **self.runner.counts}

    def describe(self) -> str:
        return f"agent={self.runner.name}, transport={self.runner.transport!r}"

    def error(self, message: str, cause: BaseException | None = None) -> AgentError:
        """An episode's failure, counted (``agent_errors``)."""
        self.tallies["agent_errors"] += 1
        err = AgentError(message)
        err.__cause__ = cause
        return err

    # -- episodes start: the first call is the prompt --
    def serve(self, draw: Prompt, episode: int) -> Prompt:
        """Start the program on the draw's task as ``episode`` and render its first chat call as the prompt."""
        task = self.tasks[draw.metadata[TASK_INDEX]]
        ep = self.runner.start(episode, task, draw.index)
        self.tallies["agent_episodes"] += 1
        kind, value = ep.next_move()
        if kind != "call":
            self.runner.end(ep.id)
            what = f"returned {value!r:.60}" if kind == "return" else f"raised {type(value).__name__}: {value}"
            raise self.error(f"agent {self.runner.name} {what} before its first chat call (episode {ep.id}, task "
                             f"{draw.index}); the slot takes the next episode", value if kind == "error" else None)  # fmt: skip
        tools = value.get("tools")
        ids = self.render(value["messages"], tools)
        limit = self.facts.max_prompt_length
        if len(ids) > limit:
            ep.answer(RequestRefused(f"the first request renders to {len(ids)} tokens, more than the {limit} a prompt "
                                     "may have", code="context_length_exceeded"))  # fmt: skip
            self.runner.end(ep.id)
            raise self.error(f"agent episode {ep.id} (task {draw.index}): its first call renders to {len(ids)} "
                             f"tokens, more than the env's prompt limit {limit}; raise max_length")  # fmt: skip
        self.check_group_prompt(draw, ids, ep)
        ep.messages, ep.tools, ep.wants_log_probs = [dict(m) for m in value["messages"]], tools, bool(value.get("logprobs"))
        meta = {TASK_INDEX: draw.index, EPISODE: ep.id, **(dict(task) if isinstance(task, Mapping) else {})}
        text = self.facts.tokenizer.decode(ids)
        return Prompt(ids, text, meta, draw.index, draw.group_id, draw.sample_id, list(ep.messages))

    def render(self, messages: list, tools) -> torch.Tensor:
        """The ids of a call's whole conversation, as the chat template writes it, with the generation prompt."""
        tok = self.facts.tokenizer
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                       **self.chat_template_kwargs)  # fmt: skip
        return torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)

    def check_group_prompt(self, draw: Prompt, ids: torch.Tensor, ep: Episode) -> None:
        """The episodes of one group (one task draw) must open with the same first call: a batch's prompt table
        holds one prompt per group, and a group's advantages compare answers to one prompt."""
        if draw.sample_id == 0:
            self.group_first = ids
        elif self.group_first is not None and not torch.equal(ids, self.group_first):
            ep.answer(RequestRefused("this episode's first call differs from its group's first episode's",
                                     code="group_prompt_differs"))  # fmt: skip
            self.runner.end(ep.id)
            raise self.error(f"agent {self.runner.name}: episode {ep.id} (task {draw.index}, sample {draw.sample_id}) "
                             f"opened with another first call than sample 0 of its group; the group_size episodes of "
                             "a task must open with the same messages (make the first call depend on the task only, "
                             "e.g. no random system prompt)")  # fmt: skip

    # -- turns --
    def end_turns(self, turns: FinishedTurns) -> list[Turn]:
        episodes = [self.runner.episodes.get(e) for e in turns.episodes]
        for i, ep in enumerate(episodes):  # answer every call first: the programs go on together
            if ep is not None and turns.episodes[i] not in self.broken:
                ep.answer(self.reply(turns, i, ep))
        return [self.next_turn(turns, i, ep) for i, ep in enumerate(episodes)]

    def reply(self, turns: FinishedTurns, i: int, ep: Episode) -> dict:
        """The chat completion of finished turn ``i``, appended to the episode's conversation."""
        ids = turns.response_ids[i]
        ended = turns.ended[i]
        body = ids[:-1] if ended and len(ids) and int(ids[-1]) in self.facts.eos_token_ids else ids
        tok = self.facts.tokenizer
        text = tok.decode(body, skip_special_tokens=True)
        parsed = self.parser.parse(text) if self.parser is not None else ParsedTurn(text)
        if parsed.malformed is not None:
            self.tallies["malformed_tool_calls"] += 1
        finish = "length" if not ended else "tool_calls" if parsed.tool_calls else "stop"
        message = assistant_message(parsed.content, parsed.tool_calls)
        ep.messages.append(message)
        history = len(turns.history(i))
        log_probs = turns.log_probs(i) if ep.wants_log_probs else None
        tokens = None if log_probs is None else tok.convert_ids_to_tokens(ids.tolist())
        return chat_reply(self.runner.model, message, finish, prompt_tokens=history - len(ids), token_ids=ids.tolist(),
                          log_probs=log_probs, tokens=tokens)  # fmt: skip

    def next_turn(self, turns: FinishedTurns, i: int, ep: Episode | None) -> Turn:
        """Wait for the program's next move after turn ``i``: a call (the episode goes on), a return or an error."""
        episode = turns.episodes[i]
        if episode in self.broken:
            self.runner.end(episode)
            return Turn.failed(self.broken.pop(episode))
        if ep is None:
            return Turn.failed(self.error(f"agent episode {episode} is not running (ended, or the env was restored "
                                          f"from a checkpoint); {turns.describe(i)} ended with reward 0"))  # fmt: skip
        while True:
            kind, value = ep.next_move()
            if kind == "return":
                self.runner.end(ep.id)
                return self.reward(ep, value)
            if kind == "error":
                self.runner.end(ep.id)
                return Turn.failed(self.error(f"agent {self.runner.name} failed in episode {ep.id} (task "
                                              f"{ep.task_index}) after turn {turns.turns[i]}: {type(value).__name__}: "
                                              f"{value}; that episode ended with reward 0, the others go on", value))  # fmt: skip
            if self.may_split and first_difference(ep.messages, value["messages"]) is not None:
                turn = self.split(ep, value)
                if turn is not None:
                    return turn
                continue
            new = value["messages"][len(ep.messages) :]
            ids = None if turns.is_final[i] else self.renderer.feedback_ids(turns.response_ids[i], new)
            limit = self.facts.max_length
            if ids is None or len(turns.history(i)) + len(ids) + 1 > limit:
                self.tallies["refused_calls"] += 1
                why = ("the episode reached its turn or token limit (max_turns / max_new_tokens / the context)"
                       if ids is None else f"the conversation would outgrow the context ({limit} tokens)")  # fmt: skip
                ep.answer(RequestRefused(f"{why}: the env ends episode {ep.id} here; return the reward",
                                         code="context_length_exceeded"))  # fmt: skip
                continue
            ep.messages, ep.wants_log_probs = [dict(m) for m in value["messages"]], bool(value.get("logprobs"))
            return Turn(0.0, feedback=ids)

    def split(self, ep: Episode, request: dict) -> Turn | None:
        """A call that rewrites the history: this trajectory ends (a part of the episode) and the episode goes on in
        a new one, whose prompt is the call's whole conversation rendered (``None``: it does not fit, refused)."""
        ids = self.render(request["messages"], request.get("tools"))
        limit = self.facts.max_prompt_length
        if len(ids) > limit:
            self.tallies["refused_calls"] += 1
            ep.answer(RequestRefused(f"the rewritten conversation renders to {len(ids)} tokens, more than the "
                                     f"{limit} a trajectory's prompt may have", code="context_length_exceeded"))  # fmt: skip
            return None
        self.runner.counts["history_splits"] += 1
        self.continuing.add(ep.id)
        ep.messages, ep.wants_log_probs = [dict(m) for m in request["messages"]], bool(request.get("logprobs"))
        return Turn(0.0, feedback=ids, new_trajectory=True)

    def reward(self, ep: Episode, value) -> Turn:
        """The episode's last turn: the program's return value (or ``reward_fn``'s) as its reward."""
        if value is None and self.reward_fn is not None:
            value = self.reward_fn(list(ep.messages), ep.task)
        try:
            reward = float(value)
        except (TypeError, ValueError):
            reward = math.nan
        if not math.isfinite(reward):
            return Turn.failed(self.error(f"agent {self.runner.name} returned {value!r:.60} in episode {ep.id} (task "
                                          f"{ep.task_index}); return a finite number (the reward), or pass "
                                          "reward_fn=; that episode ended with reward 0"))  # fmt: skip
        return Turn(reward, done=True)

    # -- lifecycle --
    def release(self, held: list[HeldEpisode]) -> None:
        for h in held:
            if h.episode not in self.continuing:  # a split episode goes on in a new trajectory
                self.runner.end(h.episode)

    def refilled(self, held: list[HeldEpisode]) -> None:
        kept = {h.episode for h in held}
        self.continuing -= kept
        for episode in set(self.runner.episodes) - kept - self.continuing:
            self.runner.end(episode)

    def restart(self, dropped: list[HeldEpisode], restarted: list[HeldEpisode]) -> None:
        for h in restarted:  # the program starts over; its first call must be the slot's prompt again
            p = h.prompt
            draw = Prompt(p.ids, p.text, {TASK_INDEX: p.metadata[TASK_INDEX]}, p.index, p.group_id, p.sample_id)
            try:
                again = self.serve(draw, h.episode)
            except AgentError as err:
                self.broken[h.episode] = err
                continue
            if not torch.equal(again.ids, p.ids):
                self.runner.end(h.episode)
                self.broken[h.episode] = self.error(f"agent episode {h.episode} started over with another first call; "
                                                    "it ended (restart needs a program whose first call depends only "
                                                    "on its task)")  # fmt: skip

    def fork(self, parent: HeldEpisode, child: HeldEpisode) -> None:
        raise ValueError("an agent program cannot be forked (its conversation runs in user code); fork slots of "
                         "other envs")

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
        time_limit: seconds of an episode program's own time (its wall time less the time its chat calls wait for
            the model); past it the episode ends with an :class:`AgentError`.
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
    source = task_prompts(tasks, tokenizer, group_size=group_size, shuffle=shuffle, seed=seed, epochs=epochs,
                          chat_template_kwargs=chat_template_kwargs)  # fmt: skip
    turns = AgentTurns(runner, tasks, parser=parser, reward_fn=reward_fn, chat_template_kwargs=chat_template_kwargs)
    return TokenEnv(source, tokenizer, turns=turns, max_turns=max_turns, **env_kwargs)
