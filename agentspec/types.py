"""Public data types: speculation settings, stream events, usage, statistics and completions.

Events are pydantic models discriminated by ``type``. They are created only from verified tokens.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import InvalidRequestError

__all__ = [
    "Limits",
    "SpecConfig",
    "Usage",
    "SpecStats",
    "TextDelta",
    "ToolCallDelta",
    "ToolCall",
    "Done",
    "Event",
    "Completion",
    "FinishReason",
]

FinishReason = Literal["stop", "length", "tool_calls", "cancelled"]
DraftSource = Literal["grammar", "ngram", "suffix", "model"]
DRAFT_SOURCES: tuple[DraftSource, ...] = ("grammar", "ngram", "suffix", "model")


def invalid_fields(name: str, model: type[BaseModel], exc: ValidationError) -> str:
    """An ``Invalid <name>: ...`` message in agentspec's words: each bad field with the value sent and
    the rule it breaks, unknown fields with the valid ones. pydantic's own text (its type names, links
    to its documentation) stays out: a server sends this message to whoever made the request."""
    problems: list[str] = []
    unknown: list[str] = []
    for error in exc.errors(include_url=False):
        field = ".".join(str(part) for part in error["loc"])
        if error["type"] == "extra_forbidden":
            unknown.append(repr(field))
            continue
        rule = str(error["msg"]).removeprefix("Value error, ")
        rule = rule[:1].lower() + rule[1:]
        problems.append(f"`{field}`={error['input']!r}: {rule}" if field else rule)
    if unknown:
        problems.append(f"unknown field(s) {', '.join(unknown)}; the fields are: {', '.join(model.model_fields)}")
    return f"Invalid {name}: {'; '.join(problems)}."


class SpecConfig(BaseModel):
    """How the engine speculates. ``SpecConfig(enabled=False)`` is plain decoding.

    The defaults suit agent traffic on a small local model: drafts of up to 16 tokens (long copied
    runs are common; a step only verifies as many as pay off), n-gram matches of 1 to 8 tokens (a
    longer match picks the right place to copy from), and a draft length chosen per step from
    measured acceptance and measured verification cost (``adaptive``). With ``adaptive=False``
    every available draft is verified at its full length (up to ``max_draft_tokens``); tests use it
    to pin K. Output never depends on K: greedy decoding is the target's argmax, and sampling draws
    each token with noise keyed by (seed, output position), so a seed gives the same tokens as plain
    decoding whatever was drafted.

    ``sources`` names the draft sources a request may use: ``"grammar"`` (tokens a structured-output
    grammar forces), ``"ngram"`` (n-grams of the prompt and output), ``"suffix"`` (the client's cache
    of earlier outputs) and ``"model"`` (``Client(draft=...)``, when given). Leaving one out changes
    speed only, never output: the grammar's mask still applies to every token.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    max_draft_tokens: int = Field(16, ge=0, le=32, description="K: most draft tokens verified per step")
    adaptive: bool = True
    ngram_min: int = Field(1, ge=1, le=16, description="shortest suffix n-gram the drafter matches")
    ngram_max: int = Field(8, ge=1, le=16, description="longest suffix n-gram the drafter matches")
    sources: tuple[DraftSource, ...] = Field(DRAFT_SOURCES, min_length=1, description="draft sources a request may use")
    shadow_rate: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="share of finished speculative requests (greedy or sampled) re-decoded plainly when the engine is "
        "idle, to count disagreements (quality_diff_sampled; any is a bug)",
    )

    def __init__(self, /, **values: Any) -> None:  # positional-only: a field named "self" is an unknown field, not a TypeError
        try:
            super().__init__(**values)
        except ValidationError as exc:  # bad input belongs to agentspec's error tree
            raise InvalidRequestError(invalid_fields("SpecConfig", type(self), exc)) from None

    @property
    def speculates(self) -> bool:
        """Whether a request drafts at all (False: plain decoding)."""
        return self.enabled and self.max_draft_tokens > 0

    @model_validator(mode="after")
    def _ngram_range(self) -> "SpecConfig":
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})")
        if len(set(self.sources)) != len(self.sources):
            raise ValueError(f"sources lists a source twice: {self.sources}")
        return self


