"""A LangChain agent on agentspec's embedded model: two tools, ``create_agent``, one question.

    pip install -e integrations/langchain langchain
    python examples/langchain_agent.py ["What is the weather in Oslo in Fahrenheit?"]

The agent loop is LangChain's; each model turn is decoded locally by agentspec, with tool calls
generated under their schema's grammar (so arguments always parse) and speculative decoding.
"""

from __future__ import annotations

import sys
from typing import Any

from langchain.agents import create_agent
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool

from langchain_agentspec import ChatAgentSpec

WEATHER_C = {"oslo": 4.0, "paris": 18.0, "cairo": 31.0, "tokyo": 22.0}
DEFAULT_QUESTION = "What is the weather in Paris?"
SYSTEM_PROMPT = "You are a weather assistant. Use the tools, then answer in one short sentence."
# One worked exchange before the question: a 135M model does not open a tool call unprompted, but
# imitates one it has seen (a large model needs no such example).
EXAMPLE_TURN = [
    HumanMessage("What is the weather in Cairo?"),
    AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Cairo"}, "id": "call_example", "type": "tool_call"}]),
    ToolMessage("Sunny, 31.0 °C in Cairo.", tool_call_id="call_example", name="get_weather"),
    AIMessage("It is sunny and 31 °C in Cairo."),
]


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city, with the temperature in degrees Celsius."""
    celsius = WEATHER_C.get(city.strip().lower())
    return f"Sunny, {celsius} °C in {city}." if celsius is not None else f"No weather data for {city}."


@tool
def celsius_to_fahrenheit(celsius: float) -> str:
    """Convert a temperature from degrees Celsius to degrees Fahrenheit."""
    return f"{celsius * 9 / 5 + 32:.1f} °F"


def main(question: str = DEFAULT_QUESTION, *, max_tokens: int = 96, max_steps: int = 6) -> list[Any]:
    """Run the agent on ``question``, print the conversation, and return its messages."""
    agent = create_agent(
        ChatAgentSpec(max_tokens=max_tokens),
        tools=[get_weather, celsius_to_fahrenheit],
        system_prompt=SYSTEM_PROMPT,
    )
    messages = [*EXAMPLE_TURN, HumanMessage(question)]
    state = agent.invoke({"messages": messages}, {"recursion_limit": 2 * max_steps + 1})
    for message in state["messages"][len(EXAMPLE_TURN) :]:
        if isinstance(message, AIMessage) and message.tool_calls:
            for call in message.tool_calls:
                print(f"-> {call['name']}({call['args']})")
        elif isinstance(message, ToolMessage):
            print(f"<- {message.content}")
        else:
            print(f"{message.type}: {message.content}")
    return state["messages"][len(EXAMPLE_TURN) :]


if __name__ == "__main__":
    main(*sys.argv[1:2])
