"""The compiled kernels fail safe (issue 50, native code): a product or a pass whose working memory
cannot be had raises ``MemoryError`` and the process goes on, its next pass giving the same logits
as before; an unknown layout is a ``ValueError``, never an ``abort()``; a buffer smaller than the
counts declared with it, or of another dtype or layout, is refused with ``ValueError`` before the
kernels run; counts the kernels do not take are refused by the C side too.

Allocation failures are real: the child process caps its address space (``RLIMIT_AS``) just above
what it uses, then asks for a product or a pass whose working memory does not fit under the cap. Each
runs in a child process so that a crash would show as its exit status."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from unittest import mock

import numpy as np
import pytest
import torch

from agentspec.engine.kv import KVBlock, KVLayout
from agentspec.passes.blocks import BlockPass
from agentspec.passes.layouts import Blocks
from agentspec.passes.levels import address, block_kernels, kernels_or_reason
from agentspec.passes.packed import Segment
from agentspec.passes.products import BlockProduct, GGUFBlocks
from agentspec.passes.weights import onednn_linear

pytestmark = pytest.mark.skipif(isinstance(kernels_or_reason(), str), reason="the block kernels do not run here")

# The child's address space: capped at what it uses plus this much (enough for the Python side of the
# call, far less than its working memory), then uncapped again.
CAPPED = """
import resource

def used() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024

def capped(call, spare: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (used() + spare, hard))
    try:
        return call()
    except MemoryError as exc:
        print("MemoryError:", exc, flush=True)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
"""

# A product on 8-bit rows (its working memory: the rows quantised, ~2.5 bytes an input) of 16 outputs
PRODUCT = """
import functools, torch
from agentspec.passes.layouts import Blocks
from agentspec.passes.products import BlockProduct