class Limits(BaseModel):
    """How much a client takes on at once.

    ``max_batch`` requests decode together, sharing every target pass; more wait in a queue of at
    most ``max_queued`` (then ``EngineOverloadedError``). A request is admitted only while the
    keys/values of the running ones (and its own estimate: prompt plus 256 output tokens) stay within
    ``kv_cache_mb`` — a lone request always runs. ``prefix_cache_mb`` keeps finished sequences'
    keys/values for requests that start with the same tokens (0 turns prefix reuse off). A stream
    whose consumer falls ``max_pending_events`` steps behind pauses (its keys/values wait); one that
    reads nothing for ``abandon_after_s`` while paused is freed.

    Requests may come from strangers (``agentspec serve``), so what one request can make the client
    keep is bounded too: ``max_json_depth`` caps how deeply messages, tools and schemas nest (deeper
    JSON is refused before any work; recursive validators would otherwise overflow the stack);
    ``max_json_values`` caps the values (keys included) of a request body that ``agentspec serve``
    reads, counted from its text before it is parsed (parsing holds the GIL throughout, and the
    server's event loop waits: 30 ms of CPU for 200,000 values);
    ``max_tags`` caps the distinct ``tag`` values with metrics of their own (later tags are counted
    together under ``"(other)"``); ``max_shadow_rate`` caps a request's ``SpecConfig.shadow_rate``
    (shadow checks re-decode a request, so a caller could otherwise double the engine's work).
    A structured-output or tool-call grammar is refused before it is built when its regular
    expression would exceed ``max_grammar_chars`` (bounded from the schema, never built to be
    measured); its token index is built on a pool of its own and refused after
    ``grammar_timeout_s`` (with ``grammar_processes`` > 0 it is built in a child process, killed at
    the limit; on a thread it cannot be stopped and finishes unseen); built grammars, with the masks
    of the states they reach, are kept up to ``grammar_cache_mb``. Rendering the chat
    template and tokenizing a prompt are refused after ``template_timeout_s`` (a template that
    loops is stopped). Each refusal is a ``LimitExceededError`` naming its field.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_batch: int = Field(8, ge=1, le=256, description="requests decoding at once, in one pass per step")
    max_queued: int = Field(1024, ge=1, description="requests waiting or running before new ones are refused")
    kv_cache_mb: float = Field(4096, gt=0, description="keys/values of running requests, MiB")
    prefix_cache_mb: float = Field(512, ge=0, description="keys/values kept for prefix reuse, MiB; 0 = off")
    abandon_after_s: float = Field(60.0, gt=0, description="a stream unread this long with its output backed up is freed")
    max_pending_events: int = Field(64, ge=1, description="a request's steps not yet read by its consumer before it pauses")
    max_json_depth: int = Field(64, ge=2, le=512, description="deepest nesting of messages, tools and schemas a request may send")
    max_json_values: int = Field(50_000, ge=100, description="most JSON values (keys included) a request body may hold (agentspec serve)")
    max_tags: int = Field(64, ge=0, description="distinct request tags with metric series of their own; more count as '(other)'")
    max_shadow_rate: float = Field(1.0, ge=0.0, le=1.0, description="highest SpecConfig.shadow_rate a request gets; higher is capped")
    max_grammar_chars: int = Field(200_000, ge=1_000, description="longest regular expression a schema's grammar may have (bounded before it is built)")
    grammar_timeout_s: float = Field(30.0, gt=0, description="seconds a grammar's token index may take to build")
    grammar_cache_mb: float = Field(256, ge=0, description="built grammars and their per-state masks kept for later requests, MiB")
    grammar_processes: int = Field(0, ge=0, le=64, description="grammar indexes built at once in child processes, killed at grammar_timeout_s; 0 = on threads here")
    template_timeout_s: float = Field(5.0, gt=0, description="seconds rendering the chat template and tokenizing a prompt may take")

    def __init__(self, /, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise InvalidRequestError(invalid_fields("Limits", type(self), exc)) from None


class Usage(BaseModel):
    """Token counts. ``completion_tokens`` counts every generated token, a final stop token included.
    A remote server that reports no usage leaves them ``None``."""

    prompt_tokens: int | None = 0
    completion_tokens: int | None = 0
    total_tokens: int | None = 0


class SpecStats(BaseModel):
    """Speculation metrics for one request, or summed over many (``Client.metrics()``).

    ``target_forward_passes_saved`` = output tokens − target passes: what speculation bought.
    ``ttft_ms`` and ``tpot_ms`` are per request; in aggregates they are means over ``requests``.
    A field is ``None`` where it is not known: a remote server (``Client(base_url=...)``) reports
    only some of them, and an aggregate is unknown where one of its requests' values is.
    """

    requests: int = 0
    drafted_tokens: int | None = 0
    accepted_tokens: int | None = 0
    acceptance_rate: float | None = 0.0
    accepted_by_source: dict[str, int] = Field(default_factory=dict)
    output_tokens: int | None = 0
    target_forward_passes: int | None = 0
    target_forward_passes_saved: int | None = 0
    mean_accepted_length: float | None = 0.0
    rollbacks: int | None = 0
    fallback_steps: int | None = 0
    draft_ms: float | None = 0.0
    verify_ms: float | None = 0.0
    ttft_ms: float | None = 0.0
    tpot_ms: float | None = 0.0
    cached_prompt_tokens: int | None = 0  # prompt tokens whose keys/values came from the prefix cache (not prefilled)
    shadow_checks: int = 0  # requests re-decoded plainly by shadow sampling (SpecConfig.shadow_rate)
    quality_diff_sampled: int = 0  # of those, how many disagreed with their plain decoding: bugs

    def derive(self) -> "SpecStats":
        """Recompute the ratios from the counters (after summing or finishing); returns self."""
        drafted, accepted, output, passes = self.drafted_tokens, self.accepted_tokens, self.output_tokens, self.target_forward_passes
        self.acceptance_rate = None if drafted is None or accepted is None else (accepted / drafted if drafted else 0.0)
        self.target_forward_passes_saved = None if output is None or passes is None else output - passes
        self.mean_accepted_length = None if output is None or passes is None else (output / passes if passes else 0.0)
        return self


class TextDelta(BaseModel):
    """Verified text. ``text`` never ends inside a UTF-8 character and is never retracted."""

    type: Literal["text_delta"] = "text_delta"
    text: str
    token_ids: list[int]


class ToolCallDelta(BaseModel):
    """The next fragment of a tool call's JSON arguments; ``id``/``name`` only in an index's first delta."""

    type: Literal["tool_call_delta"] = "tool_call_delta"
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ToolCall(BaseModel):
    """A complete tool call whose arguments parsed and validated against the tool's schema."""

    type: Literal["tool_call"] = "tool_call"
    index: int
    id: str
    name: str
    arguments: dict[str, Any]


class Done(BaseModel):
    """The last event of every stream."""

    type: Literal["done"] = "done"
    finish_reason: FinishReason
    usage: Usage
    stats: SpecStats


Event = Annotated[Union[TextDelta, ToolCallDelta, ToolCall, Done], Field(discriminator="type")]


class Completion(BaseModel):
    """A whole response, as collected by ``Client.generate``."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    text: str
    tool_calls: list[ToolCall] = Field(default_factory=list)
    parsed: Any = None
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    stats: SpecStats
