"""Model families on agentspec's own passes (``passes/arch.py``): for each family a tiny random model
built in-process from its config — every switch its block has turned on (biases, q/k norms, windows
shorter than the test's texts, soft-caps, partial rotary, layers without rotary, multipliers) and
every weight, norms included, perturbed so no switch hides behind an identity. The fused and static
passes give transformers' logits to float32 rounding, "auto" takes the fused pass as a candidate, and
greedy and seeded decoding are the same tokens speculative or plain."""

from __future__ import annotations


import pytest
import torch

from agentspec.bench.files import copy_tokenizer
from agentspec.engine import Engine
from agentspec.passes.arch import FAMILIES, GGUF_PROJECTIONS, describe
from agentspec.passes.blocks import BlockPass
from agentspec.passes.layouts import tensor_blocks
from agentspec.passes.products import GGUFBlocks
from agentspec.passes.fused import FusedPass
from agentspec.engine.kv import KVBlock, KVLayout
from agentspec.passes.packed import PackedRow, check_packed, use_packed_attention
from agentspec.passes.static import StaticPass
from agentspec.passes.weights import NEAR_TOLERANCE, onednn_linear, select_weights
from agentspec.model import load_model
from agentspec.params import GenerationParams
from agentspec.types import SpecConfig

from .conftest import decode, drafted_matching_plain, greedy_margins

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4)


def _configs():
    import transformers as T

    llama3_rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return {
        "llama": lambda: T.LlamaConfig(**SMALL, rope_scaling=llama3_rope),  # Llama 3.x RoPE scaling
        "mistral": lambda: T.MistralConfig(**SMALL, sliding_window=5),
        "qwen2": lambda: T.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=4, max_window_layers=2),  # biases, windows on 2 of 4 layers
        "qwen3": lambda: T.Qwen3Config(**SMALL, head_dim=32),  # q/k norms, heads wider than hidden / heads
        "phi3": lambda: T.Phi3Config(**SMALL, pad_token_id=0, partial_rotary_factor=0.5),  # fused qkv and gate_up, Phi-4-mini's partial rotary
        "gemma": lambda: T.GemmaConfig(**SMALL, head_dim=16),  # (1 + w) norms, GELU gate, scaled embedding
        "gemma2": lambda: T.Gemma2Config(**SMALL, **GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=3.0),  # sandwich norms, soft-caps, alternating windows
        "gemma3_text": lambda: T.Gemma3TextConfig(**SMALL, **GEMMA, sliding_window_pattern=2),  # q/k norms, a rotary table per layer type
        "smollm3": lambda: T.SmolLM3Config(**SMALL, pad_token_id=0, no_rope_layer_interval=2),  # layers without rotary
        "granite": lambda: T.GraniteConfig(**SMALL, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0),
    }


def test_every_family_has_a_test():
    assert set(_configs()) == set(FAMILIES)


def family_model(family: str, vocab_size: int, seed: int = 0, noise: float = 0.3, config=None):
    """The family's tiny model, every weight (norms included) plus Gaussian ``noise``: large enough
    that no switch hides behind an identity; reduced precision wants less (cuda_check's bf16).
    ``config``: another configuration of the family than the test's."""
    from transformers import AutoModelForCausalLM

    config = config or _configs()[family]()
    config.vocab_size = vocab_size
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms start at identities (1, or Gemma's 0): perturb every weight
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * noise)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, loaded):
    """(family, its tiny model sharing the default tokenizer, as a LoadedModel)."""
    model = family_model(request.param, loaded.vocab_size)
    return request.param, loaded.with_model(model, name=f"tiny-{request.param}", context_window=512)


def test_description_reads_the_block(family):
    name, tiny = family
    arch = describe(tiny.model)
    assert arch.model_type == name and len(arch.layers) == SMALL["num_hidden_layers"]
    windows = [layer.window for layer in arch.layers]
    expected = {"mistral": [5] * 4, "qwen2": [None, None, 4, 4], "gemma2": [4, None] * 2, "gemma3_text": [4, None] * 2}
    assert windows == expected.get(name, [None] * 4)
    assert ("q_proj" in arch.biases) == (name == "qwen2")
    assert arch.compiled is None, arch.compiled  # blocks.c runs every family's layers
    if name == "smollm3":
        assert [layer.rope for layer in arch.layers] == ["", None, "", None]
    if name == "gemma2":
        assert (arch.attention_softcap, arch.final_softcap) == (2.0, 3.0)


