"""Tests of the agent-framework integrations (separate distributions under integrations/)."""
