"""The target pass on the GGUF file's own blocks (``agentspec.passes.blocks``, ``weights="gguf"``):
the blocks dequantise to the loaded weights bit for bit, the compiled products are row- and
thread-invariant and agree with float32 products, every instruction-set level this CPU runs (an
AVX-512 machine runs the AVX2 levels too) gives the same bits, the pass gives the model's logits,
and it is refused, with a reason, where it cannot run."""

from __future__ import annotations

import dataclasses
import re
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest
import torch

from agentspec.engine import Engine
from agentspec.passes.blocks import BlockPass
from agentspec.passes.layouts import ACTIVATIONS, GGUF_TYPES, INTEGER_OFFSETS, SUPER, Blocks, IntegerLayout, tensor_blocks
from agentspec.passes.levels import ISA_VARIABLE, KERNEL_SOURCE, KERNELS_VARIABLE, LEVEL_NAMES, LEVELS, block_kernels, isa_levels, kernel_flags
from agentspec.passes.products import GGUFBlocks, block_product, blocks_unsupported
from agentspec.passes.threads import controls_openmp, kernel_scope, kernel_threads
from agentspec.passes.fused import FusedPass
from agentspec.engine.kv import KVBlock, KVLayout
from agentspec.passes.packed import PackedRow, check_packed, use_packed_attention
from agentspec.passes.weights import NEAR_TOLERANCE, onednn_linear, pass_layout, select_weights
from agentspec.errors import ModelLoadError

from .conftest import tiny_model


def _reason(loaded, activations: str = "float32") -> str | None:
    return blocks_unsupported(loaded.model, loaded.gguf_file, activations)


@pytest.fixture(scope="module")
def gguf_blocks(loaded):
    if _reason(loaded) is not None:
        pytest.skip(f"the GGUF block pass cannot run here: {_reason(loaded)}")
    return GGUFBlocks(loaded.model, loaded.gguf_file, fallback=onednn_linear)


# Random blocks of each kind the kernels read (BLOCK_TYPES), and of each integer layout the GGUF
# types give them (Blocks.integer_layout): (block type, the codes' range or None for any byte, scales
# that are no float16 values but the K-quants' factors of one), and the layout the integer products
# read them in
SAMPLES = {
    "Q4_1": ("Q4_1", None, False, IntegerLayout("4-bit", True, False)),
    "Q8_0": ("Q8_0", None, False, IntegerLayout("bytes", False, False)),
    "Q8_16": ("Q8_16", None, False, None),  # a scale per 16 on any byte: float32 rows only
    "Q8_1": ("Q8_1", None, False, None),  # unsigned bytes: float32 rows only
    "Q4_0": ("Q8_0", (-8, 7), False, IntegerLayout("4-bit", False, False)),
    "Q5_0": ("Q8_0", (-16, 15), False, IntegerLayout("5-bit", False, False)),
    "Q5_1": ("Q8_1", (0, 31), False, IntegerLayout("5-bit", True, False)),
    "Q4_K": ("Q4_1", None, True, IntegerLayout("4-bit", True, True)),
    "Q5_K": ("Q8_1", (0, 31), True, IntegerLayout("5-bit", True, True)),
    "Q6_K": ("Q8_16", (-32, 31), True, IntegerLayout("6-bit", False, True, True)),
}


