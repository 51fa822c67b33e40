from tokengym.llm_envs.tools import TOOL_STOP, ToolCall, find_tool_call


def test_find_tool_call():
    assert find_tool_call("a <tool> calculator : 1+1 </tool> <tool>python: x</tool>") == ("calculator", "1+1")
    assert find_tool_call("plain answer 19") is None
    assert find_tool_call("<tool>calculator: 1+1").argument == "missing </tool>"
    assert find_tool_call("<tool>no name</tool>") == (None, "expected <tool>NAME: ARGUMENT</tool>")
    multi_line = find_tool_call("<tool>python: for i in range(2):\n    print(i)</tool>")
    assert multi_line == ToolCall("python", "for i in range(2):\n    print(i)") and multi_line.name == "python"
    assert TOOL_STOP == "</tool>"
