"""LlamaIndex's FunctionAgent end to end on AgentSpecLLM, and examples/llamaindex_agent.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult
from llama_index.core.tools import FunctionTool
from llama_index.llms.agentspec import AgentSpecLLM

from .conftest import WAITS_ON_AUTO, WEATHER, get_weather

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "llamaindex_agent.py"


async def run_agent(agent: FunctionAgent, question: str, max_iterations: int = 4) -> tuple[list[ToolCallResult], str]:
    handler = agent.run(user_msg=question, max_iterations=max_iterations)
    calls = [event async for event in handler.stream_events() if isinstance(event, ToolCallResult)]
    result = await handler
    return calls, str(result.response.content or "")


async def test_function_agent_calls_the_tool_and_returns_its_answer(llm: AgentSpecLLM) -> None:
    """The first step forces the call (initial_tool_choice); the tool's output is the answer (return_direct)."""
    looked_up: list[str] = []

    def lookup(city: str) -> str:
        looked_up.append(city)
        return get_weather(city)

    tool = FunctionTool.from_defaults(lookup, name="get_weather", description="Look up the current weather in a city.", return_direct=True)
    agent = FunctionAgent(tools=[tool], llm=llm, initial_tool_choice="get_weather")
    calls, answer = await run_agent(agent, "What is the weather in Paris?")
    assert len(looked_up) == 1 and "Paris" in looked_up[0]
    assert [c.tool_name for c in calls] == ["get_weather"] and calls[0].tool_kwargs == {"city": looked_up[0]}
    assert answer == WEATHER


@WAITS_ON_AUTO
async def test_function_agent_loop_with_auto_tool_choice(llm: AgentSpecLLM, weather_tool) -> None:
    """The agent's second step runs with tool_choice="auto": the model may answer or call again.

    SmolLM2-135M calls again; with max_iterations=2 that second call is not run and
    early_stopping_method="generate" asks for a text answer (from memory, which in LlamaIndex 0.14
    holds the user message but not the tool result).
    """
    agent = FunctionAgent(tools=[weather_tool], llm=llm, initial_tool_choice="get_weather", early_stopping_method="generate")
    calls, answer = await run_agent(agent, "What is the weather in Paris?", max_iterations=2)
    assert [(c.tool_name, c.tool_output.content) for c in calls] == [("get_weather", WEATHER)]
    assert answer.strip()


async def test_example_script(capsys) -> None:
    spec = importlib.util.spec_from_file_location("llamaindex_agent_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    answer = await example.main(max_tokens=24)
    assert answer == example.get_weather("Paris")
    assert "tool: get_weather" in capsys.readouterr().out