@torch.inference_mode()
def test_fused_and_static_passes_give_the_models_logits(family):
    name, tiny = family
    use_packed_attention(tiny.model)
    layout = KVLayout.of(tiny.model)
    for forward in (FusedPass(tiny.model, onednn_linear), StaticPass(tiny.model, onednn_linear, sequences=4, capacity=256)):
        assert check_packed(tiny.model, layout, 1e-4, forward=forward) <= 1e-4, (name, type(forward).__name__)


@torch.inference_mode()
def test_compiled_layers_give_the_models_logits(family, tmp_path):
    """The compiled decoder layers (blocks.c) on Q8_0 blocks of the family's projections — the model's
    weights replaced by the blocks' values, as a GGUF file's are — give the model's logits to float32
    rounding, on float32 and on float16 keys and values."""
    name, tiny = family
    model = family_model(name, tiny.vocab_size, seed=3)
    found = q8_0_blocks(model)
    use_packed_attention(model)
    layout = KVLayout.of(model)
    for activations in ("float32", "q16"):  # float32 rows keep float32 keys and values; integer rows float16 ones
        blocks = GGUFBlocks(model, tmp_path / "tiny.gguf", onednn_linear, activations, blocks=found)
        forward = BlockPass(model, blocks)
        tolerance = 1e-3 if activations == "float32" else NEAR_TOLERANCE  # 16-bit rows: another arithmetic, within its bound
        assert check_packed(model, layout.with_dtype(*forward.kv_dtypes), tolerance, forward=forward) <= tolerance


@torch.no_grad()
def q8_0_blocks(model) -> dict:
    """Q8_0 blocks of every linear weight of ``model``, keyed by the weight's id as ``GGUFBlocks``
    takes them, the weights replaced by the blocks' values (as a GGUF file's are)."""
    import gguf

    found = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            raw = gguf.quants.quantize(module.weight.detach().numpy(), gguf.GGMLQuantizationType.Q8_0)
            blocks = tensor_blocks("Q8_0", raw)
            module.weight.copy_(blocks.dequantised())
            found[id(module.weight)] = blocks
    return found


@torch.no_grad()
def large_key_biases(model, generator: torch.Generator | None = None) -> None:
    """The real Qwen2.5 files' key biases: 12 channels of ±150 in the key biases of layers 0 and 1."""
    for layer in model.model.layers[:2]:
        bias = layer.self_attn.k_proj.bias
        bias[torch.randperm(bias.numel(), generator=generator)[:12]] = torch.tensor([150.0, -150.0]).repeat(6)


