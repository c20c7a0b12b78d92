"""``tool_choice="auto"`` as real models write calls: the lazy triggers of ``structured.triggers``.

Two levels. On the real Qwen2 and Llama 3 tokenizers (llama.cpp's vocabulary-only files), with no
model: every opening of every family decides a call from its bytes whatever the tokenization (the
canonical one, byte by byte, random chunks), text openings and prose stay text, and the forced rest
of a call transcribes to a valid ``ToolCall``. On the engine: a scripted opening (``Scripted``, a
test-only grammar that forces a prefix and then hands over to the grammar under test) on the real
default model and on a tiny random model with Qwen2's real vocabulary; the model and the trigger go
on from there, and speculative decoding equals plain decoding token for token, greedy and seeded.
"""

from __future__ import annotations

import random

import jsonschema
import pytest
import torch

import agentspec
from agentspec.chat import ChatFormat
from agentspec.engine import Engine
from agentspec.gguf import read_gguf
from agentspec.gguf.config import model_tokenizer
from agentspec.params import GenerationParams
from agentspec.structured.formats import FORMATS, CallTranscriber
from agentspec.structured.grammar import GrammarCompiler
from agentspec.structured.tools import ToolCallParser, parse_tools
from agentspec.structured.triggers import AutoCallGrammar
from agentspec.text import token_bytes_table
from agentspec.types import SpecConfig

from .conftest import decode, real_vocab

MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "multiply_all",  # a name that extends another: only the closing quote decides
        "parameters": {"type": "object", "properties": {"values": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3}}, "required": ["values"]},
    },
}
PICK = {
    "type": "function",
    "function": {"name": "pick", "parameters": {"type": "object", "properties": {"flag": {"type": "boolean"}}, "required": ["flag"]}},
}
SPECS = tuple(parse_tools([MULTIPLY, LOOKUP], "auto")[0])
PARAMETERS = {t.name: t.parameters for t in parse_tools([MULTIPLY, LOOKUP, PICK], "auto")[0]}
FAMILY = {fmt.family: fmt for fmt in FORMATS}  # one Mistral spelling is enough here
PYTHON_TAG = "<|python_tag|>"
FUNCTION_TAGS = ("<function=", '<function name="')


class Scripted:
    """A test-only grammar: forces the tokens of ``prefix`` one by one, feeding each to ``then`` (the
    grammar under test, which sees them as the model's), and hands over to ``then`` after them.
    ``then`` None: free text after the prefix."""

    def __init__(self, prefix: list[int], then: AutoCallGrammar | None, vocab_size: int) -> None:
        self.prefix, self.then = list(prefix), then
        self._keys: list[tuple[int, int]] = []
        self._ids: dict[tuple[int, int], int] = {}
        self._one_hot = torch.zeros(len(self.prefix), vocab_size, dtype=torch.bool)
        self._one_hot[torch.arange(len(self.prefix)), self.prefix] = True
        self._free = torch.ones(vocab_size, dtype=torch.bool)
        self.initial_state = self._id((0, then.initial_state if then is not None else 0))

    def _id(self, key: tuple[int, int]) -> int:
        if key not in self._ids:
            self._ids[key] = len(self._keys)
            self._keys.append(key)
        return self._ids[key]

    def _inner(self, state: int) -> tuple[int, int]:
        return self._keys[state]

    def advance(self, state: int, token: int) -> int | None:
        at, inner = self._inner(state)
        if at < len(self.prefix) and token != self.prefix[at]:
            return None
        following = self.then.advance(inner, token) if self.then is not None else 0
        return None if following is None else self._id((min(at + 1, len(self.prefix)), following))

    def next_state(self, state: int, token: int) -> int:
        following = self.advance(state, token)
        assert following is not None
        return following

    def mask(self, state: int) -> torch.Tensor:
        at, inner = self._inner(state)
        if at < len(self.prefix):
            return self._one_hot[at]
        return self.then.mask(inner) if self.then is not None else self._free

    def forced(self, state: int) -> list[int]:
        at, inner = self._inner(state)
        if at < len(self.prefix):
            return self.prefix[at:]
        return self.then.forced(inner) if self.then is not None else []

    def held(self, state: int) -> int | None:
        at, inner = self._inner(state)
        return self.then.held(inner) if self.then is not None and at == len(self.prefix) else None

    def unconstrained(self, state: int) -> bool:
        at, inner = self._inner(state)
        return at == len(self.prefix) and (self.then is None or self.then.unconstrained(inner))

    def undecided(self, state: int) -> bool:
        return self.then is not None and self.then.undecided(self._inner(state)[1])

    def is_call(self, state: int) -> bool:
        return self.then is not None and self.then.is_call(self._inner(state)[1])

    def is_complete(self, state: int) -> bool:
        return self.then is not None and self.then.is_complete(self._inner(state)[1])


