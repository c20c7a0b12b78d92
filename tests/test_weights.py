"""The target pass's linear kernels (``agentspec.engine.weights``): oneDNN-packed weights are
row-invariant and agree with the model's own layers; the choice is measured, cached and explained;
the loaded model stays untouched; and greedy speculative == plain with either kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import agentspec
from agentspec.engine import Engine
from agentspec.engine.kv import KVLayout
from agentspec.engine.weights import OneDNNLinear, onednn_supported, select_weights, with_onednn_linears
from agentspec.errors import InvalidRequestError, ModelLoadError
from agentspec.params import GenerationParams
from agentspec.types import SpecConfig

from .conftest import decode, tiny_model

# The default model's linear shapes (in, out): attention, MLP, and its 49152-token output layer.
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_onednn_linear_rows_do_not_depend_on_their_pass(shape):
    """A row's result is the same bits whether it is alone, the k-th of 2..32 rows, or moved."""
    torch.manual_seed(0)
    linear = nn.Linear(*shape, bias=False)
    packed = OneDNNLinear(linear)
    x = torch.randn(32, shape[0])
    with torch.inference_mode():
        alone = torch.cat([packed(x[i : i + 1]) for i in range(32)])
        torch.testing.assert_close(alone, linear(x), rtol=1e-5, atol=1e-4)  # the same product, another order
        for rows in (2, 3, 5, 8, 9, 16, 17, 32):
            assert torch.equal(packed(x[:rows]), alone[:rows]), rows
        order = torch.randperm(32)
        assert torch.equal(packed(x[order]), alone[order])
        assert torch.equal(packed(x[:6].reshape(2, 3, -1)).reshape(6, -1), alone[:6])  # any leading shape


def test_onednn_copy_shares_parameters_and_leaves_the_model_alone(loaded):
    tiny = tiny_model(loaded).model
    fast = with_onednn_linears(tiny)
    assert all(type(m) is not nn.Linear for m in fast.modules())
    assert sum(type(m) is OneDNNLinear for m in fast.modules()) == sum(type(m) is nn.Linear for m in tiny.modules()) > 0
    assert fast.get_output_embeddings().weight is tiny.get_output_embeddings().weight
    assert fast.model.embed_tokens.weight is tiny.model.embed_tokens.weight
    ids = torch.tensor([[5, 17, 300, 2, 9]])
    with torch.inference_mode():
        torch.testing.assert_close(fast(input_ids=ids).logits, tiny(input_ids=ids).logits, rtol=1e-5, atol=1e-4)


def test_select_weights_measures_caches_and_explains(loaded):
    tiny = tiny_model(loaded, seed=3).model
    layout = KVLayout.of(tiny)
    eager = select_weights(tiny, layout, "eager")
    assert eager.name == "eager" and eager.model is tiny
    auto = select_weights(tiny, layout, "auto")
    assert auto.name in ("eager", "onednn")
    assert set(auto.timings_ms) == {"eager", "onednn"} and all(len(t) == 2 and min(t) > 0 for t in auto.timings_ms.values())
    faster = min(auto.timings_ms, key=lambda name: sum(auto.timings_ms[name]))
    assert auto.name == faster and "measured" in auto.reason
    assert select_weights(tiny, layout, "auto") is auto  # decided once per model
    assert (auto.model is tiny) == (auto.name == "eager")
    with pytest.raises(ValueError, match="Unknown weights 'fast'"):
        select_weights(tiny, layout, "fast")


def test_onednn_refuses_what_it_cannot_run(loaded):
    tiny = tiny_model(loaded, seed=4)
    half = dataclasses.replace(tiny, model=tiny.model.to(torch.bfloat16), dtype=torch.bfloat16)
    assert "float32" in onednn_supported(half.model)
    auto = select_weights(half.model, KVLayout.of(half.model), "auto")
    assert auto.name == "eager" and "float32" in auto.reason and auto.timings_ms == {}
    with pytest.raises(ModelLoadError, match="weights='onednn' cannot run here.*float32.*Use weights='auto' or 'eager'"):
        Engine(half, weights="onednn")


def test_client_rejects_unknown_weights_before_loading():
    with pytest.raises(InvalidRequestError, match="Unknown `weights` 'int4'.*'auto', 'eager', 'onednn'"):
        agentspec.Client(weights="int4")


def test_default_engine_states_its_weights(engine):
    """The session's engine chose by measurement (which one depends on the CPU), and says why."""
    chosen = engine.weights
    assert chosen.name in ("eager", "onednn")
    if onednn_supported(engine.loaded.model) is None:
        assert set(chosen.timings_ms) == {"eager", "onednn"}
        assert chosen.name == min(chosen.timings_ms, key=lambda name: sum(chosen.timings_ms[name]))


PROMPTS = [
    "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog.",
    "Count from 1 to 20, separated by commas.",
    "Write a Python function that reverses a string.",
]


@pytest.mark.parametrize("weights", ["eager", "onednn"])
def test_greedy_speculative_matches_plain_with_either_weights(loaded, engine, weights):
    """Each kernel choice against plain decoding of the same weights (the equivalence suite runs the
    default choice): K pinned at 8, so drafts are verified at full length and rolled back."""
    if weights == "onednn" and onednn_supported(loaded.model) is not None:
        pytest.skip(f"oneDNN weights cannot run here: {onednn_supported(loaded.model)}")
    target = Engine(loaded, weights=weights)
    target.costs = engine.costs
    plain = GenerationParams(max_tokens=24, spec=SpecConfig(enabled=False))
    spec = GenerationParams(max_tokens=24, spec=SpecConfig(max_draft_tokens=8, adaptive=False))
    drafted = 0
    for prompt in PROMPTS:
        ids = loaded.chat.encode([{"role": "user", "content": prompt}])
        expected, _ = decode(target, ids, plain)
        got, _ = decode(target, ids, spec)
        assert got.tokens == expected.tokens, prompt
        drafted += got.stats.drafted_tokens
    assert drafted > 10  # drafts were verified, not just plain steps
