"""OpenAI chat messages → the model's chat template → prompt token ids.

Messages are validated and normalised before anything runs: roles checked, text parts joined,
same-role runs merged, and the system message folded into the first user message when the template
has no system role.

Tools follow the template. Where it shows a family's tool-call syntax (``structured.formats``:
Qwen's ``<tool_call>``, Llama 3.1's ``parameters``, Mistral's ``[TOOL_CALLS]``) it renders the tools
itself (``tools=``), earlier calls as OpenAI ``tool_calls`` with arguments as objects, and results
as role ``tool`` with the called function's ``name``. Otherwise agentspec's own section describes the
tools (``tools.with_tool_prompt``) and earlier calls are rendered as the compact JSON lines a call
is generated in.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any, Sequence

from .errors import ContextLengthError, InvalidRequestError
from .params import check_json_depth
from .structured.formats import ToolFormat, detect_format, template_id, template_tools
from .structured.tools import ToolSpec, with_tool_prompt
from .types import Limits

__all__ = ["normalize_messages", "ChatFormat"]

log = logging.getLogger("agentspec.client")
# Tool-call arguments sent as a JSON string are parsed here, after the request's own depth check
# (``Limits.max_json_depth``) saw only a string; they get the default limit.
MAX_ARGUMENTS_DEPTH = Limits().max_json_depth
MAX_TEMPLATE_MESSAGE_CHARS = 200  # a template's own refusal, quoted

ROLES = ("system", "developer", "user", "assistant", "tool")


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise InvalidRequestError(
                    f"{where}: only text content parts ({{'type': 'text', 'text': ...}}) are supported, got {part!r}."
                )
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequestError(f"{where}: `content` must be a string or a list of text parts, got {type(content).__name__}.")


def _tool_calls(tool_calls: Any, where: str) -> list[tuple[str | None, str, dict[str, Any]]]:
    """Validated assistant ``tool_calls``: (id, name, arguments object) each."""
    if not isinstance(tool_calls, list):
        raise InvalidRequestError(f"{where}: `tool_calls` must be a list, got {type(tool_calls).__name__}.")
    calls = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f"{where}: each tool call needs {{'function': {{'name': str, 'arguments': str}}}}, got {call!r}.")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, (str, dict)):
            raise InvalidRequestError(f"{where}: tool call arguments must be a JSON string or an object, got {arguments!r}.")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(
                    f"{where}: tool call arguments are not valid JSON (at line {exc.lineno}, column {exc.colno}); "
                    "send a JSON object as a string or an object."
                ) from None
            except RecursionError:
                raise InvalidRequestError(f"{where}: tool call arguments nest too deeply to parse; flatten them.") from None
            check_json_depth(f"{where}: tool call arguments", arguments, MAX_ARGUMENTS_DEPTH)
        call_id = call.get("id")
        calls.append((call_id if isinstance(call_id, str) and call_id else None, function["name"], arguments))
    return calls


def _render_tool_calls(calls: list[tuple[str | None, str, dict[str, Any]]]) -> str:
    # Compact, as the call grammar makes the model write them: history and new calls look alike.
    return "\n".join(json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False, separators=(",", ":")) for _, name, arguments in calls)


def normalize_messages(messages: Any, *, system_role: bool = True, tool_format: ToolFormat | None = None) -> list[dict[str, Any]]:
    """Validate OpenAI chat messages and return ``[{"role", "content"}]`` ready for a chat template.

    tool_format: the template's tool-call syntax; with it, assistant messages keep their calls as
    ``tool_calls`` (ids as the template accepts them, arguments as objects) and tool messages their
    ``tool_call_id`` and the called function's ``name``. Without it, calls become text.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("`messages` must be a non-empty list of {'role': ..., 'content': ...} dicts.")
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id → the function it called (a tool message names it)
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}.")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequestError(f"{where}: unknown role {role!r}; use one of {', '.join(ROLES)}.")
        if "content" not in message and not message.get("tool_calls"):
            raise InvalidRequestError(f"{where}: missing 'content'.")
        if role == "tool" and not (isinstance(message.get("tool_call_id"), str) and message["tool_call_id"]):
            raise InvalidRequestError(f"{where}: a 'tool' message needs the `tool_call_id` of the call it answers.")
        text = _text(message.get("content"), where)
        normal: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": text}
        if role == "assistant" and message.get("tool_calls"):
            calls = _tool_calls(message["tool_calls"], where)
            if tool_format is None:
                rendered = _render_tool_calls(calls)
                normal["content"] = f"{text}\n{rendered}" if text else rendered
            else:
                listed = []
                for index, (call_id, name, arguments) in enumerate(calls):
                    call_id = template_id(tool_format, call_id or f"call{i}x{index}")
                    names[call_id] = name
                    listed.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
                normal["tool_calls"] = listed
        elif role == "tool" and tool_format is not None:
            normal["tool_call_id"] = call_id = template_id(tool_format, message["tool_call_id"])
            if call_id in names:
                normal["name"] = names[call_id]
        last = out[-1] if out else None
        if last is not None and last["role"] == normal["role"] and normal["role"] != "tool" and "tool_calls" not in last and "tool_calls" not in normal:
            last["content"] += "\n\n" + normal["content"]
        else:
            out.append(normal)
    if not system_role and out[0]["role"] == "system":
        system = out.pop(0)["content"]
        if out and out[0]["role"] == "user":
            out[0]["content"] = f"{system}\n\n{out[0]['content']}"
        else:
            out.insert(0, {"role": "user", "content": system})
    if not any(m["role"] in ("user", "system") for m in out):
        raise InvalidRequestError("`messages` needs at least one 'user' or 'system' message.")
    return out


