"""The target pass's linear kernels (``agentspec.passes.weights``): oneDNN-packed weights are
row-invariant and agree with the model's own layers; the choice is measured, cached and explained;
the loaded model stays untouched; and greedy speculative == plain with either kernels."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import agentspec
from agentspec.engine import Engine
from agentspec.passes.products import blocks_unsupported
from agentspec.passes.fused import FusedPass, fused_unsupported
from agentspec.engine.kv import KVBlock, KVLayout
from agentspec.passes.packed import PackedRow, check_packed, forward_packed, use_packed_attention
from agentspec.passes.weights import (
    CANDIDATES,
    GGUF_ACTIVATIONS,
    GGUF_RULE,
    GPU_CANDIDATES,
    NEAR_TOLERANCE,
    REDUCED,
    WEIGHTS,
    OneDNNLinear,
    bf16_supported,
    onednn_linear,
    onednn_supported,
    pass_layout,
    select_weights,
    torch_linear,
    with_onednn_linears,
)
from agentspec.errors import InvalidRequestError, ModelLoadError

from .conftest import drafted_matching_plain, tiny_model

# The default model's linear shapes (in, out): attention, MLP, and its 49152-token output layer.
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]


def _unsupported(weights: str, loaded) -> str | None:
    """Why the pass ``weights`` cannot run on ``loaded``'s model here (skip reason), or None."""
    if weights == "onednn":
        return onednn_supported(loaded.model)
    if weights in GGUF_ACTIVATIONS:
        return blocks_unsupported(loaded.model, loaded.gguf_file, GGUF_ACTIVATIONS[weights])
    return bf16_supported(loaded.model) if weights == "bf16" else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_onednn_linear_rows_do_not_depend_on_their_pass(loaded, shape, dtype):
    """A row's result is the same bits whether it is alone, the k-th of 2..32 rows, or moved — on
    float32 weights and on bfloat16 ones (the "bf16" pass)."""
    if dtype == torch.bfloat16 and bf16_supported(loaded.model) is not None:
        pytest.skip(f"bfloat16 oneDNN weights cannot run here: {bf16_supported(loaded.model)}")
    torch.manual_seed(0)
    linear = nn.Linear(*shape, bias=False)
    packed = OneDNNLinear(linear) if dtype == torch.float32 else onednn_linear(linear.weight, dtype)
    x = torch.randn(32, shape[0])
    with torch.inference_mode():
        alone = torch.cat([packed(x[i : i + 1]) for i in range(32)])
        assert alone.dtype == torch.float32
        tolerance = 1e-4 if dtype == torch.float32 else 3e-2  # bfloat16 keeps 8 bits of mantissa
        torch.testing.assert_close(alone, linear(x), rtol=1e-5, atol=tolerance)  # the same product, another order
        for rows in (2, 3, 5, 8, 9, 16, 17, 32):
            assert torch.equal(packed(x[:rows]), alone[:rows]), rows
        order = torch.randperm(32)
        assert torch.equal(packed(x[order]), alone[order])
        if dtype == torch.float32:
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
    tiny = tiny_model(loaded, seed=3).model  # a LlamaForCausalLM in float32 on the CPU: every candidate runs
    layout = KVLayout.of(tiny)
    eager = select_weights(tiny, layout, "eager")
    assert eager.name == "eager" and eager.reason == "requested"
    auto = select_weights(tiny, layout, "auto")
    # every candidate but the GGUF blocks, which need the file the model was read from
    assert set(auto.timings_ms) == set(CANDIDATES) - {*GGUF_ACTIVATIONS, *GPU_CANDIDATES}
    assert "gguf: the model was not read from a GGUF file" in auto.reason and "static: a GPU pass" in auto.reason
    assert all(len(t) == 2 and min(t) > 0 for t in auto.timings_ms.values())
    assert auto.name == min(auto.timings_ms, key=lambda name: sum(auto.timings_ms[name])) and "measured" in auto.reason
    assert select_weights(tiny, layout, "auto") is auto  # decided once per model
    with pytest.raises(ValueError, match="Unknown weights 'fast'"):
        select_weights(tiny, layout, "fast")


def test_reduced_precision_leaves_out_what_cannot_run(loaded):
    tiny = tiny_model(loaded, seed=4)
    half = tiny.with_model(tiny.model.to(torch.bfloat16), dtype=torch.bfloat16)
    assert "float32" in onednn_supported(half.model)
    auto = select_weights(half.model, KVLayout.of(half.model), "auto")
    assert set(auto.timings_ms) == {"eager", "fused"}  # the fused pass runs on F.linear there
    assert "onednn: oneDNN packing here is for float32 weights" in auto.reason
    with pytest.raises(ModelLoadError, match="weights='onednn' cannot run here.*float32.*Use weights='auto' or 'eager'"):
        Engine(half, weights="onednn")
    with pytest.raises(ModelLoadError, match="weights='bf16' cannot run here.*float32"):
        Engine(half, weights="bf16")
    with pytest.raises(ModelLoadError, match="weights='gguf-q8' cannot run here: the model was not read from a GGUF file"):
        Engine(half, weights="gguf-q8")


