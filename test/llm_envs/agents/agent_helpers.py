"""A tiny model that really calls tools: the small tiny Qwen2 fine-tuned (a few seconds) to answer two calculator
tasks with two parallel Hermes tool calls, then the sums, under a Qwen2.5-style tool chat template."""

from __future__ import annotations

import json

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"properties": {"a": {}, "b": {}}}}}]
TASKS = [{"question": "2+3 and 4+1", "pairs": [[2, 3], [4, 1]]}, {"question": "1+1 and 6+2", "pairs": [[1, 1], [6, 2]]}]


def first_messages(task) -> list[dict]:
    return [{"role": "user", "content": task["question"]}]


def answer(task) -> str:
    return " ".join(str(a + b) for a, b in task["pairs"])


def calls_text(task) -> str:
    return "".join(f'<tool_call>\n{json.dumps({"name": "add", "arguments": {"a": a, "b": b}})}\n</tool_call>'
                   for a, b in task["pairs"])  # fmt: skip


async def calculator_agent(client, task) -> float:
    """A ReAct-style program: call the tools the model asks for (in parallel), feed the results back, score the answer."""
    messages = first_messages(task)
    for _ in range(4):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float((message.content or "").strip() == answer(task))
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    return 0.0


