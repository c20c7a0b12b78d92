"""Text: stop strings that never leak or retract, and UTF-8-safe incremental detokenisation."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from agentspec.text import StopMatcher, TokenDecoder, token_bytes_table

# -- StopMatcher: worked examples ----------------------------------------------------------------------

# (stops, feeds, expected (emitted, hit) per feed, expected flush) -- worked out by hand
STOP_TABLE = [
    pytest.param(["\nUser:"], ["Hello\nUs", "er: hi"], [("Hello", False), ("", True)], "", id="docstring"),
    # a partial prefix is held back, then released when it turns out not to be a stop
    pytest.param(["</s>"], ["hello </", "x"], [("hello ", False), ("</x", False)], "", id="hold-then-release"),
    # a stop spanning four feeds
    pytest.param(["STOP"], ["aS", "T", "O", "Pzz"], [("a", False), ("", False), ("", False), ("", True)], "", id="span-4-feeds"),
    # text after the stop in the same feed is dropped, text before it is released
    pytest.param(["STOP"], ["ab", "cSTOPdef"], [("ab", False), ("c", True)], "", id="stop-mid-feed"),
    # several stop strings: the earliest occurrence wins, whatever the order of the list
    pytest.param(["END", "STOP"], ["a STOP b END"], [("a ", True)], "", id="earliest-wins"),
    pytest.param(["STOP", "END"], ["a END b STOP"], [("a ", True)], "", id="earliest-wins-reversed"),
    # the held tail may be the start of one stop and complete another
    pytest.param(["ab", "bc"], ["xa", "b"], [("x", False), ("", True)], "", id="held-completes"),
    pytest.param(["ab", "bc"], ["xb", "c"], [("x", False), ("", True)], "", id="held-completes-second"),
    # the longest held prefix fails, a shorter one survives: "aa" + "a" -> "aaa", hold "aa", emit "a"
    pytest.param(["aab"], ["xaa", "a", "b"], [("x", False), ("a", False), ("", True)], "", id="shorter-prefix-survives"),
    # the hold covers the longest prefix of any of the stops
    pytest.param(["xyz", "yw"], ["ax", "y"], [("a", False), ("", False)], "xy", id="hold-longest-of-several"),
    # never a stop: flush releases what is held
    pytest.param(["\nUser:"], ["abc\nUs"], [("abc", False)], "\nUs", id="flush"),
    pytest.param(["\nUser:"], ["abc"], [("abc", False)], "", id="flush-nothing-held"),
    # no stops: everything passes through
    pytest.param([], ["a", "b"], [("a", False), ("b", False)], "", id="no-stops"),
    # a stop at the very start
    pytest.param(["##"], ["##x"], [("", True)], "", id="stop-at-start"),
    # an empty feed changes nothing
    pytest.param(["ab"], ["a", "", "c"], [("", False), ("", False), ("ac", False)], "", id="empty-feed"),
]


@pytest.mark.parametrize(("stops", "feeds", "expected", "flushed"), STOP_TABLE)
def test_stop_matcher_table(stops, feeds, expected, flushed):
    matcher = StopMatcher(stops)
    got = [matcher.feed(text) for text in feeds]
    assert got == expected
    if not expected[-1][1]:
        assert matcher.flush() == flushed
        assert matcher.flush() == ""  # flushing twice releases nothing twice


def test_doctest_example():
    m = StopMatcher(["\nUser:"])
    assert m.feed("Hello\nUs") == ("Hello", False)
    assert m.feed("er: hi") == ("", True)


# -- StopMatcher: the stream property -------------------------------------------------------------------


def first_stop_cut(text: str, stops: list[str]) -> int | None:
    """Where to cut a streamed text: at the first point any stop string is complete.

    Scanning end positions left to right, the first end at which some stop ends wins; among stops
    ending there, the one starting earliest.
    """
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if end >= len(s) and text[end - len(s) : end] == s]
        if starts:
            return min(starts)
    return None


@pytest.mark.parametrize(
    "stops, chunks, expected",
    [
        (["abcd", "c"], ["xabcd"], "xab"),  # "c" completes first, inside "abcd"
        (["abcd", "c"], list("xabcd"), "xab"),
        (["</answer>", "answer"], ["ok</answer>"], "ok</"),
        (["</answer>", "answer"], ["ok</", "answer", ">"], "ok</"),
    ],
)
def test_nested_stops_first_completed_wins_however_chunked(stops, chunks, expected):
    assert feed_all(stops, chunks) == (expected, True)


def feed_all(stops: list[str], chunks: list[str]) -> tuple[str, bool]:
    """Everything a StopMatcher releases for these chunks (flushed at the end), and whether it stopped."""
    matcher = StopMatcher(stops)
    out = ""
    for chunk in chunks:
        piece, hit = matcher.feed(chunk)
        out += piece
        if hit:
            return out, True
    return out + matcher.flush(), False


@st.composite
def stream(draw):
    alphabet = "ab\n:"
    text = draw(st.text(alphabet, max_size=40))
    stops = draw(st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=3, unique=True))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=10)))
    bounds = [0, *cuts, len(text)]
    return text, stops, [text[a:b] for a, b in zip(bounds, bounds[1:])]


def longest_held(text: str, stops: list[str]) -> int:
    """The longest suffix of text that is a proper prefix of some stop: what must be held back."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