# -- the real tokenizers, no model ----------------------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen2", "llama-bpe"])
def vocab(request):
    """(name, tokenizer, its token bytes, a grammar compiler): the real vocabulary, with Llama 3.x's
    ``<|python_tag|>`` added as a special token (llama.cpp's file is Llama 3.0's, which has none)."""
    tokenizer = model_tokenizer(read_gguf(real_vocab(request.param)))
    tokenizer.add_special_tokens({"additional_special_tokens": [PYTHON_TAG]})
    token_bytes = token_bytes_table(tokenizer, len(tokenizer))
    compiler = GrammarCompiler(token_bytes, tokenizer, frozenset({tokenizer.eos_token_id}), torch.device("cpu"))
    return request.param, tokenizer, token_bytes, compiler


def tokenizations(tokenizer, compiler, text: str, rng: random.Random) -> list[list[int]]:
    """``text`` as the tokenizer writes it, byte by byte, and in random chunks of canonical tokens."""
    canonical = tokenizer.encode(text, add_special_tokens=False)
    data = text.encode()
    cuts = sorted(rng.sample(range(1, len(data)), min(6, len(data) - 1)))
    chunked = [t for a, b in zip([0, *cuts], [*cuts, len(data)]) for t in compiler.encode(data[a:b])]
    by_byte = [compiler.byte_token[b] for b in data] if PYTHON_TAG not in text else canonical
    return [canonical, by_byte, chunked]


def finish_call(grammar, compiler, state: int, tokens: list[int], limit: int = 200, until: int | None = None) -> list[int]:
    """Drive a call to its end: the forced tokens, elsewhere the first allowed token (a quote where
    one is allowed, so strings end), up to where an end token (or the choice of ``until``, a call's
    continuation) is allowed."""
    quote = compiler.byte_token[ord('"')]
    for _ in range(limit):
        if grammar.is_complete(state):
            break
        mask = grammar.mask(state)
        if any(bool(mask[t]) for t in compiler.stop_token_ids) or (until is not None and bool(mask[until]) and int(mask.sum()) <= 2):
            break
        forced = grammar.forced(state)
        token = forced[0] if forced else quote if bool(mask[quote]) else int(mask.nonzero()[0])
        state = grammar.next_state(state, token)
        tokens.append(token)
    return tokens


def follow(grammar, compiler, state: int, tokens: list[int], text: bytes) -> int:
    """Go on writing ``text`` (past the bytes of ``tokens``) under the grammar's masks: each step the
    longest allowed token that agrees with the rest of it, until it is written (``tokens`` grows)."""
    written = b"".join(grammar.markers.get(t, compiler.token_bytes[t]) for t in tokens)
    rest = text[len(written) :]
    while rest:
        pieces = {t: compiler.token_bytes[t] for t in grammar.mask(state).nonzero().flatten().tolist()}
        allowed = [t for t, piece in pieces.items() if piece and (rest.startswith(piece) or piece.startswith(rest))]
        if not allowed:
            break
        token = max(allowed, key=lambda t: len(pieces[t]))
        state = grammar.next_state(state, token)
        tokens.append(token)
        rest = rest[len(compiler.token_bytes[token]) :]
    return state


def calls_of(text: str) -> list[agentspec.ToolCall]:
    parser = ToolCallParser()
    events = parser.feed(CallTranscriber().feed(text)) + parser.finish()
    return [e for e in events if isinstance(e, agentspec.ToolCall)]


