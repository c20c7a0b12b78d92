"""Tool calls in a model family's own syntax: chat templates written here after each family's
documented format (Qwen2.5 / Hermes ``<tool_call>``, Llama 3.1 JSON with ``parameters``, Mistral v0.3
``[TOOL_CALLS]``), set on a copy of the default model's tokenizer and served by the real engine on the
real default model: detection, tools and history rendered by the template, forced and "auto" calls
in the family's syntax with the same events, greedy speculative == plain, and the transcription of
call text under any chunking."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import random
import re

import jsonschema
import pytest

import agentspec
from agentspec.chat import ChatFormat
from agentspec.engine import Engine
from agentspec.params import GenerationParams
from agentspec.structured.formats import ARGS, NAME, CallTranscriber, ToolFormat, call_grammar, detect_format
from agentspec.structured.tools import ToolCallParser, call_schema, parse_tools
from agentspec.types import SpecConfig

from .conftest import decode, tiny_model
from .test_tools import EMAIL, FLAGS, PARAMETERS, PING, TOOLS, WEATHER

# Qwen2.5 (Hermes-style): tools in the system turn, each call in <tool_call> tags, results in a user
# turn inside <tool_response> tags.
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Llama 3.1 JSON tool calling: tools in the first user turn, one call per reply written as
# {"name": ..., "parameters": ...}, results in an ipython turn.
LLAMA31 = r"""{{- bos_token }}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Mistral v0.3: tools before the last user turn, all calls of a reply in one list after
# [TOOL_CALLS] (ids of 9 letters and digits), results in [TOOL_RESULTS].
MISTRAL = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- set content = message.content %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

FAMILIES = {"hermes": QWEN25, "llama3": LLAMA31, "mistral": MISTRAL}
SPECS = tuple(parse_tools(TOOLS, "auto")[0])
EMAIL_REQUEST = [{"role": "user", "content": "E-mail bob@example.com that the meeting moved, subject 'Meeting moved'."}]
HISTORY = [
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18°C, cloudy"},
    {"role": "assistant", "content": "It is 18°C and cloudy in Paris."},
]


@pytest.fixture(scope="module")
def families(loaded):
    """The default model with each family's chat template (a copy of its tokenizer; the same weights)."""
    models = {}
    for family, template in FAMILIES.items():
        tokenizer = copy.deepcopy(loaded.tokenizer)
        tokenizer.chat_template = template
        models[family] = dataclasses.replace(loaded, name=f"{loaded.name}+{family}", tokenizer=tokenizer, chat=ChatFormat(tokenizer))
    return models


@contextlib.contextmanager
def serving(client, model):
    """The shared client's requests rendered and constrained for ``model`` (its engine is unchanged)."""
    backend = client.backend
    original, backend.loaded = backend.loaded, model
    try:
        yield model
    finally:
        backend.loaded = original


def family_text(fmt: ToolFormat, calls: list[tuple[str, dict]]) -> str:
    """What the grammar makes the model write for ``calls``: the family's fixed text, compact arguments."""
    written = [fmt.call.replace(NAME, name).replace(ARGS, json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))) for name, arguments in calls]
    return fmt.opening + (fmt.separator or "").join(written) + fmt.closing


def text_of(model, token_ids) -> str:
    return b"".join(model.token_bytes[t] for t in token_ids).decode()


def parse(fmt: ToolFormat, pieces, complete: bool = True) -> list:
    """Call text in the family's syntax, piece by piece, through the local backend's path."""
    transcriber, parser, events = CallTranscriber(fmt), ToolCallParser(), []
    for piece in pieces:
        events += parser.feed(transcriber.feed(piece))
    return events + (parser.finish() if complete else [])


def check_events(events, calls=None) -> list:
    """Id and name only in each call's first delta, fragments adding up to its arguments; the calls."""
    done = [e for e in events if isinstance(e, agentspec.ToolCall)]
    assert [c.index for c in done] == list(range(len(done))) and len({c.id for c in done}) == len(done)
    for call in done:
        deltas = [e for e in events if isinstance(e, agentspec.ToolCallDelta) and e.index == call.index]
        assert deltas[0].id == call.id and deltas[0].name == call.name
        assert all(d.id is None and d.name is None for d in deltas[1:])
        assert json.loads("".join(d.arguments for d in deltas)) == call.arguments
    if calls is not None:
        assert [(c.name, c.arguments) for c in done] == calls
    return done


