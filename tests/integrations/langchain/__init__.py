"""Tests of langchain-agentspec (integrations/langchain)."""
