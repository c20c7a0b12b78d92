"""Stops land exactly where plain decoding stops, also in the middle of an accepted draft block.

An oracle drafter proposes plain decoding's own continuation (and, past a stop token, what the model
would say next), so every draft is accepted in full and stops necessarily fall inside blocks.
"""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

from agentspec.drafting import Draft
from agentspec.engine import Engine
from agentspec.params import GenerationParams
from agentspec.types import SpecConfig

from .conftest import decode

PROMPT = "List the planets of the solar system, separated by commas."
SHORT = "Say hello."  # answered in ~29 tokens, then the model would go on past its stop token


class OracleDrafter:
    def __init__(self, continuation: list[int]) -> None:
        self.continuation = continuation
        self.generated = 0

    def reset(self, prompt: Sequence[int]) -> None:
        self.generated = 0

    def propose(self, k: int) -> Draft:
        return Draft(self.continuation[self.generated : self.generated + k], source="ngram", evidence=4)

    def observe(self, committed: Sequence[int]) -> None:
        self.generated += len(committed)


@pytest.fixture(scope="module")
def prompt_ids(loaded):
    return loaded.chat.encode([{"role": "user", "content": PROMPT}])


def greedy_ignoring_stops(loaded, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy continuation that ignores stop tokens: what the model says at and after its EOS."""
    with torch.inference_mode():
        out = loaded.model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module")
def unstopped(loaded, prompt_ids):
    return greedy_ignoring_stops(loaded, prompt_ids, 48)


def oracle_engine(engine: Engine, continuation: list[int]) -> Engine:
    oracle = Engine(engine.loaded, weights=engine.weights.name, drafter_factory=lambda params: OracleDrafter(continuation))
    oracle.costs = engine.costs
    return oracle


def pinned(k: int, **params) -> GenerationParams:
    return GenerationParams(spec=SpecConfig(max_draft_tokens=k, adaptive=False), **params)


def test_stop_token_inside_an_accepted_block(exact_engine, loaded):
    """On the loaded model's own arithmetic, which transformers' continuation past the stop is of."""
    engine = exact_engine
    prompt_ids = loaded.chat.encode([{"role": "user", "content": SHORT}])
    unstopped = greedy_ignoring_stops(loaded, prompt_ids, 48)
    stops = loaded.stop_token_ids
    eos_at = next(i for i, t in enumerate(unstopped) if t in stops)
    assert eos_at + 4 < len(unstopped), "the model keeps talking after its stop token"
    plain, _ = decode(engine, prompt_ids, GenerationParams(max_tokens=80, spec=SpecConfig(enabled=False)))
    assert plain.tokens[len(prompt_ids) :] == unstopped[: eos_at + 1]
    for k in (3, 8):
        seq, pieces = decode(oracle_engine(engine, unstopped), prompt_ids, pinned(k, max_tokens=80))
        assert seq.tokens == plain.tokens, "no token past the stop token may leak"
        assert seq.output_ids == unstopped[:eos_at]
        assert seq.finish_reason == "stop"
        assert seq.stats.accepted_tokens >= eos_at - seq.stats.target_forward_passes


@pytest.mark.parametrize("k", [2, 8])
@pytest.mark.parametrize("position", [3, 7, 12])
def test_stop_string_inside_an_accepted_block(engine, loaded, prompt_ids, unstopped, k, position):
    plain, pieces = decode(engine, prompt_ids, GenerationParams(max_tokens=40, spec=SpecConfig(enabled=False)))
    plain_text = "".join(pieces)
    output = plain.output_ids
    stop = loaded.tokenizer.decode(output[position : position + 2])  # text of two tokens mid-output
    assert stop.strip() and stop in plain_text
    expected_text = plain_text[: plain_text.index(stop)]
    seq, pieces = decode(oracle_engine(engine, unstopped), prompt_ids, pinned(k, max_tokens=40, stop=[stop]))
    assert "".join(pieces) == expected_text
    assert seq.finish_reason == "stop"
    # decoding ends at the token that completes the stop string, exactly as plain decoding would
    cut, _ = decode(engine, prompt_ids, GenerationParams(max_tokens=40, stop=[stop], spec=SpecConfig(enabled=False)))
    assert seq.tokens == cut.tokens


@pytest.mark.parametrize("max_tokens", [1, 4, 9])
def test_max_tokens_inside_a_block(engine, prompt_ids, unstopped, max_tokens):
    seq, _ = decode(oracle_engine(engine, unstopped), prompt_ids, pinned(8, max_tokens=max_tokens))
    assert seq.finish_reason == "length"
    assert seq.output_ids == unstopped[:max_tokens]


def test_text_is_never_retracted_and_stop_prefix_is_held(engine, loaded, prompt_ids, unstopped):
    plain, pieces = decode(engine, prompt_ids, GenerationParams(max_tokens=40, spec=SpecConfig(enabled=False)))
    text = "".join(pieces)
    # a stop string whose first half occurs in the output but which never completes
    prefix = text[10:16]
    never = prefix + "\x00never"
    seq, held = decode(oracle_engine(engine, unstopped), prompt_ids, pinned(4, max_tokens=40, stop=[never]))
    assert "".join(held) == text  # released in full at the end
    emitted = ""
    for piece in held:
        emitted += piece
        assert text.startswith(emitted)
