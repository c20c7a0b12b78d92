"""Draft models load and run as the target does (issue 47): a GGUF draft file on its own block pass,
an early exit of the GGUF default model on the target's block pass cut after N layers — each over a
key/value cache of its own, with no transformers model built and no float32 copy of a weight — and
speculative decoding with them equals plain decoding token for token, greedy and seeded.

The drafts: the default model's own file as its draft (the same arithmetic as the target, so every
drafted token is accepted), a random-weight GGUF file of the default model's width with 4 layers and
its vocabulary (few accepted), and the target's first 20 layers."""

from __future__ import annotations

import copy
import dataclasses
import shutil

import pytest
import torch

import agentspec
from agentspec.bench.files import Shape, write_model_file
from agentspec.drafting.draft_models import PassDraft, early_exit_model, file_draft_model
from agentspec.drafting.model import ModelDrafter
from agentspec.engine import Engine
from agentspec.errors import ModelLoadError
from agentspec.model import cache_dir, default_model_path, load_model
from agentspec.params import GenerationParams
from agentspec.passes.blocks import BlockPass
from agentspec.passes.levels import block_kernels
from agentspec.types import SpecConfig

from .conftest import decode
from .test_families import family_model, write_gguf
from .test_load_memory import load_in_a_process

# SmolLM2-135M's width, heads and vocabulary (the default model's), 4 layers: a ~20 MB file
DRAFT_SHAPE = Shape("llama", 576, 4, 9, 3, 1536, 49152, tied=True, rope_base=100000.0, eps=1e-5, context=8192)
PROMPTS = ["Count from 1 to 20, separated by commas.", "Write a Python function that reverses a string."]
MAX_TOKENS = 12


@pytest.fixture(scope="module", autouse=True)
def kernels():
    try:
        block_kernels()
    except NotImplementedError as exc:  # no kernels for this CPU or no C compiler: GGUF files are refused (test_gguf_model)
        pytest.skip(f"the block kernels do not run here: {exc}")


@pytest.fixture(scope="module")
def no_transformers_model():
    """Fails any attempt to build a transformers model from weights (the float32 reading of a GGUF
    file goes through ``from_pretrained``) for as long as it is active."""
    from transformers import AutoModelForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("a transformers model was built from weights")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
        yield


@pytest.fixture(scope="module")
def draft_file(tmp_path_factory):
    return write_model_file(DRAFT_SHAPE, default_model_path(), tmp_path_factory.mktemp("draft") / "draft-4.Q4_K_M.gguf")


@pytest.fixture(scope="module")
def drafts(loaded, engine, draft_file, no_transformers_model):
    """The three draft models, built while no transformers model may be."""
    return {
        "itself": file_draft_model(load_model(default_model_path())),
        "random": file_draft_model(load_model(draft_file)),
        "early-exit": early_exit_model(loaded, 20, engine.forward),
    }


def test_gguf_drafts_run_on_block_passes(loaded, engine, drafts):
    for name, draft in drafts.items():
        assert isinstance(draft, PassDraft) and isinstance(draft.forward, BlockPass), name
    assert drafts["random"].layout.layers == DRAFT_SHAPE.layers
    exit_pass = drafts["early-exit"].forward
    assert drafts["early-exit"].layout.layers == len(exit_pass.layers) == 20
    # the target's own products and its layer arguments for the compiled call: shared, not copied
    assert all(cut is full for cut, full in zip(exit_pass.layers, engine.forward.layers))
    assert exit_pass.layer_args is engine.forward.layer_args and exit_pass.head is engine.forward.head


def test_a_pass_cut_after_n_layers_is_the_model_cut_there(loaded, tmp_path):
    """A 4-layer GGUF file's block pass cut after 2 layers gives, bit for bit, the logits of the pass
    of the same model written with its first 2 layers only, fed in chunks through its own cache.
    Gemma 3: windows on some layers, a rotary table per layer type, q/k norms, sandwich norms."""
    model = family_model("gemma3_text", loaded.vocab_size, seed=4)
    cut = copy.deepcopy(model)
    cut.model.layers = cut.model.layers[:2]
    cut.config.num_hidden_layers = 2
    if getattr(cut.config, "layer_types", None):
        cut.config.layer_types = cut.config.layer_types[:2]
    for tiny, path in ((model, tmp_path / "four.gguf"), (cut, tmp_path / "two.gguf")):
        write_gguf(tiny, loaded.gguf_file, path)
    full = file_draft_model(load_model(tmp_path / "four.gguf"))
    two = file_draft_model(load_model(tmp_path / "two.gguf"))
    exit_two = PassDraft(full.forward.first_layers(2))
    assert exit_two.layout == two.layout and full.layout.layers == 4
    tokens = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    caches = exit_two.cache(), two.cache()
    for a, b in [(0, 6), (6, 7), (7, 10)]:
        got, expected = (cache.feed(tokens[a:b]) for cache in caches)
        assert torch.equal(got, expected), (a, b)
    assert caches[0].length == 10
    with pytest.raises(ValueError, match="1 to 3"):
        full.forward.first_layers(4)