def _template_refusal(exc: Exception) -> str:
    """What to tell a caller whose messages the chat template failed on. A template's own
    ``raise_exception("...")`` (exactly a jinja ``TemplateError``) is its author's message to callers,
    e.g. Llama 3.1's "only supports single tool-calls at once": quoted, on one line. Anything else
    (an undefined variable, a type error inside jinja) is the template's or jinja's internals: logged
    here, and the caller gets agentspec's words, since a server sends this message to whoever called."""
    from jinja2.exceptions import TemplateError

    advice = (
        "check that roles alternate as the model expects (user, then assistant), that tool messages follow "
        "an assistant message with `tool_calls`, and that every message has a string `content`."
    )
    if type(exc) is TemplateError and str(exc).strip():
        said = " ".join(str(exc).split())[:MAX_TEMPLATE_MESSAGE_CHARS]
        return f"The model's chat template rejected these messages: {said!r}; {advice}"
    log.info("the chat template failed to render a request: %s: %s", type(exc).__name__, exc)
    return f"The model's chat template could not render these messages; {advice}"


class ChatFormat:
    """Renders normalised messages with the tokenizer's chat template (plain 'role: text' without one).

    ``tool_format``: the tool-call syntax the template shows (None: agentspec's own section and bare
    JSON calls), checked by rendering a probe tool through the template.

    ``add_bos``: whether a prompt starts with the BOS token (a GGUF file's
    ``tokenizer.ggml.add_bos_token``; default the tokenizer's ``add_bos_token``). Where it does and the
    template does not write BOS itself (or there is no template), ``encode`` puts it first, as
    llama.cpp does: a base model without its BOS answers another text (Gemma 3 270M wrote digits).
    """

    PROBE_TOOL = "agentspec_probe_tool"

    def __init__(self, tokenizer: Any, add_bos: bool | None = None) -> None:
        self.tokenizer = tokenizer
        bos = getattr(tokenizer, "bos_token_id", None)
        wanted = getattr(tokenizer, "add_bos_token", False) is True if add_bos is None else add_bos
        self.bos_id: int | None = bos if wanted and isinstance(bos, int) else None  # the id every prompt starts with, if any
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self.system_role = self.has_template and self._supports_system_role()
        self.tool_format = self._detect_tool_format() if self.has_template else None

    def _supports_system_role(self) -> bool:
        probe = [{"role": "system", "content": "\x00probe\x00"}, {"role": "user", "content": "hi"}]
        try:
            return "\x00probe\x00" in self.tokenizer.apply_chat_template(probe, tokenize=False)
        except Exception:  # templates that raise on a system role ("System role not supported")
            return False

    def _detect_tool_format(self) -> ToolFormat | None:
        template = self.tokenizer.chat_template
        fmt = detect_format("\n".join(template.values()) if isinstance(template, dict) else str(template))
        if fmt is None:
            return None
        tools = template_tools([ToolSpec(self.PROBE_TOOL, "", {"type": "object", "properties": {}})])
        try:
            rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception:
            rendered = ""
        if self.PROBE_TOOL not in rendered:
            log.warning("The chat template shows %s tool calls but does not render `tools`; agentspec's own tool section is used.", fmt.family)
            return None
        return fmt

    @functools.cached_property
    def _markers(self) -> tuple[str, ...]:
        """Texts the tokenizer turns into added (special) tokens wherever they appear."""
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        return tuple(str(getattr(token, "content", token)) for token in added.values())

    def render(self, messages: Any, tools: Sequence[ToolSpec] = ()) -> str:
        return self._render(*self._prepare(messages, tools))

    def _prepare(self, messages: Any, tools: Sequence[ToolSpec]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """Normalised messages and the tools for the template (None: no tools, or described in a message)."""
        if tools and self.tool_format is None:
            messages = with_tool_prompt(messages, list(tools))
        normal = normalize_messages(messages, system_role=self.system_role, tool_format=self.tool_format)
        return normal, template_tools(tools) if tools and self.tool_format is not None else None

    def _render(self, normal: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        if not self.has_template:
            return "".join(f"{m['role']}: {m['content']}\n" for m in normal) + "assistant: "
        try:
            return self.tokenizer.apply_chat_template(normal, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja raise_exception() in templates, e.g. strict role alternation
            raise InvalidRequestError(_template_refusal(exc)) from exc

    def encode(self, messages: Any, tools: Sequence[ToolSpec] = (), *, max_chars: int | None = None) -> list[int]:
        """Token ids of the prompt, with ``tools`` described to the model, starting with BOS where the
        model wants it (``add_bos``). Text inside messages never becomes a special token: a message
        that contains ``<|im_start|>`` and the like cannot open a role of its own (prompt injection).

        max_chars: messages and tools whose text alone is longer (the tools' names, descriptions and
        parameter schemas as JSON, which the template writes into the prompt) are refused
        (``ContextLengthError``) before anything is rendered or tokenized: the context window times
        the longest token's length, so only prompts that could never fit are refused (tokenizing a
        megabyte costs seconds and hundreds of megabytes, and turning its ids into Python lists holds
        the GIL)."""
        if max_chars is not None:
            self._check_length(messages, tools, max_chars)
        ids = self._encode(messages, tools)
        return [self.bos_id, *ids] if self.bos_id is not None and ids[:1] != [self.bos_id] else ids

    @staticmethod
    def _check_length(messages: Any, tools: Sequence[ToolSpec], max_chars: int) -> None:
        if not isinstance(messages, list):
            return  # normalize_messages refuses it with its own message
        chars = sum(len(tool.name) + len(tool.description) + len(json.dumps(tool.parameters, ensure_ascii=False)) for tool in tools)
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            parts = [content] if isinstance(content, str) else content if isinstance(content, list) else []
            texts = (part.get("text") if isinstance(part, dict) else part for part in parts)
            chars += sum(len(text) for text in texts if isinstance(text, str))  # anything else: normalize_messages refuses it
        if chars > max_chars:
            raise ContextLengthError(
                f"The messages and tools hold {chars} characters, more than the model's context window can take as tokens "
                f"(at most {max_chars} characters); shorten the messages (drop old turns or trim documents) or the tools' descriptions."
            )

    def _encode(self, messages: Any, tools: Sequence[ToolSpec]) -> list[int]:
        normal, listing = self._prepare(messages, tools)
        structures = json.dumps([listing, [m.get("tool_calls") for m in normal]], ensure_ascii=False)
        if any(marker in structures for marker in self._markers):
            raise InvalidRequestError(
                "A tool or a tool call's arguments contain special-token text (e.g. '<|im_start|>'), which the chat "
                "template would write into the prompt as a control token; remove that text."
            )
        if not any(marker in m["content"] for m in normal for marker in self._markers):
            return self._ids(self._render(normal, listing))
        # Render with a sentinel per message, then tokenize the template's text as usual and each
        # message's text with special-token matching off. Empty messages keep their "" (templates
        # test it: Qwen's writes no newline before the calls of an assistant message without text).
        sentinels = {i: f"\x00agentspec-{i}\x00" for i, m in enumerate(normal) if m["content"]}
        rest = self._render([{**m, "content": sentinels.get(i, m["content"])} for i, m in enumerate(normal)], listing)
        ids: list[int] = []
        for i, sentinel in sentinels.items():
            before, found, rest = rest.partition(sentinel)
            if not found:
                raise InvalidRequestError(
                    "A message contains special-token text (e.g. '<|im_start|>') and this model's chat template "
                    "rewrites message text, so it cannot be kept inert; remove that text from the message."
                )
            ids += self._ids(before) + self._ids(normal[i]["content"], split_special_tokens=True)
        return ids + self._ids(rest)

    def _ids(self, text: str, **options: Any) -> list[int]:
        if not text:
            return []
        try:
            text.encode("utf-8")  # JSON's "\ud800" escape decodes to a lone surrogate, which no tokenizer takes
        except UnicodeEncodeError as exc:
            raise InvalidRequestError(
                f"The messages or tools contain a lone UTF-16 surrogate ({text[exc.start]!r}), which is not text; "
                "send valid Unicode (an escaped surrogate must be half of a pair)."
            ) from None
        return list(self.tokenizer.encode(text, add_special_tokens=False, **options))
