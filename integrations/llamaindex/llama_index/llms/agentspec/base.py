"""``AgentSpecLLM``: a LlamaIndex ``FunctionCallingLLM`` running a local model through agentspec.

Every method goes through one path: LlamaIndex messages → OpenAI dicts → an agentspec stream on the
shared background loop (``agentspec.bridge``) → ``ResponseBuilder`` → cumulative ``ChatResponse``s. The
non-streaming methods return the last response; completion methods send the prompt as one user
message through the model's chat template (``formatted`` changes nothing: there is no separate
completion prompt format).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.generic_utils import (
    achat_to_completion_decorator,
    astream_chat_to_completion_decorator,
    chat_to_completion_decorator,
    stream_chat_to_completion_decorator,
)
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    ToolCallBlock,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr, SecretStr
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW, DEFAULT_NUM_OUTPUTS
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection

import agentspec

from agentspec.bridge import ClientKey, backend
from ._convert import ResponseBuilder, parse_partial_object, resolve_tool_choice, to_openai_messages

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

__all__ = ["AgentSpecLLM"]

DEFAULT_MODEL_NAME = "agentspec-default"  # metadata.model_name when `model` is the embedded default


class AgentSpecLLM(FunctionCallingLLM):
    """A local model with lossless speculative decoding, for LlamaIndex agents and query engines.

    Constructing loads nothing: the model loads on first use (a request, or reading ``metadata``
    without an explicit ``context_window``) and is shared by every instance with the same
    ``(model, device, dtype)``.

    >>> llm = AgentSpecLLM(max_tokens=64)                                   # doctest: +SKIP
    >>> llm.complete("Name a colour.").text                                 # doctest: +SKIP
    """

    model: str | None = Field(default=None, description="None = agentspec's embedded default; else a local folder, .gguf file or cached hub id.")
    base_url: str | None = Field(default=None, description="An OpenAI-compatible server to run on (agentspec serve, vLLM, SGLang), e.g. 'http://127.0.0.1:8000/v1'; `model` is then its model id.")
    api_key: SecretStr | None = Field(default=None, description="The server's API key (default: the AGENTSPEC_API_KEY environment variable, or none).")
    device: str = Field(default="auto", description="'auto', 'cpu', 'cuda', ...")
    dtype: str = Field(default="auto", description="'auto', 'float32', 'bfloat16' or 'float16'.")
    temperature: float = Field(default=0.0, ge=0.0, description="0 = greedy (reproducible tool calls).")
    max_tokens: int | None = Field(default=None, gt=0, description="Most tokens per response; None = up to the context window.")
    context_window: int | None = Field(default=None, gt=0, description="None = the model's own (loads it when metadata is read).")
    additional_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="More agentspec request parameters: seed, top_p, top_k, min_p, stop, speculative, ..."
    )

    _context_window: int | None = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "AgentSpecLLM"

    @property
    def _key(self) -> ClientKey:
        api_key = self.api_key.get_secret_value() if self.api_key is not None else None
        return ClientKey(None if self.model is None else str(self.model), str(self.device), str(self.dtype), self.base_url, api_key)

    def client(self) -> agentspec.Client:
        """The shared, started ``agentspec.Client`` (loads the model on first use; blocking).

        It lives on a background event loop: call only its thread-safe methods (``metrics()``,
        ``metrics_text()``) from elsewhere.
        """
        return backend().run(backend().client(self._key))

    @property
    def metadata(self) -> LLMMetadata:
        if self.context_window is None and self._context_window is None:
            # a server does not say its context window: set `context_window` for a remote model
            self._context_window = DEFAULT_CONTEXT_WINDOW if self.base_url is not None else self.client().loaded.context_window
        return LLMMetadata(
            context_window=self.context_window or self._context_window,
            num_output=self.max_tokens or DEFAULT_NUM_OUTPUTS,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=str(self.model) if self.model is not None else DEFAULT_MODEL_NAME,
        )

    # -- requests ----------------------------------------------------------------------------------

    def _request(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        params = {"max_tokens": self.max_tokens, "temperature": self.temperature, **self.additional_kwargs, **kwargs}
        if not params.get("tools"):  # LlamaIndex passes tools=None / tool_choice=None without tools
            params.pop("tools", None)
            params.pop("tool_choice", None)
        return to_openai_messages(messages), params

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        response = None
        for response in self._stream(messages, kwargs):
            pass
        assert response is not None  # a stream always ends with Done
        return response.model_copy(update={"delta": None})

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream(messages, kwargs)

    def _stream(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> Iterator[ChatResponse]:
        openai_messages, params = self._request(messages, kwargs)
        builder = ResponseBuilder()
        events = backend().iterate(self._key, openai_messages, params)
        try:
            for event in events:
                yield builder.feed(event)
        finally:
            events.close()  # stops decoding if our consumer stopped early

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        response = None
        async for response in self._astream(messages, kwargs):
            pass
        assert response is not None
        return response.model_copy(update={"delta": None})

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        return self._astream(messages, kwargs)

    async def _astream(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> AsyncIterator[ChatResponse]:
        openai_messages, params = self._request(messages, kwargs)
        builder = ResponseBuilder()
        events = backend().aiterate(self._key, openai_messages, params)
        try:
            async for event in events:
                yield builder.feed(event)
        finally:
            await events.aclose()  # stops decoding if our consumer stopped early or was cancelled

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return chat_to_completion_decorator(self.chat)(prompt, **kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return stream_chat_to_completion_decorator(self.stream_chat)(prompt, **kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await achat_to_completion_decorator(self.achat)(prompt, **kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        return await astream_chat_to_completion_decorator(self.astream_chat)(prompt, **kwargs)

    # -- tools -------------------------------------------------------------------------------------

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Messages plus OpenAI function tools; ``tool_required`` → ``tool_choice="required"``, else "auto";
        ``allow_parallel_tool_calls`` → ``parallel_tool_calls`` (several calls in one response)."""
        messages = list(chat_history or [])
        if isinstance(user_msg, str):
            user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
        if user_msg is not None:
            messages.append(user_msg)
        tool_specs = [tool.metadata.to_openai_tool() for tool in tools]
        if not tool_specs:
            return {"messages": messages, **kwargs}
        choice = resolve_tool_choice(tool_choice, tool_required)
        return {"messages": messages, "tools": tool_specs, "tool_choice": choice, "parallel_tool_calls": allow_parallel_tool_calls, **kwargs}

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        """The response's tool calls; arguments still streaming are parsed as far as they came."""
        message = response.message
        selections = [
            ToolSelection(
                tool_id=block.tool_call_id or "",
                tool_name=block.tool_name,
                tool_kwargs=parse_partial_object(block.tool_kwargs) if isinstance(block.tool_kwargs, str) else block.tool_kwargs,
            )
            for block in message.blocks
            if isinstance(block, ToolCallBlock)
        ]
        if not selections:
            for call in message.additional_kwargs.get("tool_calls") or []:  # messages built elsewhere
                function = call["function"] if isinstance(call, dict) else call.function
                name = function["name"] if isinstance(function, dict) else function.name
                arguments = function.get("arguments", "") if isinstance(function, dict) else function.arguments
                selections.append(
                    ToolSelection(
                        tool_id=(call.get("id") if isinstance(call, dict) else call.id) or "",
                        tool_name=name,
                        tool_kwargs=parse_partial_object(arguments) if isinstance(arguments, str) else dict(arguments or {}),
                    )
                )
        if not selections and error_on_no_tool_call:
            raise ValueError("Expected at least one tool call, but the response has none.")
        return selections
