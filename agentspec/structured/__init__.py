"""Structured output: JSON-schema grammars with canonical forcing (``grammar``) and tool calls
(``tools``: OpenAI function tools, the call grammar, streamed call events)."""