def test_fused_pass_refuses_what_it_does_not_compute(loaded):
    """A family outside arch.FAMILIES, or a block the description cannot express, is refused with the
    reason (the generic pass runs it); asked for by name, the engine refuses it at load."""
    from transformers import LlamaConfig, LlamaForCausalLM, OlmoConfig, OlmoForCausalLM

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    assert "not 'olmo'" in fused_unsupported(OlmoForCausalLM(OlmoConfig(**small)))
    assert "MLP gates, not 'relu'" in fused_unsupported(LlamaForCausalLM(LlamaConfig(**small, hidden_act="relu")))
    assert "no biases on the MLP" in fused_unsupported(LlamaForCausalLM(LlamaConfig(**small, mlp_bias=True)))
    assert fused_unsupported(LlamaForCausalLM(LlamaConfig(**small, attention_bias=True))) is None  # attention biases: Qwen2's
    with pytest.raises(ModelLoadError, match="weights='fused' cannot run here.*not 'olmo'"):
        olmo = OlmoForCausalLM(OlmoConfig(**{**small, "vocab_size": loaded.vocab_size})).eval()
        Engine(tiny_model(loaded).with_model(olmo), weights="fused")


@torch.inference_mode()  # as the engine runs (under autograd, transformers' 1-position attention takes another kernel)
def _passes(forward, layout):
    """Logits of a two-sequence prefill, a batched verification after a rollback, and a lone step."""
    blocks = [KVBlock(layout), KVBlock(layout)]
    out = forward([PackedRow(blocks[0], list(range(1000, 1040)), 3), PackedRow(blocks[1], list(range(50, 61)), 1)])
    blocks[0].length -= 2
    out += forward([PackedRow(blocks[1], [7, 8, 9, 10, 11], 5), PackedRow(blocks[0], [300, 301, 302], 3)])
    out += forward([PackedRow(blocks[0], [17], 1)])
    return out


def test_fused_pass_gives_the_models_logits(loaded):
    """On oneDNN weights the fused pass is the same arithmetic as transformers' modules on the same
    kernels, bit for bit; on F.linear it matches the model as loaded to float32 rounding."""
    model, layout = loaded.model, KVLayout.of(loaded.model)
    use_packed_attention(model)  # what an Engine does first
    eager = _passes(functools.partial(forward_packed, model), layout)
    on_torch = _passes(FusedPass(model, torch_linear), layout)
    for got, expected in zip(on_torch, eager):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-3)
    if onednn_supported(model) is None:
        modules = _passes(functools.partial(forward_packed, with_onednn_linears(model)), layout)
        fused = _passes(FusedPass(model, onednn_linear), layout)
        assert all(torch.equal(a, b) for a, b in zip(fused, modules))
        assert check_packed(model, layout, forward=FusedPass(model, onednn_linear)) <= 1e-3


@pytest.mark.parametrize("weights", ["fused", "onednn", "bf16", "static", *GGUF_ACTIVATIONS])
@torch.inference_mode()
def test_a_tokens_logits_do_not_depend_on_its_pass(loaded, weights):
    """Item 4 of the fast-pass issue: the same token at the same place gets the same logits, bit for
    bit, as a lone plain step, as any position of a verification, and beside other sequences — on
    the kernels the engine runs by default, on bfloat16 weights and on 8- and 16-bit activations. Otherwise a
    verification could accept what plain decoding would not write."""
    if _unsupported(weights, loaded) is not None:
        pytest.skip(f"{weights} weights cannot run here: {_unsupported(weights, loaded)}")
    model, layout = loaded.model, KVLayout.of(loaded.model)
    use_packed_attention(model)
    forward = {
        **{name: lambda name=name: select_weights(model, layout, name, loaded.gguf_file).forward for name in GGUF_ACTIVATIONS},
        "fused": lambda: FusedPass(model, onednn_linear if onednn_supported(model) is None else torch_linear),
        "onednn": lambda: functools.partial(forward_packed, with_onednn_linears(model)),
        "bf16": lambda: select_weights(model, layout, "bf16").forward,
        "static": lambda: select_weights(model, layout, "static").forward,
    }[weights]()
    layout = pass_layout(layout, forward)  # as an engine stores keys and values for it (float16 on integer rows)
    prompt, text = list(range(2000, 2060)), [17, 912, 4410, 29, 318, 77, 1043, 5, 880]
    block = KVBlock(layout)
    forward([PackedRow(block, prompt, 1)])
    alone = []  # each position as a lone plain step
    for token in text:
        alone.append(forward([PackedRow(block, [token], 1)])[0][0])
    for k in (2, 4, 8, 9):  # the same positions as one verification of k
        block.length = len(prompt)
        rows = forward([PackedRow(block, text[:k], k)])[0]
        for i in range(k):
            assert torch.equal(rows[i], alone[i]), (k, i)
    others = [KVBlock(layout) for _ in range(3)]
    forward([PackedRow(b, list(range(300 + 7 * j, 340 + 7 * j)), 1) for j, b in enumerate(others)])
    block.length = len(prompt)
    batch = forward([PackedRow(others[0], [5], 1), PackedRow(block, text[:4], 4), PackedRow(others[1], [6, 7], 2), PackedRow(others[2], [8], 1)])
    assert all(torch.equal(batch[1][i], alone[i]) for i in range(4))