# (family, opening text up to and past the name, the call's closing): each family's own syntax and
# the variants its models write.
OPENINGS = [
    (None, '{"name":"multiply","', ""),
    (None, '```json\n{"name": "multiply", "', "\n```"),
    (None, '  \n```\n{"name": "multiply_all"', "\n```"),
    ("hermes", '<tool_call>\n{"name": "multiply", "', "\n</tool_call>"),
    ("hermes", '```json\n{"name": "multiply_all", "arg', "\n```"),
    ("hermes", '\n{"name": "multiply"', ""),
    ("hermes", '<function=multiply_all>', "</function>"),  # Hermes 2 Pro's tag (llama.cpp takes it too)
    ("hermes", ' <function name="multiply">', "</function>"),
    # the other tags and fence llama.cpp's Hermes 2 Pro handler takes, a fence before a tag
    ("hermes", '<tools>\n{"name": "multiply", "', "\n</tools>"),
    ("hermes", '<json>{"name":"multiply_all","', "\n</json>"),
    ("hermes", '```xml\n{"name": "multiply"', "\n```"),
    ("hermes", '```xml\n<tool_call>\n{"name": "multiply_all"', "\n</tool_call>\n```"),
    ("hermes", '```json\n <tools> {"name": "multiply"', "\n</tools>\n```"),
    ("hermes", '<function_call>\n{"name": "multiply"', "\n</function_call>"),
    ("hermes", '<response>{"name": "multiply"', "\n</response>"),
    ("hermes", '<tool>\n{"name": "multiply"', "\n</tool>"),
    ("hermes", '<JSON>\n{"name": "multiply"', "\n</JSON>"),
    ("hermes", '<xml>\n[{"name": "multiply"', "]\n</xml>"),
    ("llama3", '{"name": "multiply", "', ""),
    ("llama3", PYTHON_TAG + '{"name": "multiply_all"', ""),
    # the key the model writes, whichever family
    ("llama3", '{"name": "multiply", "arguments"', ""),
    ("hermes", '<tool_call>\n{"name": "multiply", "param', "\n</tool_call>"),
    (None, '{"name":"multiply_all","parameters', ""),
    ("mistral", '[TOOL_CALLS] [{"name": "multiply", "', "]"),
    ("mistral", '[{"name": "multiply"', "]"),
]
TEXTS = [
    "```python\nprint(6 * 7)",
    '{"name": "divide", "arguments": {}}',  # names no tool
    '{"a": 6, "b": 7}',  # JSON, not a call
    'The call is {"name": "multiply", "arguments": {"a": 6}}',  # prose with inline JSON
    '```json\n{"result": 42}',
    '{"name": "multiply_alls"',
    "<function=divide>",
    "<functions>",
    "<tools> are listed above",
    '<json>{"result": 42}</json>',
    "```xml\n<root/>",
    '```xml\n<tool_call>\n{"name": "divide"',
    '<tools>\n{"name": "multiply_all_of_them"',
    'Use <tools>{"name": "multiply", "arguments": {"a": 6}}',  # prose with an inline tag
]


@pytest.mark.parametrize("family, opening, closing", OPENINGS)
def test_an_opening_decides_a_call_whatever_the_tokenization(vocab, family, opening, closing):
    name, tokenizer, token_bytes, compiler = vocab
    fmt = FAMILY.get(family)
    grammar = AutoCallGrammar(compiler, SPECS, fmt, parallel=False)
    rng = random.Random(0)
    outputs = set()
    for tokens in tokenizations(tokenizer, compiler, opening, rng):
        state, written = grammar.initial_state, []
        for token in tokens:  # up to the decision: nothing is masked
            assert grammar.undecided(state) and grammar.unconstrained(state)
            state = grammar.next_state(state, token)
            written.append(token)
            if not grammar.undecided(state):
                break
        assert grammar.is_call(state), (opening, tokens)
        state = follow(grammar, compiler, state, written, opening.encode())  # the rest: a key the model chose
        tokens = finish_call(grammar, compiler, state, written)  # on from the bytes written (a token may straddle the name's end)
        text = b"".join(compiler.token_bytes[t] if t not in grammar.markers else grammar.markers[t] for t in tokens).decode()
        (call,) = calls_of(text)
        assert call.name in opening and text.endswith("}" + closing), text
        if opening.lstrip().startswith(FUNCTION_TAGS):  # the arguments alone inside the tag
            assert text.startswith(opening) and text[len(opening)] == "{"
        else:
            assert text.startswith(opening[: opening.index('"', opening.index(call.name)) + 1]) and f'"{call.name}"' in text
            own = "parameters" if family == "llama3" else "arguments"
            key = "parameters" if '"param' in opening else "arguments" if '"arg' in opening else own
            assert f'"{key}":' in text  # the key the model wrote, else the family's, whichever the opening
        jsonschema.validate(call.arguments, PARAMETERS[call.name])
        outputs.add(text)
    assert len(outputs) == 1  # the same call however the opening was tokenized


