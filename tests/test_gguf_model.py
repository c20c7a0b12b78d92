"""A GGUF file is the model (``gguf/config.py``, ``gguf/modules.py``): its configuration and tokenizer
from its metadata, transformers' module tree with only its float tensors in it, the passes on its
blocks — and the same model, bit for bit, as transformers' own reading of the file dequantises.

Per family whose GGUF form transformers reads (tiny random models written as llama.cpp's converter
writes them, Q8_0 projections and embedding), and on the default model's real file."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import pytest
import torch

from agentspec.engine import Engine
from agentspec.engine.kv import KVBlock, KVLayout
from agentspec.gguf import read_gguf
from agentspec.gguf.config import dropped_fields, model_config, model_tokenizer
from agentspec.gguf.modules import weights_on_meta
from agentspec.gguf.tree import FileTree, file_tree_reads
from agentspec.model import default_model_path, read_model
from agentspec.passes.arch import describe
from agentspec.passes.blocks import BlockPass
from agentspec.passes.layouts import tensor_blocks
from agentspec.passes.products import GGUFBlocks
from agentspec.passes.packed import PackedRow, check_packed, use_packed_attention
from agentspec.passes.weights import onednn_linear

from .conftest import VOCABULARIES, drafted_matching_plain, real_vocab, rewrite_gguf
from .test_families import SMALL, family_model, q8_0_blocks, write_gguf

CPU, F32 = torch.device("cpu"), torch.float32
# The families of arch.py whose GGUF form transformers reads (Mistral's files are Llama's)
FILE_FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
# The families whose GGUF form transformers does not read: agentspec's tables (gguf/config.OWN_TABLES)
OWN_FAMILIES = ("gemma", "smollm3", "granite")
TEXTS = [
    "Hello world!  How are you?\n\n def f(x):\n\treturn x**2",
    "日本語のテキスト émoji 🎉 — naïve café",
    "<|im_start|>user\nhi<|im_end|>\n",
    '```json\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n```  12345678 東京',
    "  hello  world <s>the</s> and",
]


@pytest.fixture(scope="module", params=FILE_FAMILIES)
def family_file(request, loaded, tmp_path_factory):
    """(family, the file, agentspec's reading of it, transformers' reading of it (the float model))."""
    name = request.param
    model = family_model(name, loaded.vocab_size, seed=5)
    model.config.tie_word_embeddings = name in ("llama", "gemma2")  # tied heads read the embedding's blocks
    q8_0_blocks(model)  # its weights as Q8_0 values
    path = tmp_path_factory.mktemp(name) / f"tiny-{name}.gguf"
    write_gguf(model, loaded.gguf_file, path, types={"token_embd.weight": "Q8_0"})
    read = read_model(path, CPU, F32)
    return name, path, read, read.model


def test_the_configuration_is_the_one_transformers_reads(family_file):
    from transformers import AutoConfig

    name, path, read, _ = family_file
    ours = model_config(read.gguf).to_dict()
    theirs = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    theirs.update(dropped_fields(read.gguf))  # Qwen3's head size, Phi-3's rotary: transformers' table drops them (its reading is given them too)
    differ = {key: (ours.get(key), theirs.get(key)) for key in set(ours) | set(theirs) if key != "_name_or_path" and ours.get(key) != theirs.get(key)}
    assert not differ, differ


def test_the_module_tree_holds_the_files_float_tensors_and_nothing_else(family_file):
    """Its quantised matrices stay on the meta device (no memory); every tensor it holds — norms
    (Gemma's less one), biases, rotary frequencies, embedding scales — is transformers' own, bit for bit."""
    name, _, read, model = family_file
    tree = read.module
    assert isinstance(tree, FileTree)  # agentspec's own modules, held to transformers' here
    assert weights_on_meta(tree) and tree.get_input_embeddings().weight.device.type == "meta"
    theirs = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    held = 0
    for key, tensor in [*tree.named_parameters(remove_duplicate=False), *tree.named_buffers()]:
        if tensor.device.type == "meta":
            assert tensor.dim() == 2, key  # only matrices are left in the file
            continue
        assert torch.equal(tensor, theirs[key]), key
        held += tensor.numel()
    assert 0 < held < 0.05 * sum(p.numel() for p in model.parameters())
    assert describe(tree) == describe(model) and KVLayout.of(tree) == KVLayout.of(model)


@torch.inference_mode()
def test_the_pass_on_the_file_alone_is_the_pass_on_transformers_reading(family_file):
    """The block pass built from the module tree (embedding rows dequantised from the file's blocks,
    q/k rows un-interleaved by rule) gives the same bits as the block pass built on transformers'
    float model, and transformers' logits to float32 rounding."""
    name, path, read, model = family_file
    use_packed_attention(model)
    layout = KVLayout.of(model)
    tree_pass = BlockPass(read.module, GGUFBlocks(read.module, read.gguf, onednn_linear))
    float_pass = BlockPass(model, GGUFBlocks(model, path, onednn_linear))
    ids = torch.randint(0, read.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = [forward([PackedRow(KVBlock(layout), ids, len(ids))])[0] for forward in (tree_pass, float_pass)]
    assert torch.equal(*logits), name
    assert check_packed(model, layout, 1e-3, forward=tree_pass) <= 1e-3


def test_an_engine_on_the_file_alone_decodes_speculatively_as_plainly(family_file):
    name, _, read, _ = family_file
    engine = Engine(read)  # "auto": the block pass by rule, nothing dequantised
    assert isinstance(engine.forward, BlockPass) and not engine.weights.check_at_start
    assert drafted_matching_plain(engine, read, ["one two three one two three one two three one two"], max_tokens=10) > 0


@pytest.fixture(scope="module", params=OWN_FAMILIES)
def own_family_file(request, loaded, tmp_path_factory):
    """(family, the model the file was written from, agentspec's reading of the file) for a family
    transformers does not read from GGUF (``gguf/config.OWN_TABLES``): its weights are Q8_0 values,
    so the model written is the reference. SmolLM3 with llama.cpp's layer without rotary every fourth."""
    import transformers as T

    name = request.param
    config = {  # SmolLM3: transformers' default interval, 4; Granite: multipliers a float32 key holds exactly
        "smollm3": lambda: T.SmolLM3Config(**SMALL, pad_token_id=0),
        "granite": lambda: T.GraniteConfig(**SMALL, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=4.0),
    }.get(name, lambda: None)()
    model = family_model(name, loaded.vocab_size, seed=9, config=config)
    q8_0_blocks(model)
    with torch.no_grad():  # the embedding as Q8_0 values too
        embedding = model.get_input_embeddings().weight
        embedding.copy_(tensor_blocks("Q8_0", gguf.quants.quantize(embedding.numpy(), gguf.GGMLQuantizationType.Q8_0)).dequantised())
    path = tmp_path_factory.mktemp(name) / f"tiny-{name}.gguf"
    write_gguf(model, loaded.gguf_file, path, types={"token_embd.weight": "Q8_0"})
    return name, model, read_model(path, CPU, F32)


def test_a_family_transformers_does_not_read_is_read_as_llama_cpp_reads_it(own_family_file):
    """Gemma (1), SmolLM3 and Granite files: the configuration from llama.cpp's keys describes the
    model written (multipliers, layers without rotary, head size), the module tree holds its norms
    and biases, and the dequantised float model is the model written."""
    name, model, read = own_family_file
    assert isinstance(read.module, FileTree) and weights_on_meta(read.module) and read.module.config.model_type == name
    assert describe(read.module) == describe(model) and KVLayout.of(read.module) == KVLayout.of(model)
    if name == "smollm3":
        assert [layer.rope for layer in describe(read.module).layers] == ["", "", "", None]
    theirs = dict(model.named_parameters()) | dict(model.named_buffers())
    for key, tensor in [*read.module.named_parameters(), *read.module.named_buffers()]:
        if tensor.device.type != "meta":
            torch.testing.assert_close(tensor, theirs[key], rtol=0, atol=1e-6, msg=key)  # Gemma's norms: (1 + w) - 1
    for key, tensor in dict(read.model.named_parameters()).items():
        torch.testing.assert_close(tensor, theirs[key], rtol=0, atol=1e-6, msg=key)


def test_a_gguf_start_imports_no_modeling_code():
    """A GGUF file on the block passes is read without transformers' modeling code (which imports its
    generation, masking and distributed modules and torch's compiler: seconds of start-up): the
    default model loads and an engine starts on it in a process that never imports them. (Llama's
    configuration class itself imports transformers' activations, and through them its distributed
    tensors: ~0.8 s that files of other families do not pay.)"""
    import subprocess
    import sys

    script = (
        "import sys; from agentspec.model import load_model; from agentspec.engine import Engine; "
        "engine = Engine(load_model()); engine.calibrate(reuse=False); "
        "print(type(engine.forward).__name__, *sorted(m for m in sys.modules if m in "
        "('transformers.modeling_utils', 'transformers.generation.utils', 'transformers.masking_utils', 'torch._dynamo')))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["BlockPass"], done.stdout


def test_a_rotary_table_that_changes_with_the_length_goes_to_transformers_tree(family_file):
    """agentspec's tree builds rotary tables fixed when built (LongRoPE's two are pinned per position);
    a dynamic one ("dynamic" NTK scaling) is left to transformers' modules, and a file lacking a
    norm the model needs is refused at load, naming it."""
    name, path, read, _ = family_file
    config = read.module.config
    assert file_tree_reads(config)
    changed = type(config).from_dict(config.to_dict())
    if name == "gemma3_text":  # a table per layer type
        for kind in set(changed.layer_types):
            changed.rope_parameters[kind] = {**changed.rope_parameters[kind], "rope_type": "dynamic", "factor": 2.0}
    else:
        changed.rope_parameters = {**changed.rope_parameters, "rope_type": "dynamic", "factor": 2.0}
    assert not file_tree_reads(changed)
    if name == "gemma3_text":  # LongRoPE is pinned per position for a model's one table, not per layer type
        for kind in set(changed.layer_types):
            changed.rope_parameters[kind] = {**config.rope_parameters[kind], "rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                                             "original_max_position_embeddings": 64}
        assert not file_tree_reads(changed)


def test_a_file_of_float_matrices_is_transformers_model_whole(loaded, tmp_path):
    """A GGUF file whose matrices are all float (F16 here) has no blocks for the block passes: its
    tree is transformers' model with every weight, and "auto" runs a float pass on it."""
    model = family_model("qwen2", loaded.vocab_size, seed=4)
    path = tmp_path / "f16.gguf"
    write_gguf(model, loaded.gguf_file, path, quant="F16")
    read = read_model(path, CPU, F32)
    assert not isinstance(read.module, FileTree) and not weights_on_meta(read.module)
    engine = Engine(read)
    assert not isinstance(engine.forward, BlockPass)
    assert drafted_matching_plain(engine, read, ["one two three one two three one two three one two"], max_tokens=6) > 0


@pytest.mark.parametrize("dropped, needed", [("blk.1.ffn_norm.weight", "post_attention_layernorm"), ("blk.0.attn_q.bias", "q_proj.bias")])
def test_a_file_without_a_tensor_the_model_needs_is_refused(loaded, tmp_path, dropped, needed):
    """A norm, or a bias the family always has (Qwen2's q/k/v), missing from the file: a
    ``ModelLoadError`` naming it at load (llama.cpp refuses such a file too)."""
    from agentspec.errors import ModelLoadError

    model = family_model("qwen2", loaded.vocab_size, seed=3)
    q8_0_blocks(model)
    whole, cut = tmp_path / "whole.gguf", tmp_path / "cut.gguf"
    write_gguf(model, loaded.gguf_file, whole)
    rewrite_gguf(whole, cut, lambda name, data, kind: None if name == dropped else (data, kind))
    with pytest.raises(ModelLoadError, match=re.escape(needed)):
        read_model(cut, CPU, F32)


@torch.inference_mode()
def test_a_family_transformers_does_not_read_runs_on_its_blocks(own_family_file):
    """The block pass on such a file gives the written model's logits to float32 rounding, and an
    engine on the file alone decodes speculatively as plainly."""
    name, model, read = own_family_file
    use_packed_attention(model)
    forward = BlockPass(read.module, GGUFBlocks(read.module, read.gguf, onednn_linear))
    assert check_packed(model, KVLayout.of(model), 1e-3, forward=forward) <= 1e-3, name
    engine = Engine(read)
    assert isinstance(engine.forward, BlockPass)
    assert drafted_matching_plain(engine, read, ["one two three one two three one two three one two"], max_tokens=10) > 0


@torch.inference_mode()
def test_llama_3s_rotary_scaling_survives_the_file(loaded, tmp_path):
    """Llama 3.x's RoPE scaling: llama.cpp's converter writes it as a factor per rotary frequency
    (``rope_freqs.weight``), which transformers' GGUF reader drops. agentspec divides each frequency
    by its factor, as llama.cpp's RoPE does, on the file alone and on the float model alike: the
    frequencies are the original checkpoint's (rope_type "llama3") to float32 rounding, and the pass
    on the file gives the original model's logits (its weights are Q8_0 values)."""
    model = family_model("llama", loaded.vocab_size, seed=8)
    q8_0_blocks(model)
    path = tmp_path / "llama3-rope.gguf"
    write_gguf(model, loaded.gguf_file, path)
    read = read_model(path, CPU, F32)
    original, ours = model.model.rotary_emb.inv_freq, read.module.model.rotary_emb.inv_freq
    dim = original.numel() * 2
    unscaled = 1.0 / model.config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    assert not torch.allclose(original, unscaled, rtol=1e-3)  # a scaling to lose
    torch.testing.assert_close(ours, original, rtol=1e-6, atol=0)
    assert torch.equal(read.model.model.rotary_emb.inv_freq, ours)
    use_packed_attention(model)
    forward = BlockPass(read.module, GGUFBlocks(read.module, read.gguf, onednn_linear))
    assert check_packed(model, KVLayout.of(model), 1e-3, forward=forward) <= 1e-3


def longrope_phi3(vocab_size: int, original: int, seed: int):
    """A tiny Phi-3 rotating half of each head with LongRoPE, its long table from position
    ``original`` on (Phi-3.5's and Phi-4-mini's rotary, at a size the tests reach)."""
    import transformers as T

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "original_max_position_embeddings": original,
            "long_factor": [1.0, 2.5, 4.0, 8.0], "short_factor": [1.0, 1.1, 1.3, 1.7]}
    config = T.Phi3Config(**SMALL, pad_token_id=0, rope_parameters=rope, original_max_position_embeddings=original)
    return family_model("phi3", vocab_size, seed=seed, config=config)


@torch.inference_mode()
def test_phi_3s_rotary_survives_the_file(loaded, tmp_path):
    """Phi-3.5 and Phi-4-mini rotate part of each head with LongRoPE: two tables of factors, the short
    one within the context the model was pretrained on, the long one beyond. llama.cpp's converter
    writes the width (``rope.dimension_count``) and the tables (``rope_factors_long``/``_short``, the
    original context, the attention factor); transformers' GGUF table drops all of it. Read from the
    file alone the model rotates as the checkpoint does, the table chosen per position
    (``passes/rope.py``): transformers' own angles, bit for bit, for a call within the original
    context and for one past it; the pass on the file gives the checkpoint's logits on positions on
    both sides of it; and an engine decodes across it speculatively as plainly."""
    from agentspec.passes.rope import PositionwiseLongRope, pin_long_rope

    original = 8  # check_packed's sequences run to position 10
    model = longrope_phi3(loaded.vocab_size, original, seed=10)
    q8_0_blocks(model)
    path = tmp_path / "phi3-longrope.gguf"
    write_gguf(model, loaded.gguf_file, path)
    read = read_model(path, CPU, F32)
    rotary = read.module.model.rotary_emb
    assert isinstance(rotary, PositionwiseLongRope) and rotary.original == original
    hidden = torch.zeros(1, 1, SMALL["hidden_size"])
    for positions in (torch.arange(original)[None], torch.arange(original, 3 * original)[None]):  # within, past
        theirs = model.model.rotary_emb(hidden, positions)  # transformers' table for the whole call
        assert all(torch.equal(a, b) for a, b in zip(rotary(hidden, positions), theirs))
    assert pin_long_rope(model) and not pin_long_rope(model)
    use_packed_attention(model)
    forward = BlockPass(read.module, GGUFBlocks(read.module, read.gguf, onednn_linear))
    assert check_packed(model, KVLayout.of(model), 1e-3, forward=forward) <= 1e-3
    engine = Engine(read)
    assert drafted_matching_plain(engine, read, ["one two three one two three one two three one two"], max_tokens=10) > 0


def test_a_longrope_checkpoint_decodes_across_its_original_context_speculatively_as_plainly(loaded, tmp_path):
    """A safetensors Phi-3 with LongRoPE, loaded through transformers: its rotary embedding is
    pinned per position too (transformers' own switches table for a whole call by its largest
    position, so a verification pass across the original context would rotate differently from
    plain decoding), and the engine's passes decode across the original context as plainly."""
    from agentspec.passes.rope import PositionwiseLongRope

    prompt = "one two three one two three one two three one two"
    original = len(loaded.chat.encode([{"role": "user", "content": prompt}])) + 3  # decoding crosses it
    longrope_phi3(loaded.vocab_size, original, seed=11).save_pretrained(tmp_path / "phi3")
    loaded.tokenizer.save_pretrained(tmp_path / "phi3")
    read = read_model(tmp_path / "phi3", CPU, F32)
    assert isinstance(read.module.model.rotary_emb, PositionwiseLongRope)
    engine = Engine(read)
    assert drafted_matching_plain(engine, read, [prompt], max_tokens=10) > 0


def sentencepiece_vocabulary(folder: Path, architecture: str) -> Path:
    """A vocabulary-only GGUF file of llama.cpp's sentencepiece kind (``tokenizer.ggml.model`` "llama":
    control and byte tokens, pieces with scores and no merges) for ``architecture``, whose builder
    transformers picks by it (Gemma's, Phi-3's, Llama's)."""
    path = folder / f"ggml-vocab-spm-{architecture}.gguf"
    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = ["\u2581", *letters, *("\u2581" + c for c in letters), "th", "he", "\u2581th", "\u2581the", "in", "\u2581in", "er", "an",
              "\u2581an", "\u2581and", "ll", "\u2581he", "\u2581hell", "\u2581hello", "or", "\u2581wor", "\u2581world", "ld", "\u00e4", "\u00e9", "\u65e5", "\u672c"]
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces])
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))  # unknown, control, byte, normal
    writer.add_bos_token_id(1), writer.add_eos_token_id(2), writer.add_unk_token_id(0), writer.add_add_space_prefix(True)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    return path


