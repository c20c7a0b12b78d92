"""The GPU pass (``weights="static"``, ``agentspec/passes/static.py``) on the CPU, where it runs the
same code eagerly: its key/value pool, its grid of rows × positions, its one attention call per layer.
The default model's identity checks (a token's logits whatever its pass, speculative == plain) run
it in ``tests/test_weights.py``; ``tests/cuda_check.py`` runs it with CUDA graphs on a GPU."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agentspec.passes.fused import FusedPass
from agentspec.engine.kv import KVBlock, KVLayout
from agentspec.passes.packed import PackedRow, check_packed
from agentspec.passes.static import KEY_BUCKET, KVPool, StaticPass, bucket
from agentspec.passes.weights import onednn_linear


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.5, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _passes(forward, layout: KVLayout) -> list[torch.Tensor]:
    """Prefills, plain steps, a verification with padding and a rollback, three sequences of
    different lengths side by side (the key bucket grows past 256 on the way); every kept logit
    and the features of the rows that ask for them."""
    a, b, c = KVBlock(layout), KVBlock(layout), KVBlock(layout)
    out = forward([PackedRow(a, _tokens(40, 1), 1), PackedRow(b, _tokens(300, 2), 2)])
    out += forward([PackedRow(a, [5], 1), PackedRow(b, [6, 7, 8], 2, pad=1), PackedRow(c, _tokens(9, 3), 9)])
    b.length -= 2  # a rejected draft
    rows = [PackedRow(c, [11], 1, features=True), PackedRow(a, [12, 13], 2), PackedRow(b, [14], 1)]
    out += forward(rows)
    return out + [rows[0].hidden]


@torch.inference_mode()
def test_static_pass_gives_the_fused_pass_logits(model):
    """The pool, the padded grid and the one attention call per layer compute the fused pass's
    logits and features, to float32 rounding: attention over a key bucket sums in another order
    than over exactly a sequence's keys."""
    layout = KVLayout.of(model)
    static = StaticPass(model, onednn_linear, sequences=4, capacity=1024)
    assert static.graphs is False and static.captured == 0  # a CPU runs it eagerly
    assert check_packed(model, layout, forward=static) <= 1e-3
    got, expected = _passes(static, layout), _passes(FusedPass(model, onednn_linear), layout)
    assert [g.shape for g in got] == [e.shape for e in expected] and len(got) == 9
    for g, e in zip(got, expected):
        assert (g - e).abs().max().item() < 1e-3 * max(1.0, e.abs().max().item())


@torch.inference_mode()
def test_a_tokens_logits_do_not_depend_on_the_grid(model):
    """Identity on the static pass: a prompt's and a step's logits are the same bits alone as beside
    another sequence that changes every bucket of the grid: rows (2 instead of 1), positions per row
    (a 300-token prefill: 512 instead of 64; a 3-token verification beside a step: 4 instead of 1)
    and keys (512 instead of 256 beside the 300-token sequence)."""
    layout = KVLayout.of(model)
    forward = StaticPass(model, onednn_linear, sequences=4, capacity=1024)
    prompt, steps = _tokens(40, 1), [5, 17, 301, 42]

    def run(beside: list[int] | None) -> list[torch.Tensor]:
        a, b = KVBlock(layout), KVBlock(layout)
        other = [PackedRow(b, beside, 1)] if beside else []
        out = forward([PackedRow(a, prompt, 1), *other])[:1]
        for token in steps:
            other = [PackedRow(b, [token, 7, 8], 3)] if beside else []
            out += forward([*other, PackedRow(a, [token], 1)])[-1:]
            b.length -= 2 if beside else 0
        return out

    alone = run(None)
    for beside in (_tokens(300, 2), _tokens(9, 3)):
        assert all(torch.equal(x, y) for x, y in zip(alone, run(beside)))


@torch.inference_mode()
def test_blocks_keep_their_address_and_take_turns_in_a_small_pool(model):
    """A block moves into the pool once and keeps its address as it grows (a plain KVBlock is
    reallocated every 256 tokens); with more live sequences than slots, the least recently used one
    outside the pass gets its own copy and its results do not change; collected blocks free their slot."""
    layout = KVLayout.of(model)
    small = StaticPass(model, onednn_linear, sequences=2, capacity=1024)
    roomy = StaticPass(model, onednn_linear, sequences=8, capacity=1024)
    results = {}
    for name, forward in (("small", small), ("roomy", roomy)):
        blocks = [KVBlock(layout) for _ in range(3)]
        for i, block in enumerate(blocks):
            forward([PackedRow(block, _tokens(200 + i, 10 + i), 1)])
        address = blocks[0].keys.data_ptr()
        steps = []
        for step in range(4):  # each block in turn, beside another; the first grows past 256 tokens
            first, second = blocks[step % 3], blocks[(step + 1) % 3]
            steps += forward([PackedRow(first, _tokens(30, step), 1), PackedRow(second, [7 + step], 1)])
        if name == "roomy":
            assert blocks[0].keys.data_ptr() == address and blocks[0].length > KVBlock.GROWTH
            # admission control counts a pooled block by its tokens: the pool does not grow with requests
            assert blocks[0].nbytes == blocks[0].length * layout.bytes_per_token
        results[name] = steps
    assert small.pool.evictions > 0 and roomy.pool.evictions == 0
    assert all(torch.equal(s, r) for s, r in zip(results["small"], results["roomy"]))
    gc.collect()
    forward = StaticPass(model, onednn_linear, sequences=1, capacity=1024)
    for seed in range(3):  # one slot, three blocks one after another: each frees it for the next
        forward([PackedRow(KVBlock(layout), _tokens(20, seed), 1)])
    assert forward.pool.evictions == 0


@torch.inference_mode()
def test_a_pass_the_pool_cannot_hold_is_refused_before_it_runs(model):
    layout = KVLayout.of(model)
    forward = StaticPass(model, onednn_linear, sequences=2, capacity=300)
    block = KVBlock(layout)
    forward([PackedRow(block, _tokens(290, 1), 1)])
    with pytest.raises(ValueError, match="301 tokens does not fit the key/value pool's 300"):
        forward([PackedRow(block, _tokens(11, 2), 1)])
    assert block.length == 290  # nothing written
    with pytest.raises(ValueError, match="a pass of 3 sequences does not fit a key/value pool of 2"):
        forward([PackedRow(KVBlock(layout), [1], 1) for _ in range(3)])
    with pytest.raises(ValueError, match="at least one sequence"):
        KVPool(layout, 0, 16)
    with pytest.raises(NotImplementedError, match="CUDA graphs need a CUDA device"):
        StaticPass(model, onednn_linear, graphs=True)


def test_buckets_are_powers_of_two_capped():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert [bucket(n, KEY_BUCKET, 2048) for n in (1, 256, 257, 1500, 5000)] == [256, 256, 512, 2048, 2048]