generator = torch.Generator().manual_seed(0)
inputs = 4096
codes = torch.randint(-128, 128, (16, inputs // 32, 32), generator=generator, dtype=torch.int8)
blocks = Blocks("Q8_0", codes, (torch.rand(16, inputs // 32, generator=generator) * 0.02).half().float(), torch.zeros(16, inputs // 32))
product = BlockProduct(blocks, activations="q8")
rows = torch.randn(4096, inputs, generator=generator)  # 64 MiB of rows; their working memory: 25 MiB or more
before = product(rows[:3])
"""


def _child(script: str) -> str:
    """``script`` run by a new Python; its output, after checking it exited cleanly (a crash or an
    abort is a negative status)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=600, env=os.environ)
    assert done.returncode == 0, f"exit status {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    return done.stdout


def test_a_product_that_cannot_get_its_working_memory_raises_memory_error_and_the_process_goes_on():
    out = _child(CAPPED + PRODUCT + """
capped(lambda: product(rows), spare=8 << 20)
print("same:", torch.equal(product(rows[:3]), before), torch.equal(product(rows)[:3], before))
""")
    assert "MemoryError: agentspec_int_product(layout=0, M=4096, K=4096, N=16, threads=" in out, out
    assert "bytes of working memory" in out and "same: True True" in out, out


def test_an_unknown_layout_is_a_value_error_not_an_abort():
    out = _child(PRODUCT + """
product.function = functools.partial(product.function.func, 999)
try:
    product(rows[:3])
except ValueError as exc:
    print("ValueError:", exc)
""")
    assert "ValueError: agentspec_int_product: the kernels have no integer layout numbered 999" in out, out


# The default model's compiled pass: a prompt's logits; a pass of 2,000 tokens under a cap (its
# working memory: ~100 MB, mostly attention's scores), with its block zeroed; a layer's blocks of an
# unknown layout; the prompt's logits again.
PASS = """
import torch
from agentspec.engine.kv import KVBlock, KVLayout
from agentspec.model import load_model
from agentspec.passes.blocks import BlockPass
from agentspec.passes.levels import INTEGER_KIND
from agentspec.passes.packed import PackedRow, pack_rows
from agentspec.passes.products import GGUFBlocks
from agentspec.passes.weights import onednn_linear

loaded = load_model()
model, layout = loaded.model, KVLayout.of(loaded.model)
forward = BlockPass(model, GGUFBlocks(model, loaded.gguf_file, fallback=onednn_linear))
ids = loaded.chat.encode([{"role": "user", "content": "Why is the sky blue?"}])
prompt = lambda: forward([PackedRow(KVBlock(layout), ids, len(ids))])[0]
before = prompt()
tokens, block = 2000, KVBlock(layout)
block.reserve(tokens)
block.keys.zero_(), block.values.zero_()
inputs = pack_rows([PackedRow(block, list(range(100, 100 + tokens)), 1)], forward.heads // forward.kv_heads)
hidden = forward.embeddings(inputs.input_ids[0])
rotations = forward.rotations(hidden, inputs.position_ids)
capped(lambda: forward.decoder_layers(hidden, rotations, inputs.segments), spare=2 * hidden.nbytes + (16 << 20))
print("block untouched:", int(block.keys.count_nonzero()) == 0 and int(block.values.count_nonzero()) == 0)
kind = forward.layer_args[3].down.kind
forward.layer_args[3].down.kind = INTEGER_KIND + 999
try:
    prompt()
except ValueError as exc:
    print("ValueError:", exc)
forward.layer_args[3].down.kind = kind
print("same:", torch.equal(prompt(), before))
"""


@pytest.fixture(scope="module")
def compiled_pass_output() -> str:
    return _child(CAPPED + PASS)


def test_a_pass_that_cannot_get_its_working_memory_raises_memory_error_and_changes_nothing(compiled_pass_output):
    out = compiled_pass_output
    assert "MemoryError: agentspec_layers(T=2000, H=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, layers=30" in out, out
    assert "block untouched: True" in out and "same: True" in out, out


def test_a_layers_blocks_of_an_unknown_layout_are_a_value_error_not_an_abort(compiled_pass_output):
    assert "ValueError: agentspec_layers(T=" in compiled_pass_output
    assert "a layer's blocks are of a kind the kernels do not have (kinds [0, 1003]" in compiled_pass_output


def test_the_boundary_takes_only_buffers_as_large_as_their_counts():
    """``address``: the dtype, one contiguous run on the CPU, at least the count (torch and numpy)."""
    floats = torch.zeros(4, 8)
    assert address(floats, 32, (torch.float32,), "x") == floats.data_ptr()
    assert address(np.zeros(3, np.int32), 3, (np.int32,), "types") > 0
    refused = [
        (floats, 33, (torch.float32,), "the kernels read 33 float32 elements in one contiguous run on the CPU from it, and it is 32 float32 elements on cpu"),
        (floats.T, 32, (torch.float32,), "32 float32 elements, not contiguous on cpu"),
        (floats.double(), 32, (torch.float32,), "32 float64 elements on cpu"),
        (np.zeros(3, np.int64), 3, (np.int32,), "3 int64 elements on cpu"),
    ]
    for array, count, dtypes, message in refused:
        with pytest.raises(ValueError, match=f"^x: .*{message}"):
            address(array, count, dtypes, "x")


@pytest.mark.parametrize("activations", ["float32", "q8"])
def test_a_products_blocks_smaller_than_its_shape_are_refused_before_the_kernels_run(activations):
    generator = torch.Generator().manual_seed(1)
    codes = torch.randint(-8, 8, (40, 4, 32), generator=generator, dtype=torch.int8)
    product = BlockProduct(Blocks("Q8_0", codes, torch.full((40, 4), 2.0**-7), torch.zeros(40, 4)), activations=activations)
    rows = torch.randn(3, 128, generator=generator)
    expected = product(rows)
    product.function = mock.Mock(side_effect=product.function)
    for name in ("few", "many") if activations == "float32" else ("few",):
        whole = getattr(product, name)
        setattr(product, name, whole[:-1])  # a group of outputs short
        with pytest.raises(ValueError, match="^the product's blocks: the kernels read"):
            product(rows)
        setattr(product, name, whole.transpose(0, 1))  # all of it, in another order
        with pytest.raises(ValueError, match="not contiguous"):
            product(rows)
        setattr(product, name, whole)
    assert product.function.call_count == 0
    assert torch.equal(product(rows), expected)


def test_counts_the_kernels_do_not_take_are_refused_by_the_c_side():
    """What the Python side does not check, blocks.c does: inputs that are no whole blocks, no rows,
    no threads (a ``ValueError`` naming the counts, nothing written)."""
    kernels = block_kernels()
    x, w, y = torch.zeros(64), torch.zeros(4096, dtype=torch.uint8), torch.full((16,), 7.0)
    for rows, inputs, threads in [(1, 48, 1), (-1, 64, 1), (1, 64, 0)]:
        with pytest.raises(ValueError, match=rf"agentspec_q8_0_product\(M={rows}, K={inputs}, N=16, threads={threads}\): the kernels refused"):
            kernels.agentspec_q8_0_product(x.data_ptr(), rows, inputs, w.data_ptr(), w.data_ptr(), y.data_ptr(), 16, threads)
    assert torch.equal(y, torch.full((16,), 7.0))


@pytest.fixture(scope="module")
def block_pass(loaded) -> BlockPass:
    return BlockPass(loaded.model, GGUFBlocks(loaded.model, loaded.gguf_file, fallback=onednn_linear))


def test_a_passs_buffers_smaller_than_their_shapes_are_refused_before_the_kernels_run(loaded, block_pass):
    """A sequence whose new tokens overrun its block, keys of another shape or dtype, hidden states
    of another width, angles for fewer tokens: each a ``ValueError``, the compiled layers never
    called."""
    forward, layout = block_pass, KVLayout.of(loaded.model)
    groups = forward.heads // forward.kv_heads
    hidden = torch.randn(8, forward.hidden)
    rotations = forward.rotations(hidden, torch.arange(250, 258)[None])
    function, forward.function = forward.function, mock.Mock()
    try:

        def refused(block: KVBlock, message: str, hidden: torch.Tensor = hidden, rotations=rotations) -> None:
            with pytest.raises(ValueError, match=message):
                forward.decoder_layers(hidden, rotations, [Segment(block, 0, 8, groups)])

        block = KVBlock(layout)
        block.reserve(4)  # room for 256
        block.length = 250
        refused(block, r"a sequence's tokens 0..8 of a pass of 8, after 250, do not fit its block of 256")
        block.length = 0
        keys = block.keys
        block.keys = keys[:, :, :128]
        refused(block, r"a sequence's keys and values are \(30, 3, 128, 64\), \(30, 3, 256, 64\); the compiled layers take \(30, 3, 128, 64\)")
        block.keys = keys.transpose(2, 3).contiguous().transpose(2, 3)  # the layers' shape, another layout
        refused(block, "a sequence's keys: .* not contiguous")
        block.keys = keys.double()
        refused(block, "one pair of dtypes")
        block.keys = keys
        refused(block, r"hidden states \[T, 576\]", hidden=torch.randn(8, 512))
        refused(block, r"rotary angles \[1, T, dims\]", rotations={k: (c[:4], s[:4]) for k, (c, s) in rotations.items()})
        assert forward.function.call_count == 0
    finally:
        forward.function = function
