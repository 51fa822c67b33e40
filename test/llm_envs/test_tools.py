import os
import time

import pytest
import torch

from tokengym.collectors import TokenCollector
from tokengym.llm_envs import keys
from tokengym.llm_envs.multi_turn_env import Turn
from tokengym.llm_envs.python_sandbox import run_python
from tokengym.llm_envs.tasks import arithmetic_prompts, make_multi_turn_math_env
from tokengym.llm_envs.tools import ToolRegistry, ToolTurns, calculator, find_tool_call, python_tool


@pytest.mark.parametrize(
    ("expr", "value"),
    [("(3 + 4) * 2", "14"), ("-2 ** 3", "-8"), ("7 // 2 + 7 % 2", "4"), ("1 / 4", "0.25"), ("6 / 3", "2"),
     ("2 ** 10", "1024"), ("1.5 * 2", "3")],
)  # fmt: skip
def test_calculator(expr, value):
    assert calculator(expr) == value


@pytest.mark.parametrize(
    ("expr", "match"),
    [
        ("__import__('os').system('echo hi')", "only numbers and"),
        ("x + 1", "only numbers and"),
        ("(1).__class__", "only numbers and"),
        ("[1, 2]", "only numbers and"),
        ("'a' * 3", "only numbers and"),
        ("9 ** 9 ** 9", "exponent .* too large"),
        ("10 ** 99 * 10 ** 99", "too large"),
        ("1e308 * 10", "too large"),
        ("1 / 0", "division by zero"),
        ("(-1) ** 0.5", "not a real number"),
        ("1 +", "bad syntax"),
        ("1" * 1001, "longer than 1000"),
    ],
)
def test_calculator_rejects(expr, match):
    with pytest.raises(ValueError, match=match):
        calculator(expr)


def test_find_tool_call():
    assert find_tool_call("a <tool> calculator : 1+1 </tool> <tool>python: x</tool>") == ("calculator", "1+1")
    assert find_tool_call("plain answer 19") is None
    assert find_tool_call("<tool>calculator: 1+1").argument == "missing </tool>"
    assert find_tool_call("<tool>no name</tool>") == (None, "expected <tool>NAME: ARGUMENT</tool>")


def test_registry_errors_are_messages_and_counted():
    registry = ToolRegistry({"calculator": calculator, "broken": lambda arg: 1 / 0})
    assert registry.run_text("<tool>calculator: 2*3</tool>") == "6"
    assert registry.run_text("<tool>calculator: 2*3") == "error: malformed tool call (missing </tool>)"
    assert registry.run_text("<tool>search: cats</tool>") == "error: unknown tool 'search'; available: ['broken', 'calculator']"
    assert registry.run_text("<tool>broken: x</tool>") == "error: broken: division by zero"
    assert registry.run_text("<tool>calculator: os</tool>").startswith("error: calculator: only numbers")
    assert registry.metrics == {"calls": 5, "errors": 4, "malformed": 1, "unknown_tool": 1, "tool_failures": 2}
    with pytest.raises(ValueError, match="tool name must match"):
        registry.register("bad name", calculator)
    with pytest.raises(TypeError, match="must be callable"):
        registry.register("x", "not callable")


@pytest.fixture(scope="module")
def python():
    return python_tool(timeout_s=1.0, max_output_chars=200)


def test_python_tool_output_and_crash(python):
    assert python("print(1 + 1)") == "2\n"
    registry = ToolRegistry({"python": python})
    out = registry.run_text("<tool>python: raise ValueError('boom')</tool>")
    assert out.startswith("error: python: exit code 1") and "ValueError: boom" in out


def test_python_tool_timeout_is_bounded(python):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="timeout after 1 s"):
        python("while True:\n    pass")
    assert time.monotonic() - start < 3.0


def test_python_tool_truncates_huge_output(python):
    out = python("print('x' * 10**7)")
    assert out == "x" * 200 + " [output truncated]"
    result = run_python("while True:\n    print('y' * 1000)", timeout_s=2.0, max_output_chars=100)
    assert result.is_truncated and result.error is None and len(result.output) == 100


