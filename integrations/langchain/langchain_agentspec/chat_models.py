"""``ChatAgentSpec``: a LangChain chat model over an embedded agentspec model.

    from langchain_agentspec import ChatAgentSpec

    llm = ChatAgentSpec(max_tokens=256)              # loads nothing yet
    llm.invoke("Hello")                              # loads the default model once per process
    llm.bind_tools([get_weather], tool_choice="any").invoke("Weather in Paris?")
    llm.with_structured_output(Invoice).invoke(text)  # grammar-constrained JSON

Event mapping (agentspec → LangChain chunks):
    TextDelta      → AIMessageChunk(content=text)
    ToolCallDelta  → AIMessageChunk(tool_call_chunks=[{index, id, name, args}]) (id/name in the first only)
    ToolCall       → nothing (the deltas already carry it; the aggregate parses ``tool_calls``)
    Done           → the last chunk: usage_metadata, finish_reason, model_name, spec_stats,
                     chunk_position="last"
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

import agentspec
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput, ModelProfile
from langchain_core.language_models.base import LangSmithParams
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, UsageMetadata, convert_to_openai_messages
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticOutputParser, PydanticToolsParser
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import SecretStr

from agentspec.bridge import ClientKey, backend

__all__ = ["ChatAgentSpec"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what agentspec embeds when `model` is None

StructuredMethod = Literal["function_calling", "json_schema", "json_mode"]


def _tool_choice(tool_choice: Any) -> Any:
    """LangChain's tool_choice forms → agentspec's (OpenAI's)."""
    if tool_choice is None or tool_choice == "auto":
        return "auto"
    if tool_choice is True or tool_choice in ("any", "required"):
        return "required"
    if tool_choice is False or tool_choice == "none":
        return "none"
    if isinstance(tool_choice, str):  # a tool's name
        return {"type": "function", "function": {"name": tool_choice}}
    if isinstance(tool_choice, dict):
        return tool_choice
    raise ValueError(
        f"tool_choice={tool_choice!r} is not understood; use 'auto', 'any', 'none', a tool name, "
        "or {'type': 'function', 'function': {'name': ...}}."
    )


def _chunk(event: Any, model_name: str) -> ChatGenerationChunk | None:
    if isinstance(event, agentspec.TextDelta):
        return ChatGenerationChunk(message=AIMessageChunk(content=event.text)) if event.text else None
    if isinstance(event, agentspec.ToolCallDelta):
        call = tool_call_chunk(name=event.name, args=event.arguments, id=event.id, index=event.index)
        return ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[call]))
    if isinstance(event, agentspec.Done):
        counts = (event.usage.prompt_tokens, event.usage.completion_tokens, event.usage.total_tokens)
        usage = (  # a server that reports no usage (Client(base_url=...)): none, rather than zeros
            UsageMetadata(input_tokens=counts[0], output_tokens=counts[1], total_tokens=counts[2]) if None not in counts else None
        )
        metadata = {"finish_reason": event.finish_reason, "model_name": model_name, "spec_stats": event.stats.model_dump()}
        message = AIMessageChunk(content="", usage_metadata=usage, response_metadata=metadata, chunk_position="last")
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": event.finish_reason})
    return None  # ToolCall: already streamed as deltas


