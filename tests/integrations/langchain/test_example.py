"""examples/langchain_agent.py runs end to end: a create_agent loop on the default model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from langchain_core.messages import AIMessage, ToolMessage

EXAMPLE = Path(__file__).parents[3] / "examples" / "langchain_agent.py"


def test_the_agent_calls_a_tool_and_answers() -> None:
    spec = importlib.util.spec_from_file_location("langchain_agent", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    messages = example.main(max_tokens=48, max_steps=4)

    tool_results = [m for m in messages if isinstance(m, ToolMessage)]
    assert tool_results and tool_results[0].name == "get_weather" and "Paris" in tool_results[0].content
    final = messages[-1]
    assert isinstance(final, AIMessage) and not final.tool_calls
    assert "18" in final.text  # the answer uses the tool's result