@torch.inference_mode()
def test_large_key_biases_keep_float32_keys_on_integer_rows(loaded, tmp_path):
    """Qwen2.5's files have key biases of |145|-|158| in their first layers, so keys of |160|, which
    float16 rounds by ~0.06 each. A Qwen2 model with such biases (12 channels of layers 0 and 1 at
    ±150, the rest small; embedding rows of norm 0.7 as real ones) keeps float32 keys on the integer
    pass (``KEY_BIAS_LIMIT``), float16 values: within a tenth of the float32 cache's tolerance, where
    float16 keys are over 5 times as far; the same model without the large biases caches float16 keys."""
    import transformers as T

    config = T.Qwen2Config(hidden_size=256, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    config.vocab_size = loaded.tokenizer.vocab_size
    torch.manual_seed(5)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
        embedding = model.model.embed_tokens.weight
        embedding.mul_(0.7 / embedding.norm(dim=-1, keepdim=True))
        for layer in model.model.layers:
            layer.self_attn.k_proj.bias.normal_(0.0, 3.0)
    found = q8_0_blocks(model)
    use_packed_attention(model)
    layout = KVLayout.of(model)
    small = BlockPass(model, GGUFBlocks(model, tmp_path / "qwen2.gguf", onednn_linear, "q16", blocks=found))
    assert small.kv_dtypes == (torch.float16, torch.float16)  # key biases below KEY_BIAS_LIMIT
    large_key_biases(model, torch.Generator().manual_seed(1))
    forward = BlockPass(model, GGUFBlocks(model, tmp_path / "qwen2.gguf", onednn_linear, "q16", blocks=found))
    assert forward.kv_dtypes == (torch.float32, torch.float16)
    chosen = check_packed(model, layout.with_dtype(*forward.kv_dtypes), NEAR_TOLERANCE, forward=forward)
    half_keys = check_packed(model, layout.with_dtype(torch.float16), 1.0, forward=forward)
    assert chosen < NEAR_TOLERANCE / 10 and half_keys > 5 * chosen, (chosen, half_keys)


def test_auto_takes_the_fused_pass_as_a_candidate(family):
    name, tiny = family
    use_packed_attention(tiny.model)
    auto = select_weights(tiny.model, KVLayout.of(tiny.model), "auto")
    assert "fused" in auto.timings_ms, auto.reason
    assert "fused:" not in auto.reason  # not among the passes left out, with their reasons


def test_speculative_equals_plain_greedy_and_seeded(family):
    name, tiny = family
    engine = Engine(tiny, weights="fused")
    prompts = ["one two three one two three one two three one two", "The cat sat. The cat sat. The cat"]
    assert drafted_matching_plain(engine, tiny, prompts, max_tokens=16) > 0  # drafts were verified (and rolled back)
    ids = tiny.chat.encode([{"role": "user", "content": prompts[0]}])
    for seed in (1, 2):
        sampled = dict(max_tokens=16, temperature=1.0, top_p=0.9, seed=seed)
        plain, _ = decode(engine, ids, GenerationParams(**sampled, spec=SpecConfig(enabled=False)))
        spec, _ = decode(engine, ids, GenerationParams(**sampled, spec=SpecConfig(max_draft_tokens=8, adaptive=False)))
        assert spec.tokens == plain.tokens, (name, seed)


def test_generic_pass_runs_soft_capped_attention(loaded):
    """Gemma 2 on the model's own modules (the generic pass): transformers' sdpa has no soft-capping,
    so the model's own forward outside packed passes computes it written out — a request runs and
    gives the fused pass's tokens, not a raw ValueError."""
    model = family_model("gemma2", loaded.vocab_size, seed=1)
    tiny = loaded.with_model(model, name="tiny-gemma2", context_window=512)
    generic, fused = Engine(tiny, weights="eager"), Engine(tiny, weights="fused")
    generic.calibrate(repeats=1)  # checks the packed passes against the model's own forward
    ids = tiny.chat.encode([{"role": "user", "content": "Hello there"}])
    params = GenerationParams(max_tokens=8, spec=SpecConfig(enabled=False))
    assert decode(generic, ids, params)[0].tokens == decode(fused, ids, params)[0].tokens


def llama3_rope_factors(rope: dict, head_dim: int) -> "np.ndarray":
    """Llama 3.x's RoPE scaling as llama.cpp's converter writes it (conversion/llama.py:
    ``rope_freqs.weight``): per rotary frequency, the factor its angle is divided by."""
    import math

    import numpy as np

    base, factor, low, high, context = rope["rope_theta"], rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    factors = []
    for frequency in (1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)).tolist():
        wavelength = 2 * math.pi / frequency
        if wavelength < context / high:
            factors.append(1.0)
        elif wavelength > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


# The families whose q/k rows llama.cpp's converter interleaves: LlamaModel and its subclasses that keep
# undo_permute (conversion/llama.py: Mistral's files are Llama's; SmolLM3Model; granite.py's GraniteModel),
# written here by that rule and not by arch.py's Family.gguf_permuted, which the tests check
CONVERTER_PERMUTES = frozenset({"llama", "mistral", "smollm3", "granite"})


