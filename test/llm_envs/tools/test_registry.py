import pytest

from tokengym.llm_envs.tools import ToolRegistry, calculator


def test_registry_errors_are_messages_and_counted():
    registry = ToolRegistry({"calculator": calculator, "broken": lambda arg: 1 / 0})
    assert registry.run_text("<tool>calculator: 2*3</tool>") == "6"
    assert registry.run_text("<tool>calculator: 2*3") == "error: malformed tool call (missing </tool>)"
    assert registry.run_text("<tool>search: cats</tool>") == "error: unknown tool 'search'; available: ['broken', 'calculator']"
    assert registry.run_text("<tool>broken: x</tool>") == "error: broken: division by zero"
    assert registry.run_text("<tool>calculator: os</tool>").startswith("error: calculator: only numbers")
    assert registry.run_text("no call") is None
    assert registry.metrics == {"calls": 5, "errors": 4, "malformed": 1, "unknown_tool": 1, "tool_failures": 2}


def test_results_are_cut():
    registry = ToolRegistry({"echo": lambda arg: arg * 100, "fail": lambda arg: 1 / 0}, max_result_chars=10)
    assert registry.run_text("<tool>echo: ab</tool>") == "ab" * 5
    assert registry.run_text("<tool>fail: x</tool>") == "error: fai"


def test_default_registry_runs_both_tools():
    # a timeout no loaded machine reaches (the default 5 s of wall clock was once, beside two CPU hogs and the suite):
    # what this checks is that the registry runs both tools, not how fast
    registry = ToolRegistry.default(python_sandbox="rlimit", python_timeout_s=60.0)
    assert registry.run_text("<tool>python: print(2 ** 5)</tool>") == "32\n"
    assert registry.run_text("<tool>calculator: 2 ** 5</tool>") == "32"


def test_bad_registrations():
    registry = ToolRegistry()
    with pytest.raises(ValueError, match="tool name must match"):
        registry.register("bad name", calculator)
    with pytest.raises(TypeError, match="must be callable"):
        registry.register("x", "not callable")
    with pytest.raises(ValueError, match="max_result_chars must be an int >= 1, got 0"):
        ToolRegistry(max_result_chars=0)