def test_every_opening_transcribes_to_the_same_calls_under_any_chunking():
    """The call text of each opening (as the grammar makes the model write it) → the same events,
    however the verified text is cut into steps."""
    texts = [
        '```json\n{"name": "multiply", "arguments": {"a":6,"b":7}}\n```\n```json\n{"name": "multiply_all", "arguments": {"values":[1]}}\n```',
        '<tool_call>\n{"name":"multiply","arguments":{"a":6,"b":7}}\n</tool_call>\n<tool_call>\n{"name":"multiply_all","arguments":{"values":[1]}}\n</tool_call>',
        '[TOOL_CALLS] [{"name": "multiply", "arguments": {"a":6,"b":7}}, {"name": "multiply_all", "arguments": {"values":[1]}}]',
        '<function=multiply>{"a":6,"b":7}</function><function name="multiply_all">{"values":[1]}</function>',
        '{"name": "multiply", "parameters": {"a":6,"b":7}}\n{"name": "multiply_all", "parameters": {"values":[1]}}',
    ]
    rng = random.Random(0)
    for text in texts:
        for _ in range(30):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
            transcriber, parser, events = CallTranscriber(), ToolCallParser(), []
            for a, b in zip([0, *cuts], [*cuts, len(text)]):
                events += parser.feed(transcriber.feed(text[a:b]))
            calls = [e for e in events + parser.finish() if isinstance(e, agentspec.ToolCall)]
            assert [(c.index, c.name, c.arguments) for c in calls] == [(0, "multiply", {"a": 6, "b": 7}), (1, "multiply_all", {"values": [1]})], text


def test_a_special_marker_before_a_further_call_is_written_as_its_text():
    """Mistral's ``[TOOL_CALLS]`` is a special token, which writes no bytes of its own. After a bare
    call that opened with it, a further call (parallel calls) opens with the marker again: forced
    there, the marker token stands for its text, so the call goes on past it to the next name (it
    once left the fixed text where it was, and the marker was forced again and again)."""
    tokenizer = model_tokenizer(read_gguf(real_vocab("llama-bpe")))
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    compiler = GrammarCompiler(token_bytes_table(tokenizer, len(tokenizer)), tokenizer, frozenset({tokenizer.eos_token_id}), torch.device("cpu"))
    marker = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    grammar = AutoCallGrammar(compiler, SPECS, FAMILY["mistral"], parallel=True)
    opening = b'[TOOL_CALLS]{"name": "multiply", "'
    state, tokens = grammar.initial_state, []
    for token in [marker, *compiler.encode(opening[len(b"[TOOL_CALLS]") :])]:
        state = grammar.next_state(state, token)
        tokens.append(token)
        if not grammar.undecided(state):
            break
    assert grammar.is_call(state)
    tokens = finish_call(grammar, compiler, follow(grammar, compiler, state, tokens, opening), tokens)
    state = grammar.initial_state
    for token in tokens:
        state = grammar.next_state(state, token)
    further = [t for t in grammar.mask(state).nonzero().flatten().tolist() if t not in compiler.stop_token_ids]
    assert further, "a further call may follow"
    state, written = grammar.next_state(state, further[0]), [further[0]]
    for _ in range(12):  # the forced text up to the next call's name
        forced = grammar.forced(state)
        if not forced:
            break
        state = grammar.next_state(state, forced[0])
        written.append(forced[0])
    text = b"".join(grammar.markers.get(t, compiler.token_bytes[t]) for t in written)
    assert written.count(marker) == 1 and b'[TOOL_CALLS]\n{"name"' in text, text


