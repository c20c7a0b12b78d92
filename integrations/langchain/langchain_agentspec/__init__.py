"""LangChain chat model for agentspec: an embedded local LLM with lossless speculative decoding."""

from .chat_models import ChatAgentSpec

__all__ = ["ChatAgentSpec"]
