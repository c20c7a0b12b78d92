"""examples/langchain_agent.py runs end to end: a create_agent loop on the default model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage, ToolMessage

EXAMPLE = Path(__file__).parents[3] / "examples" / "langchain_agent.py"


@pytest.mark.xfail(
    reason="the 135M default model, not the integration: with tool_choice='auto' (create_agent's default) "
    "it answers the weather question from its own knowledge instead of calling get_weather",
    strict=False,
)
def test_the_agent_calls_a_tool_and_answers() -> None:
    spec = importlib.util.spec_from_file_location("langchain_agent", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    messages = example.main(max_tokens=48, max_steps=4)

    tool_results = [m for m in messages if isinstance(m, ToolMessage)]
    assert tool_results and tool_results[0].name in ("get_weather", "celsius_to_fahrenheit")
    final = messages[-1]
    assert isinstance(final, AIMessage) and not final.tool_calls and final.text.strip()