@pytest.mark.parametrize("family", [None, "llama3"])
def test_a_token_straddling_the_names_end_chooses_the_spacing(vocab, family):
    """'"name": "multiply' then the one token '","': the call goes on compact from its leftover ',"'."""
    _, tokenizer, _, compiler = vocab
    (straddling,) = compiler.encode(b'","')
    grammar = AutoCallGrammar(compiler, SPECS, FAMILY.get(family), parallel=False)
    state, tokens = grammar.initial_state, [*compiler.encode(b'{"name": "multiply'), straddling]
    for token in tokens:
        state = grammar.next_state(state, token)
    assert grammar.is_call(state)
    text = b"".join(compiler.token_bytes[t] for t in finish_call(grammar, compiler, state, tokens)).decode()
    key = "parameters" if family else "arguments"
    assert text.startswith(f'{{"name": "multiply","{key}":{{"a":') and calls_of(text)[0].name == "multiply"


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("family", [None, "hermes", "llama3", "mistral"])
def test_text_openings_and_prose_stay_text(vocab, family, text):
    _, tokenizer, _, compiler = vocab
    grammar = AutoCallGrammar(compiler, SPECS, FAMILY.get(family), parallel=True)
    state = grammar.initial_state
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert grammar.unconstrained(state)
        state = grammar.next_state(state, token)
    assert state == grammar.TEXT and grammar.unconstrained(state) and not grammar.is_call(state)


@pytest.mark.parametrize("family", [None, "hermes", "llama3", "mistral"])
def test_the_arguments_key_follows_the_models_bytes(vocab, family):
    """After the name either key may follow, in every family: the mask allows the first token of
    each, the family's own is drafted, and the call transcribes the same whichever was written."""
    _, tokenizer, _, compiler = vocab
    grammar = AutoCallGrammar(compiler, SPECS, FAMILY.get(family), parallel=False)
    opening = '[{"name": "multiply", "' if family == "mistral" else '{"name": "multiply", "'
    tokens = tokenizer.encode(opening, add_special_tokens=False)
    start = grammar.initial_state
    for token in tokens:
        start = grammar.next_state(start, token)
    own = "parameters" if family == "llama3" else "arguments"
    firsts = {key: compiler.encode(key.encode())[0] for key in ("arguments", "parameters")}
    assert grammar.is_call(start) and int(grammar.mask(start).sum()) == 2 and all(bool(grammar.mask(start)[t]) for t in firsts.values())
    assert grammar.forced(start)[0] == firsts[own]
    calls = {}
    for key, first in firsts.items():
        text = b"".join(compiler.token_bytes[t] for t in finish_call(grammar, compiler, grammar.next_state(start, first), [*tokens, first])).decode()
        other = "parameters" if key == "arguments" else "arguments"
        assert text.startswith(f'{opening}{key}": {{') and f'"{other}"' not in text, text  # the rest forced from the key written
        (calls[key],) = calls_of(text)
    assert calls["arguments"].name == calls["parameters"].name == "multiply"
    assert calls["arguments"].arguments == calls["parameters"].arguments