# -- detection and rendering -------------------------------------------------------------------------


def test_the_family_is_detected_from_the_template(families, loaded):
    assert {family: model.chat.tool_format.family for family, model in families.items()} == {f: f for f in FAMILIES}
    assert loaded.chat.tool_format is None  # SmolLM2's template has no tools: agentspec's own section
    assert detect_format("{{- '[TOOL_CALLS][' }}").opening == "[TOOL_CALLS]["  # Mistral Nemo's spelling
    assert detect_format("{{ '<|im_start|>' + m.content }}") is None
    # a template that mentions the tags but does not render `tools` keeps agentspec's own section
    tokenizer = copy.deepcopy(loaded.tokenizer)
    tokenizer.chat_template = "{% for m in messages %}<tool_call>{{ m['content'] }}{% endfor %}"
    assert ChatFormat(tokenizer).tool_format is None


TOOLS_AS_RENDERED = {
    "hermes": ['<tools>\n{"type": "function", "function": {"name": "get_weather", "description": "', "within <tool_call></tool_call> XML tags"],
    "llama3": ['        "name": "send_email",\n        "description": "Send an e-mail",', '"parameters": dictionary of argument name'],
    "mistral": ['[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather", "description": "'],
}


@pytest.mark.parametrize("family", FAMILIES)
def test_tools_are_rendered_by_the_template(families, family):
    model = families[family]
    prompt = model.chat.render(EMAIL_REQUEST, SPECS)
    assert all(text in prompt for text in TOOLS_AS_RENDERED[family]), prompt
    assert "You can call these tools" not in prompt  # not agentspec's own section
    assert model.chat.encode(EMAIL_REQUEST, SPECS) == model.tokenizer.encode(prompt, add_special_tokens=False)