def test_python_sandbox_env_cwd_and_memory(monkeypatch):
    monkeypatch.setenv("TOKENGYM_SECRET", "x")
    assert os.environ["TOKENGYM_SECRET"] == "x"
    result = run_python("import os; print(os.environ.get('TOKENGYM_SECRET'), sorted(os.environ)); print(os.getcwd())",
                        timeout_s=2.0)  # fmt: skip
    line, cwd = result.output.splitlines()
    assert line.startswith("None") and "TOKENGYM_SECRET" not in line
    assert "tokengym_py_" in cwd and not os.path.exists(cwd)  # its own temporary dir, deleted after
    big = run_python("x = bytearray(4 * 1024 ** 3)", timeout_s=2.0, memory_mb=256)
    assert big.error == "exit code 1" and "MemoryError" in big.output
    with pytest.raises(ValueError, match="timeout_s must be a number >= 0.01"):
        run_python("1", timeout_s=0)


def test_tool_turns_delegates_answers():
    seen = []

    def answer(responses, prompts, metadata, turns):
        seen.append(responses)
        return [Turn(1.0) for _ in responses]

    fn = ToolTurns(ToolRegistry.default(), answer, tool_reward=-0.1)
    out = fn(["<tool>calculator: 6*7</tool>", "42", "<tool>oops"], ["q"] * 3, [{}] * 3, [0, 1, 0])
    assert out[0] == Turn(-0.1, feedback="42", role="tool") and out[1] == Turn(1.0)
    assert out[2].role == "tool" and out[2].feedback.startswith("error: malformed")
    assert seen == [["42"]]
    with pytest.raises(TypeError, match="registry must be a ToolRegistry"):
        ToolTurns({}, answer)


class ToolScript:
    """Slot b writes ``scripts[b][turn]`` then EOS (the env's stop string ends a tool turn first)."""

    def __init__(self, scripts, eos):
        self.scripts, self.eos, self.version = scripts, eos, 0

    def __call__(self, td):
        turn, pos = td.get(keys.TURN), td.get(keys.SEQ_LEN) - td.get(keys.PROMPT_LEN)
        action = []
        for b in range(len(turn)):
            script = self.scripts[b][min(int(turn[b]), len(self.scripts[b]) - 1)]
            action.append(script[int(pos[b])] if int(pos[b]) < len(script) else self.eos)
        td.set(keys.ACTION, torch.tensor(action))
        td.set(keys.ACTION_LOG_PROB, torch.zeros(len(turn)))
        td.set(keys.POLICY_VERSION, torch.zeros(len(turn), dtype=torch.long))
        return td


def test_collector_with_tool_calls_never_raises(tokenizer):
    env = make_multi_turn_math_env(batch_size=4, n_prompts=4, max_turns=3, max_new_tokens=64, tools=True,
                                   python_timeout_s=1.0)  # fmt: skip
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    answers = [p["answer"] for p in arithmetic_prompts(4, seed=0)]  # slot b gets prompt b at the first reset
    calls = ["<tool>calculator: 2+2</tool>", "<tool>python: while True: pass</tool>", "<tool>python: print(</tool>",
             "<tool>nope: 1</tool>"]  # fmt: skip
    scripts = {b: [ids(calls[b]), ids(answers[b])] for b in range(4)}
    policy = ToolScript(scripts, tokenizer.eos_token_id)
    batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=4, total_steps=200)))
    done = batch[keys.DONE].squeeze(-1) & batch[keys.MASK]
    assert batch[keys.REWARD].squeeze(-1)[done].tolist() == [1.0] * 4  # every slot answered after its tool turn
    assert batch[keys.TURN].amax(-1).tolist() == [1] * 4
    assert env.turn_fn.metrics == {"calls": 4, "errors": 3, "malformed": 0, "unknown_tool": 1, "tool_failures": 2}
    table = batch.get_non_tensor(keys.PROMPTS)
    texts = [tokenizer.decode(table.sequence(int(t))) for t in batch[keys.TRAJ_ID][:, 0]]
    assert any("<|tool|>4<|end|>" in t for t in texts) and any("timeout after 1 s" in t for t in texts)