def test_several_calls_in_each_opening(vocab):
    """Parallel calls: another fence or tag after a complete call, or the next item of a list; the
    name of each further call is constrained to the tools."""
    _, tokenizer, _, compiler = vocab
    for family, opening, between in [
        (None, '```json\n{"name": "multiply", "', '\n```json\n{"name": '),
        ("hermes", '<tool_call>\n{"name": "multiply", "', '\n<tool_call>\n{"name": '),
        ("mistral", '[{"name": "multiply", "', ', {"name": '),
        (None, '{"name":"multiply","', '\n{"name":'),
        ("hermes", "<function=multiply>", "\n<function="),
        ("hermes", '<function name="multiply_all">', '\n<function name="'),
        ("hermes", '```xml\n<tools>\n{"name": "multiply", "', '\n```xml\n<tools>\n{"name": '),
    ]:
        grammar = AutoCallGrammar(compiler, SPECS, FAMILY.get(family), parallel=True)
        state = grammar.initial_state
        tokens = tokenizer.encode(opening, add_special_tokens=False)
        for token in tokens:
            state = grammar.next_state(state, token)
        another = compiler.encode(between.encode())[0]
        tokens = finish_call(grammar, compiler, state, tokens, until=another)
        state = grammar.initial_state
        for token in tokens:
            state = grammar.next_state(state, token)
        mask = grammar.mask(state)  # the call is complete: another one, or the end
        assert bool(mask[another]) and int(mask.sum()) == 2  # or the end token; a list: or its bracket
        closing = compiler.encode(b"]")[0]
        tokens = finish_call(grammar, compiler, grammar.next_state(state, another), [*tokens, another], until=closing if family == "mistral" else None)
        if family == "mistral":  # a list is closed by its bracket
            tokens.append(closing)
        text = b"".join(compiler.token_bytes[t] for t in tokens).decode()
        assert between in text, text
        calls = calls_of(text)
        assert len(calls) == 2 and [c.index for c in calls] == [0, 1], text
        for call in calls:
            jsonschema.validate(call.arguments, PARAMETERS[call.name])
    llama = AutoCallGrammar(compiler, SPECS, FAMILY["llama3"], parallel=True)
    assert not llama.parallel  # Llama 3.1's template takes one call per reply


def test_the_tools_arguments_grammars_are_shared_by_every_opening(vocab):
    """The JSON part is compiled once per tool (the compiler's cache), not once per opening or family."""
    _, _, _, compiler = vocab
    first = AutoCallGrammar(compiler, SPECS, FAMILY["hermes"], parallel=True)
    second = AutoCallGrammar(compiler, SPECS, None, parallel=False)
    assert all(a is b for a, b in zip(first.arguments, second.arguments)) and len(first.arguments) == len(SPECS)


# -- the engine: scripted openings, then the model ------------------------------------------------------

# (family, the scripted opening: a call's start that the model then goes on with)
SCRIPTS = [
    (None, '{"name": "multiply", "'),  # the token after the name straddles the trigger's end
    (None, '```json\n{"name": "multiply"'),
    ("hermes", '<tool_call>\n{"name": "multiply"'),
    ("hermes", '```\n{"name":"multiply'),  # the model closes the name: undecided until then
    ("llama3", '{"name": "multiply"'),
    ("mistral", '[{"name": "multiply"'),
    ("hermes", "<function=multiply>"),
    ("llama3", '{"name": "multiply", "arguments'),  # the other family's key
    ("hermes", '```xml\n<tools>\n{"name": "multiply"'),
]
QUESTION = [{"role": "user", "content": "What is 6 times 7? Use the multiply tool."}]


def run_scripted(engine, model, family, opening, params, tools=SPECS[:1]) -> tuple:
    fmt = FAMILY.get(family)
    grammar = AutoCallGrammar(model.grammars, tools, fmt, parallel=False)
    prefix = model.grammars.encode(opening.encode())
    seq, pieces = decode(engine, model.chat.encode(QUESTION, tools), params, grammar=Scripted(prefix, grammar, model.vocab_size))
    return seq, pieces


@pytest.mark.parametrize("family, opening", SCRIPTS)
def test_a_scripted_opening_goes_on_as_a_valid_call_speculative_equals_plain(engine, loaded, family, opening):
    """The real default model goes on from the opening; the trigger forces the rest of the call."""
    outputs = []
    for spec in (SpecConfig(enabled=False), SpecConfig(max_draft_tokens=8, adaptive=False)):
        seq, pieces = run_scripted(engine, loaded, family, opening, GenerationParams(max_tokens=40, spec=spec))
        outputs.append((seq, pieces))
    (plain, pieces), (pinned, _) = outputs
    first = next(piece for piece in pieces if piece)  # the opening was held back until it named the tool
    assert first.startswith(opening[: opening.index("multiply")]) and "multiply" in first
    assert pinned.output_ids == plain.output_ids
    assert plain.finish_reason == "stop"
    text = b"".join(loaded.token_bytes[t] for t in plain.output_ids).decode()
    assert text.startswith(opening)
    (call,) = calls_of(text)
    assert call.name == "multiply"
    jsonschema.validate(call.arguments, PARAMETERS["multiply"])
    assert pinned.stats.accepted_by_source.get("grammar", 0) > 0  # the forced rest of the call is drafted