@st.composite
def stream_with_stops_from_text(draw):
    """Like ``stream``, with a wider alphabet (multi-byte characters, markup) and half of the stops cut
    from the text itself, so stops really occur, overlapping ones included."""
    alphabet = "ab \n:<>/é😀"
    text = draw(st.text(alphabet, max_size=60))
    pieces = [text[a:b] for a in range(len(text)) for b in range(a + 1, min(a + 6, len(text)) + 1)]
    taken = st.sampled_from(pieces) if pieces else st.nothing()
    stops = draw(st.lists(st.one_of(taken, st.text(alphabet, min_size=1, max_size=5)), max_size=4, unique=True))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return text, stops, [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=500, deadline=None)
@given(stream())
def test_stream_emits_exactly_the_text_before_the_first_stop(case):
    check_stream(case)


@settings(max_examples=400, deadline=None)
@given(stream_with_stops_from_text())
def test_stream_with_stops_from_the_text(case):
    check_stream(case)


def check_stream(case: tuple[str, list[str], list[str]]) -> None:
    text, stops, chunks = case
    cut = first_stop_cut(text, stops)
    expected = text if cut is None else text[:cut]

    matcher = StopMatcher(stops)
    emitted, fed, hit = "", "", False
    for chunk in chunks:
        piece, hit = matcher.feed(chunk)
        emitted += piece
        fed += chunk
        # never retracted: what is out is a prefix of the final answer, and never contains a stop
        assert expected.startswith(emitted)
        if hit:
            break
        # ... and nothing is held back that could not still become a stop (no needless delay)
        assert len(fed) - len(emitted) == longest_held(fed, stops)
    if not hit:
        emitted += matcher.flush()
    assert emitted == expected
    assert hit == (cut is not None)


@settings(max_examples=200, deadline=None)
@given(stream())
def test_one_feed_and_char_by_char_agree(case):
    text, stops, _ = case
    assert feed_all(stops, [text]) == feed_all(stops, list(text))


# -- token bytes and TokenDecoder with the real tokenizer --------------------------------------------------

TEXTS = [
    "Café crème brûlée, naïve façade",
    "日本語のテキストと中文",
    "emoji 😀🎉👍🏽 mix",
    "👨‍👩‍👧‍👦 family, 🇫🇷 flag",
    "한국어 텍스트",
    "Ελληνικά και русский",
    "“quotes” — dashes … ellipsis",
    "mixed: a😀b日c\u00e9d\n\ttabs  spaces",
    "🥐☕",
]