def _random_blocks(sample: str, outputs: int, inputs: int, seed: int) -> Blocks:
    kind, codes_range, factored, _ = SAMPLES[sample]
    generator = torch.Generator().manual_seed(seed)
    blocks = inputs // 32
    scales = (torch.rand(outputs, blocks * (2 if kind == "Q8_16" else 1), generator=generator) * 0.02).half().float()
    low, high = codes_range or ((0, 255) if kind in ("Q4_1", "Q8_1") else (-128, 127))
    dtype = torch.uint8 if kind in ("Q4_1", "Q8_1") else torch.int8
    codes = torch.randint(low, high + 1, (outputs, blocks, 16 if kind == "Q4_1" else 32), generator=generator, dtype=dtype)
    if kind in ("Q4_1", "Q8_1"):
        mins = (-torch.rand(outputs, blocks, generator=generator) * 0.1).half().float()
    else:
        mins = torch.zeros(outputs, blocks)
    if not factored:
        return Blocks(kind, codes, scales, mins)
    # as the K-quants': per super-block a float16 scale (and minimum), per block 8-bit factors of them
    # (Q6_K's signed, one per 16 weights; the others' 6-bit), their products no float16 values
    per = 2 if kind == "Q8_16" else 1
    supers = torch.stack([torch.rand(outputs, -(-blocks // SUPER), generator=generator) * 1e-3, -torch.rand(outputs, -(-blocks // SUPER), generator=generator) * 0.01], -1)
    supers = supers[..., : 1 if kind == "Q8_16" else 2].half().float()
    low = -128 if kind == "Q8_16" else 0
    factors = torch.randint(low, low + (256 if kind == "Q8_16" else 64), (outputs, blocks, per + (kind != "Q8_16")), generator=generator, dtype=torch.int8)
    expanded = supers.repeat_interleave(SUPER, dim=1)[:, :blocks]  # [outputs, blocks, 1 or 2]
    scales = (expanded[..., :1] * factors[..., :per].float()).reshape(outputs, -1)
    if kind != "Q8_16":
        mins = expanded[..., 1] * factors[..., per].float()
    return Blocks(kind, codes, scales, mins, factors, supers)


# The largest code of a row's block, and the largest relative error the rounded rows may make in the
# random products below (and the smallest: they were rounded)
TOP_CODE = {"q8": 127.0, "q16": 32639.0}
ERROR = {"q8": (1e-4, 0.02), "q16": (1e-7, 1e-4)}


def _integer_reference(x: torch.Tensor, blocks: Blocks, activations: str) -> torch.Tensor:
    """What the integer products compute (blocks.c), in float64 from exact integer dot products: each
    row quantised per block of 32 (scale max|x| / TOP_CODE, codes rounded to nearest, ties to even;
    "q16" splits them into two planes of bytes, which is exact)."""
    rows, inputs = x.shape
    top_code = TOP_CODE[activations]
    chunks = x.view(rows, inputs // 32, 32)
    top = chunks.abs().amax(-1, keepdim=True)
    inverse = torch.where(top > 0, torch.full_like(top, top_code) / top, torch.zeros_like(top))  # (top_code / top would multiply by a reciprocal)
    scale = torch.where(inverse.isinf(), 0.0, top / top_code)[..., 0].double()  # [rows, blocks]; a block too small for a scale: zeros
    inverse = torch.where(inverse.isinf(), 0.0, inverse)
    codes = torch.round(chunks * inverse).to(torch.int64)  # [rows, blocks, 32]
    weights = blocks.codes.to(torch.int64)
    if blocks.kind == "Q4_1":
        weights = torch.cat([weights & 15, weights >> 4], dim=-1)
    outputs, per = weights.shape[0], 2 if blocks.kind == "Q8_16" else 1  # scales per block
    spans = codes.view(rows, inputs // 32, per, -1), weights.view(outputs, inputs // 32, per, -1)
    dots = torch.einsum("rbhk,obhk->robh", *spans).double()  # [rows, outputs, blocks, per], exact
    scaled = (dots * blocks.scales.double().view(outputs, -1, per)[None]).sum(-1)
    sums = codes.sum(-1).double()
    products = scaled * scale[:, None] + blocks.mins.double()[None] * (scale * sums)[:, None]
    return products.sum(-1)


@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("kind", SAMPLES)
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (576, 1003)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_block_products_are_row_and_thread_invariant(loaded, gguf_blocks, kind, shape, activations):
    """A row's result is the same bits alone, as the k-th of up to 70 rows (tiles of 8 and their
    remainders), moved, or computed on another number of threads; and it is the float32 product of
    the dequantised weights up to the order of its sums — or, on rows quantised to 8 or 16 bits
    ("q8", "q16"), the exact integer products scaled, up to float32 rounding."""
    inputs, outputs = shape  # 1003 outputs: an odd last tile
    blocks = _random_blocks(kind, outputs, inputs, seed=outputs)
    if SAMPLES[kind][-1] is None and activations != "float32":
        with pytest.raises(NotImplementedError, match="up to 6 bits" if kind == "Q8_16" else "up to 5 bits"):
            block_product(blocks, activations=activations)
        return
    product = block_product(blocks, activations=activations)
    x = torch.randn(70, inputs, generator=torch.Generator().manual_seed(1))
    x[3, 64:96] = 0  # a block of zeros: scale 0
    x[5] = 0  # a row of zeros but a block too small for a scale (1e-37 / 127 is no float): zeros too
    x[5, 130] = 1e-37
    everything = product(x)
    if activations == "float32":
        torch.testing.assert_close(everything, x @ blocks.dequantised().T, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(everything.double(), _integer_reference(x, blocks, activations), rtol=1e-5, atol=1e-4)
        exact = (x.double() @ blocks.dequantised().double().T).float()
        low, high = ERROR[activations]
        assert low < (everything - exact).abs().max() / exact.abs().max() < high  # the rows were rounded, not by much
    alone = torch.cat([product(x[i : i + 1]) for i in range(70)])
    assert torch.equal(alone, everything)
    for rows in (2, 7, 8, 9, 17, 64, 65):
        assert torch.equal(product(x[70 - rows :]), everything[70 - rows :]), rows
    threads = torch.get_num_threads()
    try:
        for count in (1, threads + 1, threads):  # more threads than cores; then fewer than the workers made
            torch.set_num_threads(count)
            assert torch.equal(product(x), everything), count
    finally:
        torch.set_num_threads(threads)
    assert product(x[:0]).shape == (0, outputs)


@pytest.mark.parametrize("activations", ["float32", "q16"])
def test_the_kernels_threads_serve_concurrent_callers_and_a_forked_child(activations):
    """A pass's threads are the kernels' own (blocks.c: run_threads): products called from four
    threads at once (one holds the workers, the others run on their own thread) and in a child
    forked after the workers ran (it makes its own) give the bits of one call alone."""
    blocks = _random_blocks("Q4_K" if activations == "q16" else "Q4_1", 1536, 576, seed=7)
    product = block_product(blocks, activations=activations)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(2))
    expected = product(x)
    with ThreadPoolExecutor(4) as callers:
        results = list(callers.map(lambda _: [product(x) for _ in range(25)], range(4)))
    assert all(torch.equal(result, expected) for batch in results for result in batch)
    child = os.fork()
    if child == 0:  # the child: its exit status says whether its products agreed
        same = False
        try:
            same = all(torch.equal(product(x), expected) for _ in range(3))
        finally:
            os._exit(0 if same else 1)
    deadline = time.monotonic() + 120
    while (done := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        pytest.fail("a forked child's product did not return in 120 s")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_a_kernel_scope_runs_torch_on_its_thread_alone_and_the_kernels_on_the_threads_it_had():
    """passes.threads.kernel_scope (an engine's steps on a GGUF pass): within it, torch's thread
    count for the calling thread is 1 (its operations wake no OpenMP team to spin on the kernels'
    cores), the kernels' is the count it had, another thread's is untouched, a nested scope is the
    outer one; on leaving, the count is back; a product within gives the bits of one outside."""
    assert "OpenMP" not in torch.__config__.parallel_info() or controls_openmp()  # torch's wheels for Linux: libgomp
    before = torch.get_num_threads()
    product = block_product(_random_blocks("Q4_K", 512, 576, seed=3), activations="q16")
    x = torch.randn(6, 576, generator=torch.Generator().manual_seed(4))
    expected = product(x)
    with kernel_scope():
        assert kernel_threads() == before and torch.get_num_threads() == (1 if controls_openmp() else before)
        with ThreadPoolExecutor(1) as other:
            assert other.submit(torch.get_num_threads).result() == before
        with kernel_scope():
            assert kernel_threads() == before
        assert torch.get_num_threads() == (1 if controls_openmp() else before)
        assert torch.equal(product(x), expected)
    assert torch.get_num_threads() == before and kernel_threads() == before


# Bytes per 256 weights of an output, per GGUF type the samples stand for: the file's (GGUF_TYPES),
# but for Q4_K's and Q5_K's scales and minimums, a byte each where the file packs them in 6 bits
LANES_BYTES = {"Q4_0": 144, "Q5_0": 176, "Q8_0": 272, "Q4_1": 160, "Q5_1": 192, "Q4_K": 148, "Q5_K": 180, "Q6_K": 210}


@pytest.mark.parametrize("kind", [k for k, sample in SAMPLES.items() if sample[-1] is not None])
def test_the_integer_products_read_each_type_in_its_own_bits(kind):
    """Q4_0's and Q5_0's codes (read as Q8_0's signed bytes) go back to 4 and 5 bits, Q5_1's and
    Q5_K's (read as Q8_1's unsigned bytes) to 5, Q6_K's (Q8_16's) to 6, so a block takes the file's
    bytes again (the K-quants' 6-bit factors in bytes aside); Q8_0 blocks with one code outside 5 bits
    are read as bytes, Q8_16 blocks with one outside 6 bits are refused, and so are blocks whose scales
    are no float16 values without a K-quant's factors."""
    blocks = _random_blocks(kind, 40, 256, seed=3)
    assert blocks.integer_layout() == SAMPLES[kind][-1]
    for lanes in (4, 8, 16):  # NEON, AVX2, AVX-512
        assert blocks.by_lanes(lanes).numel() == -(-40 // lanes) * lanes * LANES_BYTES[kind]
    if blocks.factors is not None:
        unfactored = Blocks(blocks.kind, blocks.codes, blocks.scales, blocks.mins)
        assert "8-bit factors" in unfactored.integer_unsupported()
    if blocks.kind == "Q8_0" and kind != "Q8_0":
        codes = blocks.codes.clone()
        codes[7, 3, 9] = INTEGER_OFFSETS["5-bit"]  # one code too many for 5 bits
        assert Blocks("Q8_0", codes, blocks.scales, blocks.mins).integer_layout() == IntegerLayout("bytes", False, False)
    if blocks.kind == "Q8_16":
        codes = blocks.codes.clone()
        codes[7, 3, 9] = INTEGER_OFFSETS["6-bit"]
        assert "span -32..32" in Blocks("Q8_16", codes, blocks.scales, blocks.mins).integer_unsupported()


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_0"])
@pytest.mark.parametrize("activations", ["q8", "q16"])
def test_4_and_5_bit_codes_give_the_bits_of_the_same_codes_as_bytes(gguf_blocks, kind, activations):
    """sum((q + offset) a) - offset sum(a) is sum(q a), exactly: the same blocks read in 4 or 5 bits
    and as bytes (stacked with an output whose code needs a byte) give the same bits."""
    blocks = _random_blocks(kind, 50, 576, seed=4)
    outlier = _random_blocks("Q8_0", 1, 576, seed=5)
    stacked = Blocks.stack([blocks, outlier])
    assert stacked.integer_layout().codes == "bytes"
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(6))
    assert torch.equal(block_product(stacked, activations=activations)(x)[:, :50], block_product(blocks, activations=activations)(x))


@pytest.fixture(scope="module")
def levels(gguf_blocks) -> list[str]:
    """The instruction-set levels whose kernels run here, fastest first (the default is the first)."""
    found = isa_levels()
    assert found and found[0] == gguf_blocks.kernels.isa
    if "avx512-vnni" in found:  # an AVX-512 machine builds and runs every x86 level below its own
        x86 = [level.name for level in LEVELS if level.arch == "x86_64"]
        assert found == x86[x86.index(found[0]) :]
    return found


@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("kind", SAMPLES)
def test_every_level_this_cpu_runs_gives_the_same_bits(levels, kind, activations):
    """The kernels of every level (AVX-512 with and without VNNI, AVX2 with and without VNNI) compute
    the same bits as the fastest level's: 16 logical float lanes with one fixed summing tree, and
    exact integer dot products. With the fastest level's products row-invariant (above), so is each
    level's: a row alone, in a tile's remainder or among 70 gives the fastest level's bits."""
    if SAMPLES[kind][-1] is None and activations != "float32":
        return  # refused (above)
    blocks = _random_blocks(kind, 200, 1536, seed=5)  # 200 outputs: a last register of 8 lanes, not 16
    x = torch.randn(70, 1536, generator=torch.Generator().manual_seed(2))
    x[4, :32] = 0
    reference = block_product(blocks, block_kernels(levels[0]), activations)(x)
    for level in levels[1:]:
        product = block_product(blocks, block_kernels(level), activations)
        assert torch.equal(product(x), reference), level
        for rows in (1, 3, 9):
            assert torch.equal(product(x[10 : 10 + rows]), reference[10 : 10 + rows]), (level, rows)


@pytest.mark.parametrize("weights", ["gguf", "gguf-q16"])
@torch.inference_mode()
def test_the_compiled_layers_give_the_same_logits_on_every_level(loaded, levels, weights):
    """The whole pass (norms, rotary embedding, attention over float32 or float16 keys and values,
    SiLU, the products) gives the same logits, bit for bit, on every level this CPU runs, for a
    prompt and then a pass of 8 positions over its keys and values."""
    model, layout = loaded.model, KVLayout.of(loaded.model)
    activations = {"gguf": "float32", "gguf-q16": "q16"}[weights]
    read = GGUFBlocks(model, loaded.gguf_file, fallback=onednn_linear, isa=levels[0]).blocks
    ids = loaded.chat.encode([{"role": "user", "content": "Name three rivers of Europe and say which is longest."}])
    logits = {}
    for level in levels:
        forward = BlockPass(model, GGUFBlocks(model, loaded.gguf_file, onednn_linear, activations, blocks=read, isa=level))
        block = KVBlock(pass_layout(layout, forward))
        logits[level] = torch.cat([forward([PackedRow(block, ids[:-8], len(ids) - 8)])[0], forward([PackedRow(block, ids[-8:], 8)])[0]])
    for level in levels[1:]:
        assert torch.equal(logits[level], logits[levels[0]]), level


CHECK_SOURCE = Path(__file__).with_name("kernels_check.c")


def _kernels_check(compiler: str, flags: Sequence[str], out: Path) -> list[str]:
    """tests/kernels_check.c linked with blocks.c, built with ``flags`` and run."""
    built = subprocess.run([compiler, *flags, str(KERNEL_SOURCE), str(CHECK_SOURCE), "-lm", "-o", str(out)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    done = subprocess.run([str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
    return done.stdout.splitlines()


def test_the_kernels_give_the_same_bits_on_every_level(levels, tmp_path):
    """A C driver of the kernels (tests/kernels_check.c: products of every block type on float32 rows
    and of every integer layout (bytes, 4-, 5- and 6-bit codes, float16 and factored scales) on 8- and
    16-bit rows against plain references, row and thread invariance, the decoder layers of a
    tiny random model on both caches, a sequence alone against two in a pass, the repacker's layouts of
    random rows of each GGUF type under a product) passes on every level this CPU runs, built from
    the source for this CPU, and all print the same hashes of their results' bits. (ARM NEON, built
    with Debian's cross compiler into an aarch64 wheel and run under qemu-user, and clang's builds:
    tests/test_wheel.py.)"""
    compiler = os.environ.get("CC") or shutil.which("cc") or "gcc"
    printed = {level: _kernels_check(compiler, kernel_flags(level), tmp_path / level) for level in levels}
    # products, layers (two rows, three caches), the repacker's (a GGUF type each), "ok"
    assert len(next(iter(printed.values()))) == 4 + 2 * 8 + 2 * 3 + 8 + 1
    for level, lines in printed.items():
        assert lines == printed[levels[0]], level


def test_the_level_is_capped_by_the_environment_and_named_levels_are_checked(levels):
    """``$AGENTSPEC_ISA`` caps the level "auto" builds on (how an AVX-512 machine runs the AVX2
    kernels end to end); a level that is not one is refused with the list of levels."""
    probe = "from agentspec.passes.levels import kernels_or_reason; k = kernels_or_reason(); print(k if isinstance(k, str) else k.isa)"
    for cap in (levels[-1], "avx9000"):
        done = subprocess.run([sys.executable, "-c", probe], env={**os.environ, ISA_VARIABLE: cap}, capture_output=True, text=True, timeout=300)
        if cap in levels:
            assert done.stdout.strip() == cap, done.stdout + done.stderr
        else:
            assert f"{ISA_VARIABLE}='avx9000' is not a level; use one of {', '.join(LEVEL_NAMES)}" in done.stdout
    with pytest.raises(NotImplementedError, match="unknown instruction-set level 'sse2'"):
        block_kernels("sse2")


def _random_tensor(kind: str, outputs: int, inputs: int, seed: int) -> np.ndarray:
    """A GGUF tensor's bytes of type ``kind``: random codes and 6-bit or 8-bit sub-scales, float16
    scales (and minimums) of sane sizes, positive and negative (gguf-py quantises only some types)."""
    size, width = GGUF_TYPES[kind]
    generator = np.random.default_rng(seed)
    raw = generator.integers(0, 256, (outputs, inputs // size, width), dtype=np.uint8)
    halves = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[kind]
    for at in halves:
        values = (generator.standard_normal((outputs, inputs // size)) * 0.01).astype(np.float16)
        raw[..., at : at + 2] = values.view(np.uint8).reshape(outputs, -1, 2)
    return raw.reshape(outputs, -1)


@pytest.mark.parametrize("kind", list(GGUF_TYPES))
def test_each_gguf_type_is_read_as_the_gguf_reader_dequantises_it(kind):
    """Every type the kernels read (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and the K-quants of Q4_K_M and
    Q5_K_M files: Q4_K, Q5_K, Q6_K) becomes blocks whose float32 weights are gguf-py's
    dequantisation, bit for bit — the weights transformers loads — and the compiled products of those
    blocks agree with them."""
    import gguf

    raw = _random_tensor(kind, 40, 512, seed=len(kind) + ord(kind[1]))
    blocks = tensor_blocks(kind, raw)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(40, 512).astype(np.float32))
    assert blocks.shape == (40, 512)
    assert torch.equal(blocks.dequantised(), expected)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(block_product(blocks)(x), x @ expected.T, rtol=1e-5, atol=1e-4)
    assert tensor_blocks("Q3_K", raw) is None  # not read: oneDNN's float32 products take it


def test_default_models_blocks_are_its_weights(loaded, gguf_blocks):
    """Every linear weight of the default model has blocks (Q4_1; the tied LM head Q8_0) that
    dequantise to it bit for bit — GGUFBlocks refuses the file otherwise — in a fifth of the bytes."""
    model = loaded.model
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(gguf_blocks.blocks) == len(linears) == 30 * 7 + 1
    assert gguf_blocks.kinds == ["Q4_1", "Q8_0"]
    float_bytes = sum(w.numel() * 4 for w in linears)
    assert gguf_blocks.nbytes < float_bytes / 4, (gguf_blocks.nbytes, float_bytes)
    q = model.model.layers[3].self_attn.q_proj.weight  # rows llama.cpp's converter reordered
    assert torch.equal(gguf_blocks.blocks[id(q)].dequantised(), q.detach())


def test_blocks_of_another_model_are_refused(loaded):
    """A file whose tensors are not the loaded weights (here: the default file against a tiny model
    of another shape) is refused before anything runs."""
    if _reason(loaded) is not None:
        pytest.skip(f"the GGUF block pass cannot run here: {_reason(loaded)}")
    tiny = tiny_model(loaded, seed=7)
    with pytest.raises(NotImplementedError, match="does not dequantise to the loaded weight"):
        GGUFBlocks(tiny.model, loaded.gguf_file, fallback=onednn_linear)


def test_gguf_pass_is_refused_with_a_reason_where_it_cannot_run(loaded):
    tiny = tiny_model(loaded, seed=8)  # built in memory: no file
    assert blocks_unsupported(tiny.model, None) == "the model was not read from a GGUF file"
    with pytest.raises(ModelLoadError, match="weights='gguf' cannot run here: the model was not read from a GGUF file"):
        Engine(tiny, weights="gguf")
    half = dataclasses.replace(tiny.with_model(tiny.model.to(torch.bfloat16), dtype=torch.bfloat16), gguf_file=loaded.gguf_file)
    assert "float32 rows on a CPU" in blocks_unsupported(half.model, half.gguf_file)


@torch.inference_mode()
def test_gguf_pass_gives_the_models_logits(loaded, gguf_blocks):
    """The pass on the blocks is the loaded model to float32 rounding (the same weights; the sums in
    another order), so ``"auto"`` may pick it; the greedy choice matches the fused pass's on a real
    prompt."""
    model, layout = loaded.model, KVLayout.of(loaded.model)
    use_packed_attention(model)
    chosen = select_weights(model, layout, "gguf", loaded.gguf_file)
    assert chosen.name == "gguf" and chosen.tolerance is None
    assert check_packed(model, layout, forward=chosen.forward) <= 1e-3
    assert isinstance(chosen.forward, BlockPass)  # every layer product of the default model has blocks
    ids = loaded.chat.encode([{"role": "user", "content": "Explain in two sentences why the sky is blue."}])
    on_blocks = chosen.forward([PackedRow(KVBlock(layout), ids, len(ids))])[0]
    fused = select_weights(model, layout, "fused").forward([PackedRow(KVBlock(layout), ids, len(ids))])[0]
    in_python = FusedPass(model, gguf_blocks.linear)([PackedRow(KVBlock(layout), ids, len(ids))])[0]
    for other in (fused, in_python):  # the compiled layers against the same operations from Python
        assert (on_blocks - other).abs().max().item() < 1e-3
        assert torch.equal(on_blocks.argmax(-1), other.argmax(-1))


@pytest.mark.parametrize("weights", ["gguf", "gguf-q16"])
@torch.inference_mode()
def test_the_compiled_layers_store_keys_and_values_as_their_pass_names(loaded, gguf_blocks, weights):
    """A pass on integer rows stores values as float16 (half the bytes its attention streams) and,
    for a model without large key biases like the default one, keys too; one on float32 rows stores
    both as float32; an engine's cache is what its pass names. Float16 storage of either moves the
    logits (it is not ignored) by less than the pass's own tolerance; blocks of two pairs of dtypes
    in one pass are refused."""
    if weights == "gguf-q16" and _reason(loaded, "q16"):
        pytest.skip(f"gguf-q16 cannot run here: {_reason(loaded, 'q16')}")
    model, layout = loaded.model, KVLayout.of(loaded.model)
    forward = select_weights(model, layout, weights, loaded.gguf_file).forward
    expected = (torch.float16,) * 2 if weights == "gguf-q16" else (torch.float32,) * 2
    assert forward.kv_dtypes == expected and pass_layout(layout, forward).dtypes == expected
    assert pass_layout(layout, forward).bytes_per_token * layout.dtype.itemsize == layout.bytes_per_token * expected[0].itemsize
    ids = loaded.chat.encode([{"role": "user", "content": "Explain in two sentences why the sky is blue."}])
    pairs = [(torch.float32, torch.float32), (torch.float32, torch.float16), (torch.float16, torch.float16)]
    single, mixed, half = (forward([PackedRow(KVBlock(layout.with_dtype(*pair)), ids, len(ids))])[0] for pair in pairs)
    for other in (mixed, half):
        difference = (single - other).abs().max().item()
        assert 0 < difference < NEAR_TOLERANCE, difference
        assert torch.equal(single.argmax(-1), other.argmax(-1))
    assert KVLayout.with_dtype(layout, torch.float32, torch.float16).bytes_per_token == layout.bytes_per_token * 3 // 4
    a, b = KVBlock(layout), KVBlock(layout.with_dtype(torch.float32, torch.float16))
    with pytest.raises(ValueError, match="one pair of dtypes .* not float32 keys with float16 values, float32 keys with float32 values"):
        forward([PackedRow(a, [5, 6], 1), PackedRow(b, [7, 8], 1)])
    target = Engine(loaded, weights=weights)
    assert target.layout.dtypes == expected


def test_kernels_are_built_once_into_the_cache_and_refused_without_a_compiler(tmp_path):
    """Asked to compile (``AGENTSPEC_KERNELS=compile``, a developer's override of the package's
    libraries), first use compiles the kernels into ``$AGENTSPEC_CACHE_DIR/kernels`` (the next
    process reuses the library); without a working compiler the pass says why instead."""
    probe = "from agentspec.passes.levels import kernels_or_reason; r = kernels_or_reason(); print(r if isinstance(r, str) else 'built')"
    env = {**os.environ, "AGENTSPEC_CACHE_DIR": str(tmp_path), KERNELS_VARIABLE: "compile"}
    first = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    if first.stdout.strip() != "built":
        pytest.skip(f"the block kernels do not build on this machine: {first.stdout.strip() or first.stderr[-300:]}")
    libraries = list(Path(tmp_path, "kernels").glob("blocks-*.so"))  # the default level's
    assert len(libraries) == 1
    built_at = libraries[0].stat().st_mtime_ns
    again = subprocess.run([sys.executable, "-c", probe], env={**env, "CC": "/nonexistent/cc"}, capture_output=True, text=True, timeout=300)
    # another compiler is another key: without one that runs, the pass is refused with the reason
    assert "does not run" in again.stdout, again.stdout + again.stderr
    assert libraries[0].stat().st_mtime_ns == built_at
    reused = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert reused.stdout.strip() == "built" and list(Path(tmp_path, "kernels").glob("blocks-*.so")) == libraries
    assert libraries[0].stat().st_mtime_ns == built_at  # reused, not rebuilt


def _exact_scales(raw: np.ndarray, kind: str) -> np.ndarray:
    """``raw`` with every float16 scale (and minimum) a power of two, so that a K-quant's scale times its
    6-bit factor is itself a float16 value (the layout keeps float16 scales, not factors)."""
    halves = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}.get(kind, [])
    blocks = raw.reshape(raw.shape[0], -1, GGUF_TYPES[kind][1]).copy()
    for at in halves:
        blocks[..., at : at + 2] = np.full(blocks.shape[:2], 2.0**-9, np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(raw.shape[0], -1)


@pytest.mark.parametrize("kind", list(GGUF_TYPES))
def test_the_kernels_lay_out_a_files_blocks_as_the_blocks_lay_out(levels, kind, tmp_path, monkeypatch):
    """``FileRun``: the compiled repacker (blocks.c: agentspec_gguf_by_lanes) lays a mapped file's rows
    out for the integer products in the bytes ``Blocks.by_lanes`` gives of ``tensor_blocks``, in the
    layout they choose, on every level's lanes: random codes (read once: the first run is laid out in
    the layout of its type's whole range as it is read); codes that fit fewer bits and scales that are
    float16 values in the first runs and not in a later one (the build starts in the type's layout, again
    in the narrower one, then again in the wider one, no run read only for its statistics); llama.cpp's
    interleaved rotary halves undone; and a product whose parts are two types."""
    import gguf

    from agentspec.gguf import read_gguf
    from agentspec.passes.layouts import FileBlocks, FileRun, by_lanes_of_runs

    monkeypatch.setattr("agentspec.passes.layouts.RUN_WEIGHTS", 64 * 512)  # runs of 64 rows
    generator = np.random.default_rng(len(kind))
    narrow = _exact_scales(_random_tensor(kind, 192, 512, seed=7), kind)
    if kind == "Q8_0":  # codes of 4 bits, then one row of bytes in the third run
        codes = narrow.reshape(192, -1, 34)[..., 2:]
        codes[...] = (generator.integers(-8, 8, codes.shape).astype(np.int8)).view(np.uint8)
        codes[150, 3, 5] = 100
    else:  # float16 scales, then one super-block of another scale in the third run
        narrow[150] = _random_tensor(kind, 1, 512, seed=8)[0]
    other = "Q4_1" if GGUF_TYPES[kind][0] == 256 and kind != "Q6_K" else ("Q5_0" if kind == "Q8_0" else kind)
    tensors = {"random": _random_tensor(kind, 200, 512, seed=6), "narrow": narrow, "rotary": _random_tensor(kind, 192, 512, seed=9), "other": _random_tensor(other, 64, 512, seed=10)}
    writer = gguf.GGUFWriter(str(tmp_path / "blocks.gguf"), "llama")
    for name, raw in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind if name != "other" else other])
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    file = read_gguf(tmp_path / "blocks.gguf")
    cases = [[FileBlocks(file.tensors["random"])], [FileBlocks(file.tensors["narrow"])], [FileBlocks(file.tensors["rotary"], heads=6)]]
    if FileBlocks(file.tensors["other"]).kind == FileBlocks(file.tensors["random"]).kind:
        cases.append([FileBlocks(file.tensors["narrow"]), FileBlocks(file.tensors["other"])])
    for level in levels:
        kernels = block_kernels(level)
        for parts in cases:
            try:
                expected, layout = by_lanes_of_runs(parts, kernels.lanes)
            except NotImplementedError as refused:
                with pytest.raises(NotImplementedError, match=re.escape(str(refused))):
                    by_lanes_of_runs(parts, kernels.lanes, kernels)
                continue
            laid_out, chosen = by_lanes_of_runs(parts, kernels.lanes, kernels)
            assert chosen == layout and laid_out.shape == expected.shape and torch.equal(laid_out, expected), (level, layout, len(parts))
            # what a run finds on the way (the layouts Q4_K_M files mostly take have their own paths) is what the statistics pass finds
            run = FileRun([(part, 0, part.shape[0]) for part in parts], kernels)
            assert run.by_lanes_and_statistics(kernels.lanes, layout)[1] == run.code_statistics(), (level, layout, len(parts))
    if kind in ("Q8_0", "Q4_K", "Q5_K"):  # the third run needed a wider layout than the first two: the build started again
        first_runs = tensor_blocks(kind, narrow[:128]).integer_layout()
        assert first_runs != by_lanes_of_runs([FileBlocks(file.tensors["narrow"])], kernels.lanes, kernels)[1]
    # every run is laid out as it is read, no statistics pass: the first in its type's layout, or after
    # a restart in the one the runs read so far want
    statistics_passes = []
    monkeypatch.setattr(FileRun, "code_statistics", lambda run: statistics_passes.append(run) or pytest.fail("a statistics pass"))
    for parts in cases:
        try:
            expected = by_lanes_of_runs(parts, kernels.lanes)[0]
        except NotImplementedError:
            continue
        assert torch.equal(by_lanes_of_runs(parts, kernels.lanes, kernels)[0], expected)
    assert not statistics_passes