@pytest.fixture(scope="module")
def qwen(loaded):
    """A tiny random Qwen2 with Qwen2's real vocabulary and Qwen2.5's chat template (Hermes
    ``<tool_call>``; llama.cpp's vocabulary file carries a ChatML template without tools)."""
    from .test_families import family_model
    from .test_tool_formats import QWEN25

    tokenizer = model_tokenizer(read_gguf(real_vocab("qwen2")))
    tokenizer.chat_template = QWEN25
    token_bytes = token_bytes_table(tokenizer, len(tokenizer))
    model = loaded.with_model(
        family_model("qwen2", len(tokenizer), noise=0.05),
        name="tiny-qwen2",
        context_window=512,
        tokenizer=tokenizer,
        token_bytes=token_bytes,
        chat=ChatFormat(tokenizer),
        stop_token_ids=frozenset({tokenizer.eos_token_id, *tokenizer.encode("<|im_end|>", add_special_tokens=False)}),
    )
    return model, Engine(model)


@pytest.mark.parametrize(
    "opening",
    [
        '```json\n{"name": "multiply_all", "',
        '<tool_call>\n{"name": "multiply_all"',
        '<tools>\n{"name": "multiply_all", "parameters',
        '```xml\n<tool_call>\n{"name": "multiply_all"',
    ],
)
def test_on_qwens_vocabulary_seeded_and_greedy_speculative_equals_plain(qwen, opening):
    """The random model's arguments are bounded (a list of at most 3 small enums), so its calls end."""
    model, engine = qwen
    assert model.chat.tool_format.family == "hermes"
    calls = 0
    for seed in (None, 1):
        outputs = []
        for spec in (SpecConfig(enabled=False), SpecConfig(max_draft_tokens=8, adaptive=False)):
            params = GenerationParams(max_tokens=32, temperature=0.0 if seed is None else 1.0, seed=seed, spec=spec)
            outputs.append(run_scripted(engine, model, "hermes", opening, params, tools=SPECS[1:])[0])
        plain, pinned = outputs
        assert pinned.output_ids == plain.output_ids, seed
        text = b"".join(model.token_bytes[t] for t in plain.output_ids).decode(errors="replace")
        assert text.startswith(opening)
        if plain.finish_reason == "stop":
            (call,) = calls_of(text)
            jsonschema.validate(call.arguments, PARAMETERS["multiply_all"])
            calls += 1
    assert calls  # the random model's calls end within max_tokens: the forced closing is exercised


@pytest.mark.parametrize("opening", ["<function=multiply_all>", '<tools>\n{"name": "multiply_all", "'])
def test_several_calls_on_qwens_vocabulary_speculative_equals_plain(qwen, opening):
    """Parallel calls in a function tag and in a Hermes tag: a scripted first call and the first token
    of another (the random model would seldom write one); the model chooses the next call's tool (one
    of two) and writes its arguments and closing, greedy and seeded, speculative == plain."""
    model, engine = qwen
    compiler, tools = model.grammars, (SPECS[1], *parse_tools([PICK], "auto")[0])
    grammar = AutoCallGrammar(compiler, tools, FAMILY["hermes"], parallel=True)
    prefix, state = compiler.encode(opening.encode()), grammar.initial_state
    for token in prefix:
        state = grammar.next_state(state, token)
    (newline,) = compiler.encode(b"\n")
    prefix = [*finish_call(grammar, compiler, state, prefix, until=newline), newline]  # a whole first call, then another
    prompt = model.chat.encode(QUESTION, tools)
    ended = 0
    for seed in (None, 2):
        plain, pinned = (
            decode(engine, prompt, GenerationParams(max_tokens=64, temperature=0.0 if seed is None else 1.0, seed=seed, spec=spec), grammar=Scripted(prefix, grammar, model.vocab_size))[0]
            for spec in (SpecConfig(enabled=False), SpecConfig(max_draft_tokens=8, adaptive=False))
        )
        assert pinned.output_ids == plain.output_ids, seed
        text = b"".join(model.token_bytes[t] for t in plain.output_ids).decode(errors="replace")
        if plain.finish_reason == "stop":
            calls = calls_of(text)
            assert len(calls) >= 2 and [c.index for c in calls] == list(range(len(calls))), text
            for call in calls:
                jsonschema.validate(call.arguments, PARAMETERS[call.name])
            ended += 1
    assert ended  # the further call ends within max_tokens: its name, arguments and closing are exercised