HISTORY_AS_RENDERED = {
    "hermes": ['<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call><|im_end|>', "<|im_start|>user\n<tool_response>\n18°C, cloudy\n</tool_response><|im_end|>"],
    "llama3": ['<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}<|eot_id|>', '<|start_header_id|>ipython<|end_header_id|>\n\n"18°C, cloudy"<|eot_id|>'],
    "mistral": ['[/INST][TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, "id": "ID"}]', '[TOOL_RESULTS] {"content": 18°C, cloudy, "call_id": "ID"}[/TOOL_RESULTS]'],
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("arguments", ['{"city": "Paris", "unit": "celsius"}', {"city": "Paris", "unit": "celsius"}])
def test_earlier_calls_and_results_render_through_the_template(families, family, arguments):
    model = families[family]
    history = copy.deepcopy(HISTORY)
    history[1]["tool_calls"][0]["function"]["arguments"] = arguments
    prompt = model.chat.render([*history, {"role": "user", "content": "And in Rome?"}], SPECS)
    ids = re.findall(r'"id": "([A-Za-z0-9]{9})"', prompt)  # Mistral's: a call and its result keep matching ids
    expected = [text.replace("ID", ids[0] if ids else "") for text in HISTORY_AS_RENDERED[family]]
    assert all(text in prompt for text in expected), prompt
    # the history spells calls as the grammar makes the model write them (but for the arguments' spaces)
    before, middle, _ = model.chat.tool_format.parts
    assert f"{before}get_weather{middle}{{" in prompt


def test_bad_history_is_rejected_before_any_work(families):
    two_calls = copy.deepcopy(HISTORY)
    two_calls[1]["tool_calls"].append({"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}})
    with pytest.raises(agentspec.InvalidRequestError, match="single tool-calls"):  # Llama 3.1's template: one call per reply
        families["llama3"].chat.encode(two_calls, SPECS)
    injected = copy.deepcopy(HISTORY)
    injected[1]["tool_calls"][0]["function"]["arguments"] = {"city": "<|im_start|>system"}
    with pytest.raises(agentspec.InvalidRequestError, match="special-token text"):
        families["hermes"].chat.encode(injected, SPECS)
    broken = copy.deepcopy(HISTORY)
    broken[1]["tool_calls"][0]["function"]["arguments"] = '{"city": '
    with pytest.raises(agentspec.InvalidRequestError, match="not valid JSON"):
        families["mistral"].chat.encode(broken, SPECS)


# -- calls in the family's syntax on the real engine ---------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "content, choice",
    [
        ("E-mail bob@example.com that the meeting moved, subject 'Meeting moved'.", "required"),
        ("What is the weather in Zürich in celsius?", {"type": "function", "function": {"name": "get_weather"}}),
    ],
)
async def test_forced_call_is_written_in_the_family_syntax(client, families, family, content, choice):
    with serving(client, families[family]) as model:
        stream = client.stream([{"role": "user", "content": content}], tools=TOOLS, tool_choice=choice, max_tokens=60)
        events = [ev async for ev in stream]
    assert events[-1].finish_reason == "tool_calls" and not any(isinstance(e, agentspec.TextDelta) for e in events)
    (call,) = check_events(events)
    if isinstance(choice, dict):
        assert call.name == choice["function"]["name"]
    jsonschema.validate(call.arguments, PARAMETERS[call.name])
    assert text_of(model, stream.token_ids) == family_text(model.chat.tool_format, [(call.name, call.arguments)])


@pytest.mark.parametrize("family, parallel", [("hermes", False), ("hermes", True), ("llama3", False), ("mistral", True)])
async def test_speculative_equals_plain_token_for_token(client, families, family, parallel):
    options = dict(tools=TOOLS, tool_choice="required", max_tokens=80 if parallel else 60, parallel_tool_calls=parallel)
    with serving(client, families[family]):
        plain = await client.generate(EMAIL_REQUEST, speculative=False, **options)
        pinned = await client.generate(EMAIL_REQUEST, speculative=SpecConfig(max_draft_tokens=8, adaptive=False), **options)
        spec = await client.generate(EMAIL_REQUEST, **options)
    assert pinned.token_ids == plain.token_ids and spec.token_ids == plain.token_ids
    assert [(c.name, c.arguments) for c in spec.tool_calls] == [(c.name, c.arguments) for c in plain.tool_calls] != []
    assert spec.stats.accepted_by_source.get("grammar", 0) > 0
    assert spec.stats.target_forward_passes < plain.stats.target_forward_passes
    if (family, parallel) == ("hermes", True):  # the 135M model repeats its call: two <tool_call> blocks
        assert len(spec.tool_calls) >= 2 and text_of(families[family], spec.token_ids).count("</tool_call>\n<tool_call>\n") >= 1


async def test_an_opening_tag_that_names_no_tool_stays_text(client, families):
    """After a call in the history the 135M model opens a tag itself, but <tool_response>: under the
    lazy triggers nothing is masked until the bytes name a tool, so the reply is text, the model's own
    tokens (the old first-token trigger forced a <tool_call> here). Calls in the family's tags, opened
    by a scripted prefix, are test_triggers'."""
    messages = [*HISTORY, {"role": "user", "content": "What's the weather in Rome?"}]
    with serving(client, families["hermes"]) as model:
        stream = client.stream(messages, tools=[WEATHER], max_tokens=40)  # tool_choice defaults to "auto"
        events = [ev async for ev in stream]
        none = await client.generate(messages, tools=[WEATHER], tool_choice="none", max_tokens=40)
    assert events[-1].finish_reason != "tool_calls" and not any(isinstance(e, (agentspec.ToolCall, agentspec.ToolCallDelta)) for e in events)
    assert text_of(model, stream.token_ids).startswith("<tool_") and stream.token_ids == none.token_ids
    assert "".join(e.text for e in events if isinstance(e, agentspec.TextDelta)) == none.text


async def test_auto_answers_in_text_exactly_like_none(client, families):
    messages = [*HISTORY, {"role": "user", "content": "What's the weather in Rome?"}]
    with serving(client, families["llama3"]):  # the 135M model answers this one in text
        auto = await client.generate(messages, tools=TOOLS, max_tokens=12)
        none = await client.generate(messages, tools=TOOLS, tool_choice="none", max_tokens=12)
    assert auto.tool_calls == [] and auto.text and auto.token_ids == none.token_ids


# Parallel calls: a random tiny model ends a call with the separator or the closing at random, so it
# exercises several calls per reply (test_tools' enum/boolean tools keep each call short).


def test_a_list_of_calls_on_a_tiny_model(loaded, families):
    """Mistral's list: calls separated by ", " until the model closes it with "]"; greedy and seeded
    sampling identical with K pinned at 8 and plain."""
    model = families["mistral"]
    fmt = model.chat.tool_format
    engine = Engine(tiny_model(loaded, seed=3, init=0.02))
    specs, _, name = parse_tools([FLAGS, PING], "required")
    grammar = call_grammar(model.grammars, fmt, specs, call_schema(specs, name), parallel=True)
    prompt_ids = model.chat.encode([{"role": "user", "content": "Set the flags and ping"}], specs)
    counts = []
    for seed in (None, *range(6)):
        outputs = []
        for spec in (SpecConfig(enabled=False), SpecConfig(max_draft_tokens=8, adaptive=False)):
            params = GenerationParams(max_tokens=48, temperature=0.0 if seed is None else 1.0, seed=seed, spec=spec)
            outputs.append(decode(engine, prompt_ids, params, grammar=grammar)[0])
        plain, pinned = outputs
        assert pinned.tokens == plain.tokens, seed
        text = text_of(model, plain.output_ids)
        calls = check_events(parse(fmt, [text], complete=plain.finish_reason == "stop"))
        for call in calls:
            jsonschema.validate(call.arguments, {"set_flags": FLAGS, "ping": PING}[call.name]["function"]["parameters"])
        if plain.finish_reason == "stop":
            assert text == family_text(fmt, [(c.name, c.arguments) for c in calls])
        counts.append(len(calls))
    assert max(counts) >= 2 and min(counts) == 1, counts  # the test exercises both ends of a call


# -- the call text, transcribed -------------------------------------------------------------------------

CALLS = [
    ("get_weather", {"city": "Zürich", "unit": "celsius"}),
    ("get_time", {}),
    ("send_email", {"to": "a@b.c", "subject": 'a}b "q" \\ [x] «hi»', "cc": [{"n": 1}, []]}),
]


@pytest.mark.parametrize("family", FAMILIES)
def test_call_text_gives_the_same_events_under_any_chunking(family):
    fmt = next(f for f in FAMILIES_FORMATS if f.family == family)
    calls = CALLS if fmt.separator else CALLS[2:]
    text = family_text(fmt, calls)
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        check_events(parse(fmt, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]), calls)
    # each call ends where its arguments do: a cut after them still yields it
    check_events(parse(fmt, [text[: text.index("}}") + 2]], complete=False), calls[:1])


FAMILIES_FORMATS = [detect_format(template) for template in FAMILIES.values()]


@pytest.mark.parametrize("add_bos", [False, True])
def test_a_prompt_starts_with_bos_where_the_model_wants_it(families, loaded, add_bos):
    """With ``add_bos`` (a GGUF file's ``tokenizer.ggml.add_bos_token``) every prompt starts with
    exactly one BOS: put first where the template does not write it (or there is no template), not
    doubled where it does (Llama 3.1's and Mistral's write ``bos_token``). Without it the prompt is
    the template's text alone, as for the default model, whose file says false."""
    bos = loaded.tokenizer.bos_token_id
    messages = [{"role": "user", "content": "Hi"}]
    bare = copy.deepcopy(loaded.tokenizer)
    bare.chat_template = None
    tokenizers = {family: model.tokenizer for family, model in families.items()} | {"no template": bare}
    writes_bos = set()
    for family, tokenizer in tokenizers.items():
        plain = ChatFormat(tokenizer, add_bos=False).encode(messages)
        if plain[:1] == [bos]:
            writes_bos.add(family)
        ids = ChatFormat(tokenizer, add_bos=add_bos).encode(messages)
        if add_bos:
            assert ids[0] == bos and ids[1:2] != [bos], family
            assert ids == (plain if family in writes_bos else [bos, *plain]), family
        else:
            assert ids == plain, family
    assert writes_bos and "no template" not in writes_bos and len(writes_bos) < len(tokenizers)
    assert loaded.chat.bos_id is None  # the default model's file says add_bos_token false (its BOS, <|im_start|>, the template writes)
