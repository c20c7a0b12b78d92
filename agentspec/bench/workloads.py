"""The project's own agent-style workloads, shared by ``agentspec demo`` and ``agentspec bench``.

Each imitates a request an agent sends a small local model: answer from a retrieved document,
summarise it, edit code, call a tool, extract JSON, or chat openly (the case where drafting has
little to copy). ``agent_loop`` is many requests: an on-call agent working through a queue of alerts,
each its own short conversation with the same system prompt and tool (call the tool, read its
result, tell the user) — what the suffix cache of earlier outputs is for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["WORKLOADS", "Workload", "load_workloads", "workload"]

DOCUMENT = """\
Release notes for Harbor 4.2

Harbor 4.2 adds incremental snapshots. A snapshot now stores only the blocks that changed since the
previous snapshot, which cuts storage use by up to 70 percent for databases that change slowly.
Snapshots are taken every 15 minutes by default; set snapshot.interval in harbor.toml to change it.

The retention policy keeps hourly snapshots for 2 days, daily snapshots for 30 days and monthly
snapshots for 12 months. Restoring a snapshot requires the harbor-restore command and the
administrator role.

Known issue: on volumes larger than 16 TB the first incremental snapshot can take up to 3 hours,
because Harbor must build the block map. Later snapshots are fast again.
"""

CODE = '''\
def load_users(path):
    users = []
    with open(path) as handle:
        for line in handle:
            name, email, age = line.strip().split(",")
            users.append({"name": name, "email": email, "age": int(age)})
    return users


def adults(users):
    result = []
    for user in users:
        if user["age"] >= 18:
            result.append(user)
    return result
'''


@dataclass(frozen=True)
class Workload:
    name: str
    messages: list[dict[str, Any]] = field(hash=False)
    max_tokens: int = 128
    description: str = ""
    params: dict[str, Any] = field(default_factory=dict, hash=False)  # e.g. tools, response_format
    # An agent loop: each task is a user message opening a fresh conversation after ``messages`` (the
    # shared system prompt): a tool call under ``params``, the tool's result, then the reply in text.
    tasks: tuple[str, ...] = ()

    @property
    def constrained(self) -> bool:
        return bool(self.params)

    @property
    def is_loop(self) -> bool:
        return bool(self.tasks)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
EMAIL_TOOL = {
    "type": "function",
    "function": {
        "name": "send_email",
        "description": "Send an e-mail",
        "parameters": {
            "type": "object",
            "properties": {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
            "required": ["to", "subject", "body"],
        },
    },
}
TICKET_TOOL = {
    "type": "function",
    "function": {
        "name": "create_ticket",
        "description": "Open an incident ticket for the on-call team",
        "parameters": {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 60, "description": "a few words"},
                "service": {"type": "string", "maxLength": 30, "description": "the service's name, e.g. db-3"},
                "priority": {"enum": ["low", "medium", "high"]},
                "summary": {"type": "string", "maxLength": 120, "description": "one sentence"},
            },
            "required": ["title", "service", "priority", "summary"],
        },
    },
}
ALERTS = (
    "Alert from db-3: disk usage on db-3 is at 91 percent and rising.",
    "Alert from api-gateway: the api-gateway returns HTTP 502 for 4 percent of requests.",
    "Alert from billing-worker: the billing-worker queue has 12000 pending jobs.",
    "Alert from auth: login latency on auth is 2.3 seconds at p99.",
    "Alert from search: the search cluster lost one of its three nodes.",
    "Alert from cdn: the cache hit rate on the cdn dropped to 41 percent.",
)
CONTACT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "email": {"type": "string"},
        "company": {"type": "string"},
        "role": {"type": "string"},
    },
    "required": ["name", "email", "company", "role"],
}


WORKLOADS: tuple[Workload, ...] = (
    Workload(
        "document_answer",
        [
            {"role": "system", "content": "Answer using the document. Quote it where you can."},
            {"role": "user", "content": f"{DOCUMENT}\nHow long are daily snapshots kept, and what is the known issue? Quote the document."},
        ],
        description="RAG answer quoting a retrieved document",
    ),
    Workload(
        "summary",
        [{"role": "user", "content": f"{DOCUMENT}\nSummarise these release notes in a few bullet points."}],
        description="summary of a document",
    ),
    Workload(
        "code_edit",
        [
            {
                "role": "user",
                "content": f"{CODE}\nRename the function `adults` to `filter_adults` and add a docstring to each function. "
                "Return the complete updated code.",
            }
        ],
        description="code edit that repeats most of the code",
    ),
    Workload(
        "tool_call",
        [{"role": "user", "content": "Send an e-mail to maria.garcia@example.com with the subject 'Harbor 4.2 upgrade' "
          "telling her the upgrade to Harbor 4.2 is scheduled for Friday."}],
        description="a forced tool call (two tools, tool_choice='required')",
        params={"tools": [WEATHER_TOOL, EMAIL_TOOL], "tool_choice": "required"},
    ),
    Workload(
        "extraction",
        [{"role": "user", "content": "From this signature, extract the contact:\n\nMaria Garcia\nHead of Platform Engineering\n"
          "Northwind Traders\nmaria.garcia@northwind.example.com"}],
        description="JSON extraction with a response_format schema",
        params={"response_format": {"type": "json_schema", "json_schema": {"name": "contact", "schema": CONTACT_SCHEMA}}},
    ),
    Workload(
        "agent_loop",
        [{"role": "system", "content": "You are the on-call assistant. For every alert, open a ticket with create_ticket, "
          "then tell the user which ticket you opened."}],
        max_tokens=96,
        description="an agent working through 6 alerts: a tool call, its result, a reply (12 requests)",
        params={"tools": [TICKET_TOOL], "tool_choice": "required"},
        tasks=ALERTS,
    ),
    Workload(
        "open_chat",
        [{"role": "user", "content": "Tell me a story about a lighthouse keeper who finds a message in a bottle."}],
        description="open-ended chat: little to copy",
    ),
)


def load_workloads(path: str) -> list[Workload]:
    """The user's own prompts from a JSONL file, one request per line:
    ``{"name": str, "messages": [...]}`` (or ``"prompt": str`` for one user message), with optional
    ``"max_tokens"`` and ``"params"`` (e.g. tools, response_format), as ``Client.stream`` takes them."""
    import json

    from ..params import parse_params
    from ..types import SpecConfig

    items: list[Workload] = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc})") from None
            if not isinstance(row, dict) or ("messages" in row) == ("prompt" in row):
                raise ValueError(f'{where}: each line needs exactly one of "messages" or "prompt"')
            messages = row.get("messages") or [{"role": "user", "content": str(row["prompt"])}]
            params = row.get("params") or {}
            parse_params(params, default_spec=SpecConfig())  # fail now, naming the line, not mid-run
            items.append(
                Workload(str(row.get("name") or f"line{number}"), messages, int(row.get("max_tokens", 128)), where, params)
            )
    if not items:
        raise ValueError(f"{path}: no requests in the file")
    return items


def workload(name: str) -> Workload:
    for item in WORKLOADS:
        if item.name == name:
            return item
    raise KeyError(f"unknown workload {name!r}; choose from {', '.join(w.name for w in WORKLOADS)}")