class ChatAgentSpec(BaseChatModel):
    """A local model with lossless speculative decoding, as a LangChain chat model.

    Constructing it loads nothing: the weights load on first use, once per process, and every
    instance with the same ``model``/``device``/``dtype`` shares one ``agentspec.Client``.
    Sampling fields left as None use agentspec's defaults (greedy decoding, no limits).
    """

    model: str | None = None
    """A local HF folder, a ``.gguf`` file or a cached hub id; None = the embedded default model.
    With ``base_url``: the server's model id (None = the first it lists)."""
    base_url: str | None = None
    """An OpenAI-compatible server (``agentspec serve``, vLLM, SGLang) to run on instead of this process,
    e.g. ``"http://127.0.0.1:8000/v1"``."""
    api_key: SecretStr | None = None
    """The server's API key (default: the ``AGENTSPEC_API_KEY`` environment variable, or none)."""
    device: str = "auto"
    dtype: str = "auto"
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: list[str] | None = None
    seed: int | None = None
    speculative: bool | agentspec.SpecConfig | None = None
    """False = plain decoding; a ``SpecConfig`` tunes speculation; None = the client's default."""
    streaming: bool = False
    """Stream internally in ``invoke`` (callbacks see each token)."""

    @property
    def _llm_type(self) -> str:
        return "agentspec"

    @property
    def model_name(self) -> str:
        return self.model or DEFAULT_MODEL_NAME

    @property
    def _default_params(self) -> dict[str, Any]:
        params = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "stop": self.stop,
            "seed": self.seed,
            "speculative": self.speculative,
        }
        return {name: value for name, value in params.items() if value is not None}

    @property
    def _identifying_params(self) -> dict[str, Any]:
        where = {"base_url": self.base_url} if self.base_url is not None else {"device": self.device, "dtype": self.dtype}
        return {"model": self.model_name, **where, **self._default_params}

    def _resolve_model_profile(self) -> ModelProfile | None:
        return ModelProfile(
            name=self.model_name,
            open_weights=True,
            text_inputs=True,
            image_inputs=False,
            audio_inputs=False,
            video_inputs=False,
            pdf_inputs=False,
            text_outputs=True,
            reasoning_output=False,
            tool_calling=True,
            tool_choice=True,
            tool_call_streaming=True,
            structured_output=True,
            temperature=True,
        )

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider="agentspec", ls_model_type="chat", ls_model_name=kwargs.get("model") or self.model_name)
        temperature = kwargs.get("temperature", self.temperature)
        params["ls_temperature"] = 0.0 if temperature is None else temperature  # agentspec's default is greedy
        if (max_tokens := kwargs.get("max_tokens", self.max_tokens)) is not None:
            params["ls_max_tokens"] = max_tokens
        if stop := stop or kwargs.get("stop") or self.stop:
            params["ls_stop"] = stop
        return params

    # -- requests ----------------------------------------------------------------------------------

    def _request(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> tuple[ClientKey, list[dict[str, Any]], dict[str, Any]]:
        """(client key, OpenAI messages, agentspec params). Unknown kwargs reach agentspec, which rejects them."""
        params = {**self._default_params, **kwargs}
        model = params.pop("model", None) or self.model  # a per-call override selects another shared client
        if stop is not None:
            params["stop"] = stop
        return self._client_key(model), convert_to_openai_messages(messages), params

    def _client_key(self, model: str | None) -> ClientKey:
        api_key = self.api_key.get_secret_value() if self.api_key is not None else None
        return ClientKey(model, self.device, self.dtype, self.base_url, api_key)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        key, openai_messages, params = self._request(messages, stop, kwargs)
        model_name = key[0] or DEFAULT_MODEL_NAME
        events = backend().iterate(key, openai_messages, params)
        try:
            for event in events:
                if (chunk := _chunk(event, model_name)) is not None:
                    if run_manager:
                        run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk
        finally:
            events.close()  # stops decoding when the consumer stops early

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        key, openai_messages, params = self._request(messages, stop, kwargs)
        model_name = key[0] or DEFAULT_MODEL_NAME
        events = backend().aiterate(key, openai_messages, params)
        try:
            async for event in events:
                if (chunk := _chunk(event, model_name)) is not None:
                    if run_manager:
                        await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk
        finally:
            await events.aclose()  # stops decoding when the consumer stops early or is cancelled

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))

    # -- tools and structured output ---------------------------------------------------------------

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | bool | dict[str, Any] | None = None,
        strict: bool | None = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools in any ``convert_to_openai_tool`` format.

        ``tool_choice``: None/"auto" (the model decides), "any"/"required"/True (some tool),
        a tool's name, an OpenAI dict, or "none". ``strict`` is accepted and always true in effect
        (calls are generated under their schema's grammar); ``parallel_tool_calls=True`` lets one
        reply hold several calls (agentspec's default is one).
        """
        del strict
        formatted = [convert_to_openai_tool(tool) for tool in tools]
        if formatted:
            kwargs["tools"] = formatted
            kwargs["tool_choice"] = _tool_choice(tool_choice)
            if parallel_tool_calls is not None:
                kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(**kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        method: StructuredMethod = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | Any]:
        """Output that follows ``schema`` (a pydantic class, a TypedDict, or a JSON schema dict).

        ``method``:
          - "json_schema" (default): the reply is generated under the schema's grammar.
          - "function_calling": a forced call of a tool whose parameters are the schema.
          - "json_mode": any JSON object (describe the keys in the prompt).
        ``strict`` is accepted; grammar-constrained output is always strict.
        """
        del strict
        if kwargs:
            raise ValueError(f"Received unsupported arguments {kwargs}")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        tracing = {"ls_structured_output_format": {"kwargs": {"method": method}, "schema": schema}}
        function = convert_to_openai_tool(schema)["function"]
        output_parser: Runnable[Any, Any]
        if method == "function_calling":
            llm = self.bind_tools([schema], tool_choice=function["name"], **tracing)
            if is_pydantic:
                output_parser = PydanticToolsParser(tools=[schema], first_tool_only=True)
            else:
                output_parser = JsonOutputKeyToolsParser(key_name=function["name"], first_tool_only=True)
        elif method in ("json_schema", "json_mode"):
            if method == "json_schema":
                json_schema = {"name": function["name"], "schema": function.get("parameters", {})}
                response_format: dict[str, Any] = {"type": "json_schema", "json_schema": json_schema}
            else:
                response_format = {"type": "json_object"}
            llm = self.bind(response_format=response_format, **tracing)
            output_parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
        else:
            raise ValueError(f"method={method!r} is not supported; use 'json_schema', 'function_calling' or 'json_mode'.")

        if not include_raw:
            return llm | output_parser
        parse = RunnablePassthrough.assign(parsed=itemgetter("raw") | output_parser, parsing_error=lambda _: None)
        no_parse = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parse.with_fallbacks([no_parse], exception_key="parsing_error")
