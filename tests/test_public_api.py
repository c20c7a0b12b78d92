"""The public surface is explicit and locked: changing it must be a decision, not an accident."""

import agentspec

EXPECTED = {
    "Client", "Stream", "SpecConfig", "Limits", "SpecStats", "Usage", "Event", "TextDelta", "ToolCallDelta", "ToolCall",
    "Done", "Completion", "AgentSpecError", "InvalidRequestError", "ContextLengthError", "UnsupportedFeatureError",
    "ModelLoadError", "ClientClosedError", "EngineOverloadedError", "RequestTimeoutError", "EngineError", "RemoteError",
}


def test_all_is_locked():
    assert set(agentspec.__all__) == EXPECTED
    for name in EXPECTED:
        assert getattr(agentspec, name) is not None


def test_error_tree():
    for name in EXPECTED:
        obj = getattr(agentspec, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, agentspec.AgentSpecError)
    assert issubclass(agentspec.InvalidRequestError, ValueError)
    assert issubclass(agentspec.ContextLengthError, agentspec.InvalidRequestError)
    assert issubclass(agentspec.RemoteError, agentspec.EngineError)


def test_spec_stats_has_every_contract_field():
    fields = set(agentspec.SpecStats.model_fields)
    assert {
        "drafted_tokens", "accepted_tokens", "acceptance_rate", "accepted_by_source", "target_forward_passes",
        "target_forward_passes_saved", "mean_accepted_length", "rollbacks", "fallback_steps", "draft_ms",
        "verify_ms", "ttft_ms", "tpot_ms",
    } <= fields
