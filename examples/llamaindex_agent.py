"""A LlamaIndex FunctionAgent on agentspec's embedded model: it looks up the weather with a tool.

    pip install -e integrations/llamaindex
    python examples/llamaindex_agent.py

Small local models often answer from memory instead of calling a tool, so the agent forces the
first step's call (``initial_tool_choice``); agentspec generates it under the tool's JSON schema, so
the call is always valid and fast (the grammar drafts the JSON syntax). The tool's answer goes to the
user as is (``return_direct``): the embedded 135M model tends to call the tool again rather than
phrase an answer. With a larger ``AgentSpecLLM(model=...)``, drop ``return_direct`` and let the
model answer from the tool's result (later steps use ``tool_choice="auto"``).
"""

from __future__ import annotations

import asyncio

from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult
from llama_index.core.tools import FunctionTool
from llama_index.llms.agentspec import AgentSpecLLM


def get_weather(city: str) -> str:
    """Look up the current weather in a city."""
    return f"Sunny, 21 degrees Celsius in {city}."


async def main(max_tokens: int = 64) -> str:
    llm = AgentSpecLLM(max_tokens=max_tokens)  # loads nothing yet
    agent = FunctionAgent(
        tools=[FunctionTool.from_defaults(get_weather, return_direct=True)],
        llm=llm,
        initial_tool_choice="get_weather",
    )
    handler = agent.run(user_msg="What is the weather in Paris?")
    async for event in handler.stream_events():
        if isinstance(event, ToolCallResult):
            print(f"tool: {event.tool_name}({event.tool_kwargs}) -> {event.tool_output.content}")
    result = await handler
    answer = str(result.response.content or "")
    print(f"answer: {answer}")
    stats = llm.client().metrics()
    print(f"speculation: {stats.acceptance_rate:.0%} of drafted tokens accepted, {stats.target_forward_passes_saved} target passes saved")
    return answer


if __name__ == "__main__":
    asyncio.run(main())
