"""MultiTurnTokenEnv: a :class:`TokenEnv` whose turns a ``turn_fn`` answers (feedback turns, in the slot).

A function returning a ``TokenEnv`` (a subclass before this release): the env's behaviour is its turn handler's,
:class:`~tokengym.llm_envs.turns.FeedbackTurns` (``env.turns.turn_fn`` is the function).
"""

from __future__ import annotations

from tokengym.llm_envs.token_env import TokenEnv
from tokengym.llm_envs.turns.feedback import FeedbackTurns, TurnFn
from tokengym.llm_envs.turns.protocol import Turn

__all__ = ["MultiTurnTokenEnv", "Turn", "TurnFn"]


def MultiTurnTokenEnv(prompts, tokenizer, turn_fn: TurnFn, *, max_turns: int = 2, **kwargs) -> TokenEnv:  # noqa: N802
    """``TokenEnv(prompts, tokenizer, turns=FeedbackTurns(turn_fn), max_turns=...)``: feedback turns by a function.

    When a slot's turn ends, ``turn_fn(responses, prompts, metadata, turns)`` scores it (the text of
    this turn only) and returns a :class:`Turn` per slot; the env writes the feedback after the model's
    tokens as the chat template writes it (see :class:`TokenEnv`), so a conversation's tokens equal
    ``tokenizer.apply_chat_template(conversation)``'s when each turn ends with the template's end-of-turn
    token (added to the turn-ending ids unless ``eos_token_ids`` is given) or a stop string.
    ``max_new_tokens`` counts the episode's generated tokens (all turns) and ``max_turn_tokens`` each
    turn's: a turn cut by the turn limit is answered as any finished turn (the episode goes on), the
    episode budget and the context limit truncate the episode (its last turn is still scored).

    Args:
        prompts: as for :class:`TokenEnv`.
        tokenizer: as for :class:`TokenEnv`.
        turn_fn: scores turns and gives feedback.
        max_turns: turns per episode (>= 1).
        **kwargs: the other :class:`TokenEnv` arguments (``reward_fn`` is not used: ``turn_fn`` rewards).

    Returns:
        a :class:`TokenEnv` with ``turns=FeedbackTurns(turn_fn)``.

    Example:
        >>> import torch
        >>> from tokengym.testing import tiny_tokenizer
        >>> tok = tiny_tokenizer()
        >>> fn = lambda r, p, m, t: [Turn(0.0, "try again") if ti == 0 else Turn(1.0) for ti in t]
        >>> env = MultiTurnTokenEnv(["1+1="], tok, fn, max_turns=2, batch_size=1, max_new_tokens=8, max_length=64)
        >>> td = env.reset(); eos = torch.tensor([tok.eos_token_id])
        >>> out = env.step(td.set("action", eos))["next"]
        >>> out["turn"].tolist(), out["done"].item(), int(out["seq_len"]) > int(td["seq_len"]) + 1
        ([1], False, True)
    """
    if kwargs.get("reward_fn") is not None:
        raise ValueError("MultiTurnTokenEnv rewards through turn_fn; pass reward_fn=None")
    kwargs.pop("reward_fn", None)
    return TokenEnv(prompts, tokenizer, turns=FeedbackTurns(turn_fn), max_turns=max_turns, **kwargs)
