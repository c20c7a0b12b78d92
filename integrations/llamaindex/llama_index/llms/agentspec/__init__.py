"""LlamaIndex integration for agentspec: ``from llama_index.llms.agentspec import AgentSpecLLM``."""

from llama_index.llms.agentspec.base import AgentSpecLLM

__all__ = ["AgentSpecLLM"]