SENTENCEPIECE = ("spm-llama", "spm-gemma2", "spm-phi3")


@pytest.mark.parametrize("vocabulary", ["default", *VOCABULARIES, *SENTENCEPIECE])
def test_the_tokenizer_from_the_metadata_is_transformers(vocabulary, tmp_path):
    """The tokenizer built from ``tokenizer.ggml.*`` encodes, decodes and renders the chat template as
    ``AutoTokenizer`` over the file does: the default model's, Qwen2's and Llama 3's real
    vocabularies, and small sentencepiece ones under the three builders transformers picks for them
    by architecture (the special tokens, the vocabulary's size, BOS as the file says, each the same)."""
    from transformers import AutoTokenizer

    if vocabulary in SENTENCEPIECE:
        path = sentencepiece_vocabulary(tmp_path, vocabulary.removeprefix("spm-"))
    else:
        path = default_model_path() if vocabulary == "default" else Path(real_vocab(vocabulary))
    ours = model_tokenizer(read_gguf(path))
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        ids = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == ids and ours.decode(ids) == theirs.decode(ids), text
    assert ours.special_tokens_map == theirs.special_tokens_map and len(ours) == len(theirs)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.chat_template == theirs.chat_template  # Llama 3's vocabulary file has none
    assert ours.chat_template is None or ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.encode("hi") == theirs.encode("hi")  # BOS as the file says


