"""Copying across moved token boundaries (``drafting.byte_ngrams``): the case it exists for on the real
tokenizer, and an exhaustive check that with one-byte tokens it is exactly the token n-gram index."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentspec.drafting.ngram import NgramDrafter, NgramIndex
from agentspec.drafting.byte_ngrams import ByteNgramIndex

PROMPT = "Send an e-mail to maria.garcia@example.com about the Harbor 4.2 upgrade."


def encode(loaded, text: str) -> list[int]:
    return loaded.tokenizer.encode(text, add_special_tokens=False)


def byte_ngrams(loaded, **kwargs) -> ByteNgramIndex:
    return ByteNgramIndex(loaded.token_bytes, lambda text: encode(loaded, text), **kwargs)


def test_a_json_value_copies_text_the_prompt_tokenized_differently(loaded):
    prompt = encode(loaded, PROMPT)
    output = encode(loaded, '{"to":"') + encode(loaded, "mar")  # the value starts after a quote: no leading space
    assert output[-1] not in prompt  # ' maria' is one token in the prompt: a token n-gram has nothing to go on
    index = byte_ngrams(loaded)
    index.extend(prompt + output)
    draft, covered = index.propose(8)
    assert covered == 1  # the last token's bytes, found inside ' maria'
    assert len(draft) >= 5
    assert ("mar" + loaded.tokenizer.decode(draft)).startswith("maria.garcia@example")
    # the draft is how the tokenizer spells the address after its first token "mar" (what the model writes)
    canonical = encode(loaded, "maria.garcia@example.com")
    assert canonical[0] == output[-1]
    assert draft[: len(canonical) - 1] == canonical[1 : 1 + len(draft)]


def test_pending_tokens_extend_the_key(loaded):
    index = byte_ngrams(loaded)
    index.extend(encode(loaded, PROMPT) + encode(loaded, '{"subject":"'))
    draft, covered = index.propose(4, pending=encode(loaded, "Harbor"))
    assert covered >= 1
    assert loaded.tokenizer.decode(draft).startswith(" 4.2")


def test_a_copy_stops_at_a_special_token(loaded):
    im_end = loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")
    index = byte_ngrams(loaded)
    index.extend(encode(loaded, "the code is XK-42") + [im_end] + encode(loaded, "code is XK"))
    draft, covered = index.propose(8)
    assert covered >= 2 and im_end not in draft
    assert loaded.tokenizer.decode(draft) == "-42"


def test_keys_shorter_than_min_bytes_and_no_earlier_occurrence_propose_nothing(loaded):
    index = byte_ngrams(loaded, min_bytes=4)
    index.extend(encode(loaded, "abc xyz abc"))
    assert index.propose(4) == ([], 0)  # " abc" has no earlier occurrence; "abc" is too short
    assert byte_ngrams(loaded).propose(4) == ([], 0)  # empty text
    index.extend(encode(loaded, " xyz"))
    assert index.propose(0) == ([], 0)


def test_the_drafter_takes_a_span_only_when_it_covers_more_tokens(loaded):
    drafter = NgramDrafter(min_n=1, max_n=8, loaded=loaded)
    drafter.reset(encode(loaded, PROMPT))
    drafter.observe(encode(loaded, '{"to":"') + encode(loaded, "mar"))
    draft = drafter.propose(6)
    assert (draft.source, draft.evidence) == ("ngram", 1)
    assert ("mar" + loaded.tokenizer.decode(draft.tokens)).startswith("maria.garcia")
    tokens_only = NgramDrafter(min_n=1, max_n=8)
    tokens_only.reset(encode(loaded, PROMPT))
    tokens_only.observe(encode(loaded, '{"to":"') + encode(loaded, "mar"))
    assert tokens_only.propose(6).tokens != draft.tokens
    # where a token n-gram matches as many tokens, it is the one proposed
    both = NgramDrafter(min_n=1, max_n=8, loaded=loaded)
    both.reset(encode(loaded, PROMPT))
    both.observe(encode(loaded, " Send an e-mail"))
    expected = NgramDrafter(min_n=1, max_n=8)
    expected.reset(encode(loaded, PROMPT))
    expected.observe(encode(loaded, " Send an e-mail"))
    assert both.propose(6) == expected.propose(6)


LETTERS = [bytes([ord("a") + i]) for i in range(4)]  # a one-byte vocabulary: token i is the letter i


def letters(text: str) -> list[int]:
    return [ord(c) - ord("a") for c in text]


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=30),
    pending=st.lists(st.integers(0, 3), max_size=3),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(0, 6),
)
def test_with_one_byte_tokens_spans_are_token_ngrams(tokens, pending, min_n, extra, k):
    """Every token boundary is a byte boundary here, so matching bytes is matching tokens."""
    max_n = min_n + extra
    index = ByteNgramIndex(LETTERS, letters, max_n=max_n, min_bytes=min_n)
    reference = NgramIndex(min_n=min_n, max_n=max_n)
    index.extend(tokens)
    reference.extend(tokens)
    assert index.propose(k, pending) == reference.propose(k, pending)


@pytest.mark.parametrize("longer_than", [0, 1, 2])
def test_longer_than_bounds_the_match(longer_than):
    index = ByteNgramIndex(LETTERS, letters, max_n=4, min_bytes=1)
    index.extend(letters("abcdbcdacd"))  # of the last tokens, "cd" repeats (most recently at 5..6, then "ac"), "acd" does not
    draft, covered = index.propose(2, longer_than=longer_than)
    expected = {0: (letters("ac"), 2), 1: (letters("ac"), 2), 2: ([], 0)}[longer_than]
    assert (draft, covered) == expected
