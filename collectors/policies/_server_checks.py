"""The start-up checks every server dialect shares: a skeleton its engine's questions fit into.

A dialect's ``inspect`` asks its servers what they serve through :func:`inspect_with`, which sends every call once more
when its connection fails and turns a server that cannot be reached, or that fails while it is asked, into a
``ValueError`` naming the engine, the server and the fix. Its ``check`` ends with :func:`check_served` (the model asked
for, then :func:`~tokengym.collectors.policies.protocol.check_fits_env`: context, vocabulary, tokenizer, sampling, as
every backend checks them) and its ``check_fleet`` is :func:`check_fleet`. What an engine asks and how it reads the
answers is its own: vLLM's in :mod:`._vllm_checks`, SGLang's in :mod:`.sglang_dialect`.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

import httpx

from tokengym.collectors.policies.protocol import check_fits_env
from tokengym.collectors.policies.sampling import SamplingConfig

__all__ = ["check_fleet", "check_served", "check_server", "inspect_with", "not_this_engine"]


async def inspect_with(fleet, server, ask: Callable[..., Awaitable[dict]], *, name: str, start: str) -> dict:
    """``await ask(call)``, ``call(method, path, payload=None)`` being ``fleet.call`` on ``server`` (sent once more when
    its connection fails: every call of a check is free of side effects). A 5xx answer (its message says what: an
    engine that died, its log) and a server that cannot be reached raise ``ValueError`` naming the ``name`` server and,
    for the latter, how to ``start`` one."""
    call = functools.partial(fleet.call, server, retry=True)
    try:
        return await ask(call)
    except httpx.HTTPStatusError as err:
        raise ValueError(f"{name} server {server.url} failed while tokengym checked it: {err}") from err
    except (httpx.TransportError, OSError) as err:
        raise ValueError(f"{name} server {server.url} cannot be reached ({type(err).__name__}: {err}); start it "
                         f"({start}) or fix the URL") from err  # fmt: skip


def not_this_engine(server, why, *, name: str, policy: str, server_kind: str) -> str:
    """The message for an HTTP server that is not the ``name`` engine's (``why``: what gave it away).

    Example:
        >>> from types import SimpleNamespace
        >>> not_this_engine(SimpleNamespace(url="http://h:1"), "HTTP 404", name="SGLang", policy="ServerPolicy",
        ...                 server_kind="SGLang's server")
        "http://h:1 is not a SGLang server (HTTP 404); ServerPolicy needs SGLang's server: check the port"
    """
    return f"{server.url} is not a {name} server ({why}); {policy} needs {server_kind}: check the port"


def check_served(answer: dict, env, *, name: str, model: str | None, sampling: SamplingConfig | None,
                 length_fix: str, tokenizer_fix: str) -> None:  # fmt: skip
    """``ValueError`` where the server of ``answer`` (a dialect's ``inspect``: ``url``, ``model``, ``max_model_len``,
    ``vocab_size``, ``probe_text``) serves another model than ``model`` (``None``: any) or does not fit ``env`` and
    ``sampling``; ``length_fix`` and ``tokenizer_fix`` say how to fix a short context or another tokenizer on this
    engine (``{positions}`` is the server's context)."""
    url = answer["url"]
    if model is not None and answer["model"] != model:
        raise ValueError(f"{name} server {url} serves {answer['model']!r}, not {model!r}; point the policy at "
                         "servers of one model (or pass model=None)")  # fmt: skip
    check_fits_env(env, f"{name} server {url}", vocab_size=answer.get("vocab_size"),
                   positions=answer.get("max_model_len"), sampling=sampling, probe_text=answer.get("probe_text"),
                   length_fix=length_fix, tokenizer_fix=tokenizer_fix)  # fmt: skip


def check_fleet(answers: list[dict], name: str = "vLLM") -> None:
    """All servers must serve the same model with the same limits.

    Example:
        >>> check_fleet([{"url": "a", "model": "m", "max_model_len": 64}, {"url": "b", "model": "m", "max_model_len": 32}],
        ...             "SGLang")
        Traceback (most recent call last):
        ...
        ValueError: SGLang servers a and b differ in max_model_len (64 vs 32); every server of a fleet serves the same model
    """
    first = answers[0]
    for a in answers[1:]:
        for field in ("model", "max_model_len", "vocab_size"):
            if a.get(field) != first.get(field):
                raise ValueError(f"{name} servers {first['url']} and {a['url']} differ in {field} ({first.get(field)!r} "
                                 f"vs {a.get(field)!r}); every server of a fleet serves the same model")  # fmt: skip


def check_server(answer: dict, env, **kwargs) -> None:
    """vLLM's check (:func:`._vllm_checks.check_server`), where it lived before the skeleton was split from it."""
    from tokengym.collectors.policies._vllm_checks import check_server as vllm_check

    vllm_check(answer, env, **kwargs)
