"""Shared fixtures. The real default model is loaded once per test session."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import agentspec
from agentspec.engine import Engine, Sequence
from agentspec.engine.lengths import CostModel
from agentspec.passes.weights import REDUCED
from agentspec.model import LoadedModel, load_model
from agentspec.params import GenerationParams
from agentspec.types import SpecConfig


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``make test`` runs one worker per core) each worker computes on its share of
    the cores: torch's default, a thread per core in every worker, would oversubscribe the machine."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


VOCABULARIES = ("qwen2", "llama-bpe")  # llama.cpp's vocabulary-only GGUF files that `make install` unpacks


# Text no pass or test was tuned on: prose, code, JSON and a list, for measures of greedy agreement
HELD_TEXT = (
    "The committee met on Tuesday to review the quarterly figures. Revenue rose by four percent, "
    "mostly from the northern region, while costs stayed flat. Two members asked why the new "
    "warehouse had opened late; the answer was a delayed permit, now resolved.\n\n"
    "def median(values):\n    ordered = sorted(values)\n    middle = len(ordered) // 2\n"
    "    if len(ordered) % 2:\n        return ordered[middle]\n    return (ordered[middle - 1] + ordered[middle]) / 2\n\n"
    '{"order_id": 4417, "customer": "Ana Ruiz", "items": [{"sku": "B-12", "qty": 3}], "status": "shipped"}\n\n'
    "Steps to reset the router: unplug it for thirty seconds, plug it back in, wait for the green "
    "light, then reconnect your laptop to the network named on the label."
)


def greedy_margins(reference: torch.Tensor, candidate: torch.Tensor) -> tuple[float, float]:
    """A measure of two passes' logits [T, V] on the same text that predicts greedy agreement:
    ``(safe, agreed)``, the share of positions where the candidate's largest logit error is under half
    the reference's margin between its two best tokens — where the candidate's greedy choice is the
    reference's by construction, however the error falls — and the share where the choices agree
    (never less). A largest error alone (``check_packed``) says nothing of the margins it meets."""
    top = reference.float().topk(2, dim=-1).values
    error = (candidate.float() - reference.float()).abs().amax(-1)
    safe = (error < (top[:, 0] - top[:, 1]) / 2).float().mean().item()
    agreed = (candidate.argmax(-1) == reference.argmax(-1)).float().mean().item()
    return safe, agreed


def real_vocab(name: str) -> str:
    """The path of a real tokenizer's vocabulary-only GGUF file (``ggml-vocab-NAME.gguf``: Qwen2's
    151,936 tokens or Llama 3's 128,256), as `make install` unpacks it from llama-cpp-python's source
    release into the virtual environment. Nothing is downloaded at test time."""
    import sys

    if name not in VOCABULARIES:
        raise ValueError(f"no vocabulary {name!r}: one of {VOCABULARIES}")
    path = os.path.join(sys.prefix, "share", "vocab", f"ggml-vocab-{name}.gguf")
    if not os.path.exists(path):
        pytest.fail(f"{path} is missing: `make install` unpacks it (rm .venv/.installed to redo the install)")
    return path


@pytest.fixture(scope="session")
def loaded() -> LoadedModel:
    """The embedded default model (SmolLM2-135M-Instruct GGUF), dequantised to fp32 on CPU."""
    return load_model()


@pytest.fixture(scope="session")
def engine(loaded: LoadedModel) -> Engine:
    engine = Engine(loaded)
    engine.calibrate()
    return engine


@pytest.fixture(scope="session")
def exact_engine(loaded: LoadedModel, engine: Engine) -> Engine:
    """An engine on the loaded model's own float32 arithmetic, for comparisons with transformers: the
    default engine, unless "auto" chose another arithmetic here ("gguf-q16" where it measures fastest); then
    the same blocks on float32 rows."""
    if engine.weights.name not in REDUCED:
        return engine
    exact = Engine(loaded, weights="gguf")
    exact.calibrate()
    return exact


def quiet_costs(costs: CostModel) -> None:
    """Set ``costs`` (in place: the client's drafters hold it) to the default pass's as calibrated on
    a quiet 2-core machine (5.6 ms for one position, 6.1 for two, then ~2.1 a position) and stop it
    from learning. Measured under the suite's two workers, a plain step can look so cheap next to a
    verification that the arbiter drafts nothing, even on a copying prompt with K pinned (CI: 0
    drafted); the tests on the shared client are about events, identity and metrics, not this
    machine's load. What the costs do is tested in test_lengths and on engines of their own."""
    quiet = CostModel(costs.max_positions)
    for positions in range(1, costs.max_positions + 1):
        quiet.record(positions, 5.6 if positions == 1 else 6.1 + 2.1 * (positions - 2))
    costs.copy_from(quiet)
    costs.segment_ms = 0.5
    costs.record = lambda positions, ms, segments=1: None  # type: ignore[method-assign]


@pytest.fixture(scope="session")
async def client(loaded: LoadedModel):
    async with agentspec.Client() as client:  # reuses the loaded weights
        quiet_costs(client.engine.costs)
        yield client


def decode(engine: Engine, prompt_ids: list[int], params: GenerationParams, max_new_tokens: int | None = None, grammar=None) -> tuple[Sequence, list[str]]:
    """Run one sequence to the end on the calling thread; returns it and the text pieces emitted."""
    seq = Sequence(list(prompt_ids), params, max_new_tokens=max_new_tokens or params.max_tokens or 32, grammar=grammar)
    engine.start(seq)
    pieces: list[str] = []
    try:
        while seq.finish_reason is None:
            pieces.append(engine.step(seq).text)
    finally:
        engine.release(seq)
    return seq, pieces


def drafted_matching_plain(target: Engine, loaded: LoadedModel, prompts: list[str], max_tokens: int = 24) -> int:
    """Greedy decoding of each prompt on ``target`` with K pinned at 8 (drafts verified at full length
    and rolled back) against plain decoding on it, asserted token for token; the tokens drafted."""
    plain = GenerationParams(max_tokens=max_tokens, spec=SpecConfig(enabled=False))
    spec = GenerationParams(max_tokens=max_tokens, spec=SpecConfig(max_draft_tokens=8, adaptive=False))
    drafted = 0
    for prompt in prompts:
        ids = loaded.chat.encode([{"role": "user", "content": prompt}])
        expected, _ = decode(target, ids, plain)
        got, _ = decode(target, ids, spec)
        assert got.tokens == expected.tokens, prompt
        drafted += got.stats.drafted_tokens
    return drafted


def tiny_model(loaded: LoadedModel, *, seed: int = 0, hidden: int = 32, layers: int = 2, init: float = 0.5) -> LoadedModel:
    """A random 2-layer Llama sharing the default tokenizer: cheap enough for statistical tests.

    ``init`` is the weight scale: larger gives peakier next-token distributions.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=loaded.vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=init,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    return loaded.with_model(model, name=f"tiny-{seed}", context_window=512)  # not the file's weights


def rewrite_gguf(source: Path, path: Path, convert: Callable[[str, Any, Any], tuple[Any, Any] | None]) -> None:
    """``source`` as a new GGUF file at ``path``: the same metadata, each tensor as ``convert(name,
    bytes or values, type)`` gives it (None: left out)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(path), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        converted = convert(tensor.name, np.asarray(tensor.data), tensor.tensor_type)
        if converted is not None:
            writer.add_tensor(tensor.name, converted[0], raw_dtype=converted[1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