def _decode_both(loaded, engine, draft, params):
    """Each prompt decoded plainly and with ``draft`` drafting up to 4 tokens a step (K pinned,
    every draft token kept): their tokens asserted equal; (drafted, accepted) tokens in all."""
    drafting = Engine(loaded, drafter_factory=lambda p: ModelDrafter(draft, p, loaded.vocab_size, loaded.device, min_confidence=0.0))
    drafted = accepted = 0
    for text in PROMPTS:
        prompt = loaded.chat.encode([{"role": "user", "content": text}])
        plain, _ = decode(engine, prompt, GenerationParams(**params, spec=SpecConfig(enabled=False)))
        got, _ = decode(drafting, prompt, GenerationParams(**params, spec=SpecConfig(adaptive=False, max_draft_tokens=4)))
        assert got.tokens == plain.tokens, text
        drafted, accepted = drafted + got.stats.drafted_tokens, accepted + got.stats.accepted_tokens
    return drafted, accepted


@pytest.mark.parametrize("name", ["itself", "random", "early-exit"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.95, "seed": 7}], ids=["greedy", "seeded"])
def test_speculative_with_a_gguf_draft_equals_plain(loaded, engine, drafts, name, sampling):
    drafted, accepted = _decode_both(loaded, engine, drafts[name], {"max_tokens": MAX_TOKENS, **sampling})
    assert drafted > 0
    if name == "itself":  # the same arithmetic drawing with the same noise: every draft token is the target's
        assert accepted == drafted


async def test_a_client_drafts_with_a_gguf_file_and_stays_plain(loaded, draft_file, no_transformers_model):
    messages = [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog."}]
    async with agentspec.Client(draft=str(draft_file)) as client:
        sources = client.draft_sources
        assert isinstance(sources.draft_model, PassDraft) and isinstance(sources.draft_model.forward, BlockPass)
        only_model = SpecConfig(sources=("model",), adaptive=False, max_draft_tokens=4)
        spec = await client.generate(messages, max_tokens=MAX_TOKENS, speculative=only_model, temperature=0.7, seed=3)
        plain = await client.generate(messages, max_tokens=MAX_TOKENS, speculative=False, temperature=0.7, seed=3)
    assert spec.token_ids == plain.token_ids


def swapped_vocabulary(path):
    """A vocabulary-only GGUF file: the default model's tokenizer with the tokens of ids 500 and 501
    swapped (every string still a token, two of them under each other's ids)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for field in gguf.GGUFReader(str(default_model_path())).fields.values():
        if field.name.startswith("tokenizer."):
            value, kind = field.contents(), field.types[0]
            if field.name == "tokenizer.ggml.tokens":
                value[500], value[501] = value[501], value[500]
            writer.add_key_value(field.name, value, kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


async def test_a_draft_of_another_vocabulary_is_refused_at_start(loaded, engine, tmp_path):
    """A GGUF draft whose tokenizer maps two strings to each other's ids: a ``ModelLoadError`` at
    start naming the first id that differs, before any pass of it is built."""
    vocabulary = swapped_vocabulary(tmp_path / "swapped-vocab.gguf")
    other = write_model_file(dataclasses.replace(DRAFT_SHAPE, layers=1), vocabulary, tmp_path / "swapped.gguf")
    with pytest.raises(ModelLoadError, match="tokenizer differs from the target's: token id 500"):
        await agentspec.Client(draft=str(other)).start()


def test_a_gguf_draft_holds_about_its_file(tmp_path):
    """``Client(draft=<the default model's file>)`` in a fresh process with an empty model cache: its
    peak resident memory grows by at most 1.25 times the two files (target and draft) plus 300 MB
    over the process before the load — a float32 reading of the draft is several times its file —
    and nothing is written but the compiled kernels."""
    kernels = cache_dir("kernels")
    if kernels is not None and kernels.is_dir():  # the session's compiled kernels: the subprocess need not build them again
        shutil.copytree(kernels, tmp_path / "kernels")
    path = default_model_path()
    run = load_in_a_process(tmp_path, draft=str(path))
    assert run["draft"] == "PassDraft" and run["tokens"] > 0, run
    grown, files = run["after"] - run["before"], 2 * path.stat().st_size
    assert grown < 1.25 * files + 300 * 2**20, (grown, files)
    # at most kernels compiled here (none where the package's run on this CPU), nothing of the models
    assert {p.name for p in tmp_path.iterdir()} <= {"kernels"}
    print(f"target and draft {files / 2**20:.0f} MiB: a load +{grown / 2**20:.0f} MiB")