async def test_the_default_model_calls_with_the_key_it_writes_and_never_under_none(client, loaded):
    """The real default model imitates a call it was shown (as text) with either key: under "auto" the
    same ToolCall comes back whichever key it wrote, speculative == plain; under "none" the same
    opening stays text."""
    from agentspec.bench.workloads import WEATHER_TOOL as WEATHER

    calls = []
    for key in ("parameters", "arguments"):
        messages = [
            {"role": "user", "content": "What's the weather in Paris?"},
            {"role": "assistant", "content": f'{{"name": "get_weather", "{key}": {{"city": "Paris"}}}}'},
            {"role": "user", "content": "18°C, cloudy"},
            {"role": "assistant", "content": "It is 18°C and cloudy in Paris."},
            {"role": "user", "content": "What's the weather in Rome?"},
        ]
        spec = await client.generate(messages, tools=[WEATHER], max_tokens=40)
        plain = await client.generate(messages, tools=[WEATHER], max_tokens=40, speculative=False)
        none = await client.generate(messages, tools=[WEATHER], tool_choice="none", max_tokens=40)
        assert spec.token_ids == plain.token_ids and spec.finish_reason == "tool_calls"
        assert f'"{key}":' in loaded.tokenizer.decode(spec.token_ids)  # the key the model wrote, kept
        assert none.tool_calls == [] and none.text.startswith(f'{{"name": "get_weather", "{key}":')
        (call,) = spec.tool_calls
        jsonschema.validate(call.arguments, WEATHER["function"]["parameters"])
        calls.append((call.name, call.arguments))
    assert calls[0] == calls[1] and calls[0][0] == "get_weather" and calls[0][1]["city"] == "Rome"


@pytest.mark.parametrize("opening", ['Here: {"name": "multiply"', '```json\n{"names"', ' {"name": "multiplied"'])
def test_text_keeps_the_models_tokens_and_loses_nothing_held_back(engine, loaded, opening):
    """A reply that opens with prose, or like a call but names no tool, is text: the trigger masks
    nothing, so the model writes exactly what it writes with no tools at all; what was held back
    while undecided is emitted once the bytes rule a call out (plain decoding: one token a step)."""
    prefix = loaded.grammars.encode(opening.encode())
    prompt = loaded.chat.encode(QUESTION, SPECS[:1])
    for spec in (SpecConfig(enabled=False), SpecConfig(max_draft_tokens=8, adaptive=False)):
        params = GenerationParams(max_tokens=16, spec=spec)
        grammar = AutoCallGrammar(loaded.grammars, SPECS[:1], None, parallel=True)
        auto, pieces = decode(engine, prompt, params, grammar=Scripted(prefix, grammar, loaded.vocab_size))
        free, free_pieces = decode(engine, prompt, params, grammar=Scripted(prefix, None, loaded.vocab_size))
        assert auto.output_ids == free.output_ids and len(auto.output_ids) > len(prefix)
        assert "".join(pieces) == "".join(free_pieces) == loaded.tokenizer.decode(free.output_ids)
        if not spec.enabled and opening[0] != "H":  # undecided for a few tokens: nothing emitted, then all of it at once
            held = next(i for i, piece in enumerate(pieces) if piece)
            assert held >= 2 and pieces[held] == "".join(free_pieces[: held + 1])