def _reduced(weights: str, loaded):
    """Its pass, and its logits and the float32 pass's on a real prompt (skips where it cannot run)."""
    if _unsupported(weights, loaded) is not None:
        pytest.skip(f"{weights} weights cannot run here: {_unsupported(weights, loaded)}")
    model, layout = loaded.model, KVLayout.of(loaded.model)
    chosen = select_weights(model, layout, weights, loaded.gguf_file)
    assert chosen.name == weights and chosen.reason == "requested"
    ids = loaded.chat.encode([{"role": "user", "content": "Explain in two sentences why the sky is blue."}])
    full = select_weights(model, layout, "fused").forward([PackedRow(KVBlock(layout), ids, len(ids))])[0]
    rounded = chosen.forward([PackedRow(KVBlock(pass_layout(layout, chosen.forward)), ids, len(ids))])[0]
    return chosen, full, rounded


@pytest.mark.parametrize("weights", [name for name in REDUCED if name not in CANDIDATES])
@torch.inference_mode()
def test_reduced_precision_is_another_model_and_auto_never_picks_it(loaded, weights):
    """The "bf16" pass computes the loaded model with its linear weights rounded to bfloat16, the
    "gguf-q8" pass with each product's input rows rounded to 8 bits: logits near the float32 pass's
    (not equal, which is why "auto" leaves them out) and the same greedy choice almost everywhere on
    a real prompt; asked for by name, it says so."""
    chosen, full, rounded = _reduced(weights, loaded)
    model, layout = loaded.model, KVLayout.of(loaded.model)
    difference = (full - rounded).abs().max().item()
    assert 0.05 < difference < 3, difference
    assert (full.argmax(-1) == rounded.argmax(-1)).float().mean().item() > 0.9
    with pytest.raises(NotImplementedError, match="differ"):  # what keeps it out of "auto"
        check_packed(model, layout, forward=chosen.forward)
    assert check_packed(model, layout, chosen.tolerance, forward=chosen.forward) > 1e-3  # what an engine checks
    target = Engine(loaded, weights=weights)
    target.calibrate(repeats=1)  # checks the pass against the model within its tolerance, then times it
    assert target.weights.name == weights and target.costs.cost(1) > 0


@torch.inference_mode()
def test_16_bit_activations_are_a_candidate_within_a_hundredth_of_float32(loaded):
    """The "gguf-q16" pass rounds each product's input rows to 16 bits per block of 32, and stores
    keys and values as float16: not float32's logits, but within NEAR_TOLERANCE of them (8-bit rows:
    over 1), with every greedy choice of the float32 pass on a real prompt — so "auto" may pick it,
    and compares against float32 decoding on "gguf" (``conftest.exact_engine``)."""
    chosen, full, rounded = _reduced("gguf-q16", loaded)
    assert "gguf-q16" in CANDIDATES and "gguf-q16" in REDUCED and chosen.tolerance == NEAR_TOLERANCE
    difference = (full - rounded).abs().max().item()
    assert 1e-4 < difference < NEAR_TOLERANCE, difference  # rounded, far less than by 8 bits
    assert torch.equal(full.argmax(-1), rounded.argmax(-1))
    model, layout = loaded.model, pass_layout(KVLayout.of(loaded.model), chosen.forward)
    assert layout.dtype == torch.float16
    with pytest.raises(NotImplementedError, match="differ"):
        check_packed(model, layout, 1e-3, forward=chosen.forward)  # float32's own tolerance
    assert 1e-3 < check_packed(model, layout, chosen.tolerance, forward=chosen.forward) < NEAR_TOLERANCE


