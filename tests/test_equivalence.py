"""Greedy speculative decoding == plain decoding == transformers' generate, token for token.

Real default model, 20 agent-style prompts, K in {1, 4, 8} with K pinned (adaptive=False), so every
available n-gram draft is verified at full length: acceptances, rejections and rollbacks all happen.
Speculative against plain decoding on the default engine (whatever its pass, reduced precision
included); plain decoding against transformers on the loaded model's own float32 arithmetic
(``exact_engine``: the default engine, or "gguf" where "auto" chose "gguf-q16").
"""

from __future__ import annotations

import pytest
import torch

from agentspec.params import GenerationParams
from agentspec.types import SpecConfig

from .conftest import decode

MAX_TOKENS = 32

DOC = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. It is 330 metres tall and was the tallest man-made structure in the world until 1930."
)
CODE = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n"

PROMPTS = [
    f"{DOC}\n\nQuote the sentence about the height of the tower.",
    f"{DOC}\n\nWho designed the tower? Answer with a quote from the text.",
    f"{DOC}\n\nSummarise the text in one sentence.",
    f"Rename `width` to `w` in this code and return the full code:\n{CODE}",
    f"Add type hints to this code:\n{CODE}",
    f"Repeat exactly: {DOC}",
    "Count from 1 to 30, separated by commas.",
    "List the days of the week, one per line.",
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Tell me a short story about a dragon.",
    "Translate to French: The cat sleeps on the warm windowsill.",
    "Écris une phrase sur le café ☕ et les croissants 🥐.",
    "请用中文介绍一下长城。",
    'Return a JSON object with keys "name" and "email" for John Smith, john@example.com.',
    "Explain what a hash map is in two sentences.",
    "user: hi\nassistant: hello\nuser: hi\nassistant: hello\nuser: hi\nContinue the pattern.",
    "Write a Python function that reverses a string.",
    "Give three tips for writing clear emails.",
    "Spell the word 'necessary' letter by letter, separated by dashes.",
]


@pytest.fixture(scope="module")
def references(loaded, engine, exact_engine):
    """Per prompt: (prompt ids, transformers greedy tokens, agentspec plain tokens on the default
    engine, and on the exact one), computed once."""
    cache: dict[int, tuple[list[int], list[int], list[int], list[int]]] = {}

    def get(index: int):
        if index not in cache:
            prompt_ids = loaded.chat.encode([{"role": "user", "content": PROMPTS[index]}])
            with torch.inference_mode():
                hf = loaded.model.generate(
                    torch.tensor([prompt_ids]),
                    attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                    max_new_tokens=MAX_TOKENS,
                    do_sample=False,
                    eos_token_id=sorted(loaded.stop_token_ids),
                    pad_token_id=sorted(loaded.stop_token_ids)[0],
                )[0, len(prompt_ids) :].tolist()
            plain_params = GenerationParams(max_tokens=MAX_TOKENS, spec=SpecConfig(enabled=False))
            plain, _ = decode(engine, prompt_ids, plain_params)
            assert plain.stats.drafted_tokens == 0
            exact = plain if exact_engine is engine else decode(exact_engine, prompt_ids, plain_params)[0]
            cache[index] = (prompt_ids, hf, plain.tokens[len(prompt_ids) :], exact.tokens[len(prompt_ids) :])
        return cache[index]

    return get


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_plain_matches_transformers_generate(references, index):
    _, hf, _, exact = references(index)
    assert exact == hf


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_speculative_matches_plain(references, engine, index, k):
    prompt_ids, _, plain, _ = references(index)
    params = GenerationParams(max_tokens=MAX_TOKENS, spec=SpecConfig(max_draft_tokens=k, adaptive=False))
    seq, _ = decode(engine, prompt_ids, params)
    assert seq.tokens[len(prompt_ids) :] == plain
    # every pass commits its accepted drafts plus one token, except that a stop may end the last early
    passes, accepted = seq.stats.target_forward_passes, seq.stats.accepted_tokens
    assert passes + accepted - 1 <= seq.generated <= passes + accepted


def test_drafts_are_exercised(references, engine):
    """The K sweep is only meaningful if drafts get both accepted and rejected across the prompts."""
    accepted = rejected = 0
    for index in (0, 3, 5, 6, 9):
        prompt_ids, _, _, _ = references(index)
        params = GenerationParams(max_tokens=MAX_TOKENS, spec=SpecConfig(max_draft_tokens=8, adaptive=False))
        seq, _ = decode(engine, prompt_ids, params)
        accepted += seq.stats.accepted_tokens
        rejected += seq.stats.rollbacks
    assert accepted > 20 and rejected > 5


@pytest.mark.parametrize("index", [0, 3, 6, 10])
def test_adaptive_and_repetition_penalty_match_plain(engine, loaded, index):
    prompt_ids = loaded.chat.encode([{"role": "user", "content": PROMPTS[index]}])
    for penalty in (1.0, 1.3):
        plain, _ = decode(engine, prompt_ids, GenerationParams(max_tokens=MAX_TOKENS, repetition_penalty=penalty, spec=SpecConfig(enabled=False)))
        fixed, _ = decode(engine, prompt_ids, GenerationParams(max_tokens=MAX_TOKENS, repetition_penalty=penalty, spec=SpecConfig(adaptive=False)))
        adaptive, _ = decode(engine, prompt_ids, GenerationParams(max_tokens=MAX_TOKENS, repetition_penalty=penalty))
        assert fixed.tokens == plain.tokens
        assert adaptive.tokens == plain.tokens