def test_the_default_model_is_its_file(loaded):
    """The session's model: no float weights loaded to run it, its embedding and LM-head rows read
    from the blocks as transformers dequantises them."""
    assert weights_on_meta(loaded.module)
    ids = torch.tensor([0, 1, 17, 4_000, loaded.vocab_size - 1])
    reference = loaded.model  # the float model, on demand
    assert torch.equal(loaded.input_rows(ids), reference.get_input_embeddings().weight[ids])
    assert torch.equal(loaded.output_rows(ids), reference.get_output_embeddings().weight[ids])


REFUSED = """
import asyncio, sys
import agentspec
async def main(weights):
    try:
        async with agentspec.Client(weights=weights) as client:
            done = await client.generate([{'role': 'user', 'content': 'Hi'}], max_tokens=4)
            print('ran', client.engine.weights.name, len(done.token_ids))
    except agentspec.ModelLoadError as exc:
        print('refused', exc)
asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.parametrize("weights", ["auto", "fused"])
def test_without_kernels_a_gguf_file_is_refused_or_dequantised_when_asked(weights, tmp_path):
    """A machine where the block kernels cannot be built (here: the package's libraries set aside, no C
    compiler, an empty cache) refuses a GGUF file at start-up with a ModelLoadError that says why and
    how to run it anyway; asked for a float pass by name, it runs on the file dequantised to float32."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CC": "/bin/false", "AGENTSPEC_CACHE_DIR": str(tmp_path), "AGENTSPEC_KERNELS": "compile"}
    done = subprocess.run([sys.executable, "-c", REFUSED, weights], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout.strip().splitlines()[-1]
    if weights == "auto":
        assert out.startswith("refused") and "block kernels, which cannot run here" in out and "weights='fused'" in out and "GB of memory" in out, out
    else:
        assert out.startswith("ran fused"), out


@torch.inference_mode()
def test_a_product_of_blocks_of_different_kinds_runs_in_the_compiled_layers(loaded, tmp_path):
    """Q4_K_M keeps q and k in one type and v in another (Q4_K, Q6_K): the q/k/v product is then a
    chain of one product per kind (``StackedProduct``; blocks.h: agentspec_blocks.next), which the
    compiled layers run part by part — the model's logits to float32 rounding, on float32 and on
    16-bit rows, and greedy speculative == plain."""
    from agentspec.passes.products import StackedProduct
    from agentspec.passes.weights import NEAR_TOLERANCE

    model = family_model("llama", loaded.vocab_size, seed=6)
    q8_0_blocks(model)
    path = tmp_path / "mixed-kinds.gguf"
    layers = model.config.num_hidden_layers
    write_gguf(model, loaded.gguf_file, path, types={**{f"blk.{i}.attn_v.weight": "Q4_1" for i in range(layers)}, "blk.0.ffn_up.weight": "Q4_1"})
    read = read_model(path, CPU, F32)
    reference = read.model
    use_packed_attention(reference)
    layout = KVLayout.of(reference)
    for activations, tolerance in (("float32", 1e-3), ("q16", NEAR_TOLERANCE)):
        forward = BlockPass(read.module, GGUFBlocks(read.module, read.gguf, onednn_linear, activations))
        assert all(isinstance(layer.qkv, StackedProduct) and len(layer.qkv.products) == 2 for layer in forward.layers)
        assert isinstance(forward.layers[0].gate_up, StackedProduct) and not isinstance(forward.layers[1].gate_up, StackedProduct)
        assert check_packed(reference, layout.with_dtype(*forward.kv_dtypes), tolerance, forward=forward) <= tolerance
    engine = Engine(read)
    assert drafted_matching_plain(engine, read, ["one two three one two three one two three one two"], max_tokens=10) > 0