def write_gguf(model, tokenizer_source, path, quant: str = "Q8_0", types: dict[str, str] | None = None) -> None:
    """``model`` as llama.cpp's converter writes its family — Llama's q/k rows with their rotary
    halves interleaved, Gemma's norms as 1 + w, Gemma 3 as architecture ``gemma3``, Llama 3's RoPE
    scaling as a factor per frequency (``rope_freqs.weight``), Phi-3's rotary width and LongRoPE
    tables, Granite's multipliers — its projections and LM head (unless tied) in ``quant`` blocks
    (gguf-py's quantiser), the rest float32, with the tokenizer of the GGUF file
    ``tokenizer_source``; ``types``: another type for some tensors, by name. What the metadata says is what llama.cpp's GGUF keys hold (sizes, heads, RoPE
    base, epsilon, sliding window): a config switch without a key there is not in the file."""
    import math

    import gguf
    import numpy as np

    config, family = model.config, describe(model).family
    writer = gguf.GGUFWriter(str(path), {"gemma3_text": "gemma3"}.get(config.model_type, config.model_type))
    copy_tokenizer(writer, tokenizer_source)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.rope_parameters
    writer.add_rope_freq_base((rope.get("full_attention") or rope)["rope_theta"])  # Gemma 3's: a table per layer type, the global one in the file
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if config.model_type == "phi3":  # conversion/phi.py: the width it rotates, LongRoPE's two tables
        writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * config.hidden_size) // config.num_attention_heads)
        if rope.get("rope_type") == "longrope":
            original = rope["original_max_position_embeddings"]
            scale = config.max_position_embeddings / original
            writer.add_rope_scaling_orig_ctx_len(original)
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
            writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if family.multipliers:  # Granite's, under llama.cpp's names
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    if family.no_rope_layers:  # the file cannot say which layers have no rotary: llama.cpp takes every fourth
        assert list(config.no_rope_layers) == [int((i + 1) % 4 != 0) for i in range(config.num_hidden_layers)], "SmolLM3's GGUF form has a layer without rotary every fourth"
    blocks = gguf.GGMLQuantizationType[quant]

    def add(name, tensor, quantised=False):
        values = tensor.detach().float().numpy()
        if family.norm_offset and name.endswith("norm.weight"):
            values = values + family.norm_offset
        if config.model_type in CONVERTER_PERMUTES and (".attn_q." in name or ".attn_k." in name):  # rotary halves interleaved
            heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            values = values.reshape(heads, 2, values.shape[0] // heads // 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)
        if quantised:
            kind = gguf.GGMLQuantizationType[types[name]] if types and name in types else blocks
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, values.astype(np.float32))

    body = model.model
    add("token_embd.weight", body.embed_tokens.weight, quantised=bool(types and "token_embd.weight" in types))  # float32 unless ``types`` names it
    for i, layer in enumerate(body.layers):
        attention, mlp = layer.self_attn, layer.mlp
        projections = [(n, getattr(attention, n)) for n in (*family.qkv, "o_proj")] + [(n, getattr(mlp, n)) for n in (*family.gate_up, "down_proj")]
        for name, module in projections:
            add(f"blk.{i}.{GGUF_PROJECTIONS[name]}.weight", module.weight, quantised=True)
            if module.bias is not None:
                add(f"blk.{i}.{GGUF_PROJECTIONS[name]}.bias", module.bias)
        add(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
        if family.sandwich:
            add(f"blk.{i}.post_attention_norm.weight", layer.post_attention_layernorm.weight)
            add(f"blk.{i}.ffn_norm.weight", layer.pre_feedforward_layernorm.weight)
            add(f"blk.{i}.post_ffw_norm.weight", layer.post_feedforward_layernorm.weight)
        else:
            add(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight)
        if family.qk_norm:
            add(f"blk.{i}.attn_q_norm.weight", attention.q_norm.weight)
            add(f"blk.{i}.attn_k_norm.weight", attention.k_norm.weight)
    add("output_norm.weight", body.norm.weight)
    if not config.tie_word_embeddings:
        add("output.weight", model.lm_head.weight, quantised=True)
    if (rope.get("full_attention") or rope).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_file_runs_on_the_block_products(loaded, tmp_path, monkeypatch):
    """A Qwen3 GGUF file (Q8_0 projections, q/k norms, and a head size that is not hidden / heads,
    which transformers' reader drops and agentspec reads from the file) loads, and its "gguf" and
    "gguf-q16" passes run every projection on the file's blocks in one compiled call (the compiled
    layers), with greedy speculative == plain. One family here; test_gguf_model.py checks the module
    tree and its passes against transformers' reading of the file for every family it reads."""
    name = "qwen3"
    monkeypatch.setenv("AGENTSPEC_CACHE_DIR", str(tmp_path / "cache"))
    model = family_model(name, loaded.vocab_size, seed=2)
    model.config.tie_word_embeddings = False
    path = tmp_path / f"tiny-{name}.Q8_0.gguf"
    write_gguf(model, loaded.gguf_file, path)
    read = load_model(path)  # the file as the model: its module tree (tests/test_gguf_model.py checks it against transformers' reading)
    assert read.module.config.model_type == name and describe(read.module).head_dim == describe(model).head_dim
    for weights in ("gguf", "gguf-q16"):
        engine = Engine(read, weights=weights)
        engine.calibrate(repeats=1)
        assert isinstance(engine.forward, BlockPass) and not engine.weights.check_at_start
        assert drafted_matching_plain(engine, read, ["one two three one two three one two three one two"], max_tokens=12) > 0


def real_statistics_model(seed: int = 0, vocab_size: int = 4096):
    """A Qwen2 of Qwen2.5-0.5B's width (896, 14/2 heads; 4 layers, MLP 1024) whose activations have
    the statistics measured on the real Qwen2.5-Coder-0.5B weights: embedding rows of norm 0.5-0.95;
    key biases of ±150 on 12 channels of layers 0 and 1 (the rest ~3); and from layer 2 on 7 residual
    channels ("massive activations") in the thousands where the others stay within ~5 — written by
    256 MLP units of layer 1 whose gate and up rows are one vector (SiLU(g)·g > 0 for every token)
    and whose down weights feed those 7 channels only. Its linear weights are Q8_0 values; returns
    the model, its Q8_0 blocks (``q8_0_blocks``) and the 7 channels."""
    import transformers as T

    config = T.Qwen2Config(hidden_size=896, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=14, num_key_value_heads=2,
                           vocab_size=vocab_size, max_position_embeddings=4096)
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    channels, units = torch.randperm(896)[:7], torch.arange(256)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
        embedding = model.model.embed_tokens.weight
        embedding.mul_((0.5 + 0.45 * torch.rand(embedding.shape[0], 1)) / embedding.norm(dim=-1, keepdim=True))
        for layer in model.model.layers:
            layer.self_attn.k_proj.bias.normal_(0.0, 3.0)
        large_key_biases(model)
        mlp = model.model.layers[1].mlp
        mlp.gate_proj.weight[units] *= 3
        mlp.up_proj.weight[units] = mlp.gate_proj.weight[units]
        mlp.down_proj.weight[:, units] = 0
        mlp.down_proj.weight[channels[:, None], units[None, :]] = 2.0  # ~2,000 in each of the 7 channels
    return model, q8_0_blocks(model), channels


@torch.inference_mode()
def test_the_integer_pass_holds_on_real_statistics(tmp_path):
    """On a model with real models' activation statistics (``real_statistics_model``: massive
    residual channels, key biases of ±150, small embedding rows) the integer pass ("gguf-q16": rows
    rounded to 16 bits per block of 32 — a block holding a massive channel rounds the rest of its
    block coarsely) keeps float32 keys, stays within a tenth of its tolerance of the model, and
    chooses every greedy token of 200 positions as the float32-row pass does, nearly all of them
    by construction (``conftest.greedy_margins``)."""
    model, found, channels = real_statistics_model()
    use_packed_attention(model)
    ids = torch.randint(0, model.config.vocab_size, (200,), generator=torch.Generator().manual_seed(3))
    residuals = model(input_ids=ids[None, :64], output_hidden_states=True).hidden_states
    for depth in (2, 3):  # the statistics are there: 7 channels in the thousands, the next within ~10
        largest = residuals[depth][0].abs().amax(0)
        assert largest[channels].min() > 1000 and largest.sort().values[-8] < 10, (depth, largest.sort().values[-9:])
    layout = KVLayout.of(model)
    passes = {activations: BlockPass(model, GGUFBlocks(model, tmp_path / "real.gguf", onednn_linear, activations, blocks=found)) for activations in ("float32", "q16")}
    assert passes["q16"].kv_dtypes == (torch.float32, torch.float16)
    assert check_packed(model, layout.with_dtype(*passes["q16"].kv_dtypes), NEAR_TOLERANCE / 10, forward=passes["q16"]) < NEAR_TOLERANCE / 10
    logits = {name: forward([PackedRow(KVBlock(layout.with_dtype(*forward.kv_dtypes)), ids.tolist(), len(ids))])[0] for name, forward in passes.items()}
    safe, agreed = greedy_margins(logits["float32"], logits["q16"])
    assert safe >= 0.97 and agreed == 1.0, (safe, agreed)


def test_matrices_of_types_the_kernels_do_not_read_are_named_in_one_line(loaded, tmp_path, caplog):
    """A file with a matrix of a type the block kernels do not read (here MXFP4, gpt-oss's 4-bit floats) runs that
    matrix on float32 weights: ``read_blocks`` says so in one warning naming the type and tensor, and
    takes the rest from the blocks."""
    import logging

    from agentspec.passes.products import read_blocks

    model = family_model("qwen3", loaded.vocab_size, seed=4)
    model.config.tie_word_embeddings = False
    q8_0_blocks(model)  # its weights as Q8_0 values, so the file's Q8_0 blocks are theirs
    path = tmp_path / "mixed.gguf"
    write_gguf(model, loaded.gguf_file, path, types={"blk.1.ffn_down.weight": "MXFP4"})
    with caplog.at_level(logging.WARNING, logger="agentspec.engine"):
        found = read_blocks(model, path)
    assert id(model.model.layers[1].mlp.down_proj.weight) not in found and id(model.model.layers[0].mlp.down_proj.weight) in found
    warnings = [r.getMessage() for r in caplog.records if "do not read" in r.getMessage()]
    assert len(warnings) == 1 and "MXFP4: 1 (blk.1.ffn_down.weight)" in warnings[0], warnings


def test_compiled_layers_refuse_what_they_do_not_compute():
    """A block with a switch blocks.c has not (an output projection bias) is refused with the reason;
    the fused pass, which has it, still runs it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**SMALL, vocab_size=64, attention_bias=True))
    assert describe(model).compiled == "the compiled layers do not compute an output projection bias (llama)"