@pytest.mark.parametrize("text", TEXTS)
def test_decoder_streams_complete_characters(loaded, text):
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    decoder = TokenDecoder(loaded.token_bytes)
    pieces = [decoder.decode([token]) for token in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert decoder.flush() == ""
    assert "".join(pieces) == loaded.tokenizer.decode(ids) == text
    # the byte table alone reproduces the text
    assert b"".join(loaded.token_bytes[t] for t in ids) == text.encode()


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=30),
    data=st.data(),
)
def test_decoder_in_random_groups(loaded, text, data):
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    # the GGUF tokenizer itself is lossy on a few code points (it drops U+001D, and encodes
    # unassigned planes as stray continuation bytes): only texts it round-trips say anything here
    assume(loaded.tokenizer.decode(ids) == text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=6)))
    bounds = [0, *cuts, len(ids)]
    decoder = TokenDecoder(loaded.token_bytes)
    pieces = [decoder.decode(ids[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert all("\ufffd" not in piece for piece in pieces) or "\ufffd" in text
    assert "".join(pieces) + decoder.flush() == text


def _ids_by_bytes(loaded) -> dict[bytes, int]:
    table: dict[bytes, int] = {}
    for token_id, piece in enumerate(loaded.token_bytes):
        table.setdefault(piece, token_id)
    return table


@pytest.mark.parametrize(("char", "split"), [("😀", 1), ("😀", 2), ("😀", 3), ("日", 1), ("日", 2), ("é", 1), ("€", 2)])
def test_split_character_waits_for_its_last_byte(loaded, char, split):
    encoded = char.encode()
    head, tail = encoded[:split], encoded[split:]
    ids = _ids_by_bytes(loaded)
    assert head in ids and tail in ids or all(bytes([b]) in ids for b in encoded)
    # the head alone is not text
    with pytest.raises(UnicodeDecodeError):
        head.decode("utf-8")
    head_ids = [ids[head]] if head in ids else [ids[bytes([b])] for b in head]
    tail_ids = [ids[tail]] if tail in ids else [ids[bytes([b])] for b in tail]
    decoder = TokenDecoder(loaded.token_bytes)
    for token in head_ids:
        assert decoder.decode([token]) == ""
    out = [decoder.decode([token]) for token in tail_ids]
    assert out[:-1] == [""] * (len(out) - 1) and out[-1] == char
    assert decoder.flush() == ""


def test_real_split_token_from_the_tokenizer(loaded):
    """A token the tokenizer itself produces that ends inside a character (e.g. 0xF0 0x9F of an emoji)."""
    ids = loaded.tokenizer.encode("😀", add_special_tokens=False)
    pieces = [loaded.token_bytes[t] for t in ids]
    first_invalid = next(i for i, piece in enumerate(pieces) if not _valid_utf8(piece))
    decoder = TokenDecoder(loaded.token_bytes)
    outputs = [decoder.decode([t]) for t in ids]
    assert first_invalid == 0 and outputs[0] == ""
    assert "".join(outputs) == "😀" and outputs[-1] == "😀"


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_flush_marks_an_unfinished_character(loaded):
    ids = _ids_by_bytes(loaded)
    decoder = TokenDecoder(loaded.token_bytes)
    assert decoder.decode([ids[b"a"], ids[bytes([0xF0])]]) == "a"
    assert decoder.flush() == "\ufffd"
    assert decoder.flush() == ""


def test_special_tokens_contribute_no_bytes(loaded):
    tokenizer = loaded.tokenizer
    for name in ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]:
        assert name in tokenizer.get_vocab()
        token_id = tokenizer.convert_tokens_to_ids(name)
        assert loaded.token_bytes[token_id] == b""
    for token_id in tokenizer.all_special_ids:
        assert loaded.token_bytes[token_id] == b""
    assert len(loaded.token_bytes) == loaded.vocab_size


def test_table_pads_a_larger_vocabulary(loaded):
    table = token_bytes_table(loaded.tokenizer, len(loaded.tokenizer) + 5)
    assert table[-5:] == [b""] * 5
    assert table[: len(loaded.tokenizer)] == loaded.token_bytes[: len(loaded.tokenizer)]


def test_table_agrees_with_the_tokenizer_on_ordinary_tokens(loaded):
    tokenizer = loaded.tokenizer
    special = set(tokenizer.all_special_ids)
    for token_id in range(0, loaded.vocab_size, 97):
        if token_id in special:
            continue
        piece = loaded.token_bytes[token_id]
        if _valid_utf8(piece):
            assert piece.decode() == tokenizer.decode([token_id]), token_id
