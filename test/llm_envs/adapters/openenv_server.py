"""Servers for the OpenEnv adapter tests, run as ``python openenv_server.py --port P [--mode M]``.

``--mode openenv`` (default): a real OpenEnv server (``openenv-core``) of a small multi-turn game
(``--max-concurrent N``: at most N sessions at once, openenv's ``max_concurrent_envs``; default 64):
guess the digit ``seed % 10`` in at most 3 tries. Each step answers ``higher`` / ``lower`` / ``say a
digit`` with reward -0.5 (a wrong digit) or 0.0 (no digit); the right digit gives 1.0 and ends the game.
``--mode malformed``: a bare WebSocket server that answers the reset properly and every step with a
message that is not JSON. ``--mode silent``: answers the reset, never a step.
"""

import argparse
import asyncio
import json
import re

HINTS = {"wrong_digit": -0.5, "no_digit": 0.0, "right": 1.0}


def score(text: str, target: int) -> tuple[float, str, bool]:
    """(reward, feedback, done) of one guess: the first digit of ``text``."""
    found = re.search(r"\d", text)
    if found is None:
        return HINTS["no_digit"], "say a digit", False
    guess = int(found.group())
    if guess == target:
        return HINTS["right"], "right", True
    return HINTS["wrong_digit"], "higher" if guess < target else "lower", False


def openenv_app(max_concurrent: int = 64):
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import Field

    class GuessAction(Action):
        guess: str = Field(..., description="the guess, as text")

    class GuessObservation(Observation):
        prompt: str = Field(default="", description="what the game says")

    class GuessDigitEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self._state, self.target = State(step_count=0), 0

        def reset(self, seed=None, episode_id=None, **kwargs):
            self._state, self.target = State(episode_id=episode_id, step_count=0), (seed or 0) % 10
            return GuessObservation(prompt="Guess a digit.", done=False, reward=0.0)

        def step(self, action, timeout_s=None, **kwargs):
            self._state.step_count += 1
            reward, text, done = score(action.guess, self.target)
            done = done or self._state.step_count >= 3
            return GuessObservation(prompt=text, done=done, reward=reward)

        @property
        def state(self):
            return self._state

    return create_app(GuessDigitEnvironment, GuessAction, GuessObservation, env_name="guess_digit",
                      max_concurrent_envs=max_concurrent)


async def bare_server(port: int, mode: str) -> None:
    import websockets
    from websockets.asyncio.server import serve

    async def handle(ws):
        try:
            async for raw in ws:
                kind = json.loads(raw)["type"]
                if kind == "reset":
                    data = {"observation": {"prompt": "Guess a digit."}, "reward": 0.0, "done": False}
                    await ws.send(json.dumps({"type": "observation", "data": data}))
                elif kind == "step" and mode == "malformed":
                    await ws.send("<html>this is not json")
                elif kind == "close":
                    return
        except websockets.ConnectionClosed:
            return

    async with serve(handle, "127.0.0.1", port, process_request=None) as server:
        print("ready", flush=True)
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", default="openenv", choices=["openenv", "malformed", "silent"])
    parser.add_argument("--max-concurrent", type=int, default=64)
    args = parser.parse_args()
    if args.mode == "openenv":
        import uvicorn

        uvicorn.run(openenv_app(args.max_concurrent), host="127.0.0.1", port=args.port, log_level="warning")
    else:
        asyncio.run(bare_server(args.port, args.mode))


if __name__ == "__main__":
    main()