@torch.inference_mode()
def test_16_bit_rows_keep_float32s_greedy_choices_on_text(loaded):
    """On held text (``conftest.HELD_TEXT``, teacher-forced), "gguf-q16"'s logit error stays under half
    of float32's top-two margin at nearly every position — there its greedy choice is float32's by
    construction — and the choices agree at every position; the 8-bit rows of "gguf-q8" (another
    model) are safe at fewer positions. This, not the largest error on random tokens, is what says
    greedy text will agree (``conftest.greedy_margins``)."""
    from .conftest import HELD_TEXT, greedy_margins

    model, layout = loaded.model, KVLayout.of(loaded.model)
    ids = loaded.tokenizer.encode(HELD_TEXT, add_special_tokens=False)
    assert len(ids) > 150

    def logits(weights: str) -> torch.Tensor:
        if _unsupported(weights, loaded) is not None:
            pytest.skip(f"{weights} weights cannot run here: {_unsupported(weights, loaded)}")
        forward = select_weights(model, layout, weights, loaded.gguf_file).forward
        return forward([PackedRow(KVBlock(pass_layout(layout, forward)), ids, len(ids))])[0]

    reference = logits("fused")
    safe, agreed = greedy_margins(reference, logits("gguf-q16"))
    assert safe >= 0.97 and agreed == 1.0, (safe, agreed)
    eight_bits, _ = greedy_margins(reference, logits("gguf-q8"))
    assert eight_bits < safe, (eight_bits, safe)


def test_client_rejects_unknown_weights_before_loading():
    with pytest.raises(InvalidRequestError, match="Unknown `weights` 'int4'.*'auto', 'eager', 'onednn', 'fused'"):
        agentspec.Client(weights="int4")


def test_default_engine_states_its_weights(engine):
    """The session's engine says why it runs its pass. On the default model's GGUF file where the
    block kernels run, "auto" takes the pass ``GGUF_RULE`` gives (gguf-q16 first), by rule: nothing
    is timed and nothing else built, so every run on this CPU takes the same pass and writes the same
    text; the engine does not check it against the model's own forward at start-up (that would read
    every float32 weight), this test does. Without kernels it times the candidates and keeps the
    fastest."""
    chosen, loaded = engine.weights, engine.loaded
    assert chosen.name in CANDIDATES and engine.forward is chosen.forward
    if _unsupported("gguf", loaded) is None:
        expected = next(name for name in GGUF_RULE if _unsupported(name, loaded) is None)
        assert chosen.name == expected and chosen.timings_ms == {} and not chosen.check_at_start, chosen.reason
        assert f"a GGUF file on {chosen.isa} kernels takes the first of gguf-q16, gguf" in chosen.reason
        # the check an engine on a rule's pass leaves to the tests: within the pass's tolerance of the model
        layout = engine.layout
        assert check_packed(loaded.model, layout, chosen.tolerance, forward=chosen.forward) <= (chosen.tolerance or 1e-3)
    else:
        assert "eager" in chosen.timings_ms and "fused" in chosen.timings_ms  # the default model is a Llama
        if onednn_supported(loaded.model) is None:
            expected = set(CANDIDATES) - set(GPU_CANDIDATES) - set(GGUF_ACTIVATIONS)
            assert set(chosen.timings_ms) == expected
        assert chosen.name == min(chosen.timings_ms, key=lambda name: sum(chosen.timings_ms[name]))
    assert engine.layout == pass_layout(KVLayout.of(loaded.model), engine.forward)  # the cache as the pass stores it


PROMPTS = [
    "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog.",
    "Count from 1 to 20, separated by commas.",
    "Write a Python function that reverses a string.",
]


@pytest.mark.parametrize("weights", WEIGHTS[1:])
def test_greedy_speculative_matches_plain_with_either_weights(loaded, engine, weights):
    """Each kernel choice against plain decoding of the same weights (the equivalence suite runs the
    default choice): K pinned at 8, so drafts are verified at full length and rolled back."""
    if _unsupported(weights, loaded) is not None:
        pytest.skip(f"{weights} weights cannot run here: {_unsupported(weights, loaded)}")
    target = Engine(loaded, weights=weights)
    target.costs = engine.costs
    assert drafted_matching_plain(target, loaded, PROMPTS) > 10  # drafts were verified, not just plain steps


def test_forward_packed_refuses_a_model_without_the_packed_attention(loaded):
    tiny = tiny_model(loaded, seed=5).model  # fresh: transformers' sdpa, which would ignore the blocks' past
    with pytest.raises(RuntimeError, match="call use_packed_attention"):
        forward_packed(tiny, [PackedRow(KVBlock(KVLayout.of(tiny)), [1, 2, 3], 1)])
