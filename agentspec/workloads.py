"""The project's own agent-style workloads, shared by ``agentspec demo`` and ``agentspec bench``.

Each imitates a request an agent sends a small local model: answer from a retrieved document,
summarise it, edit code, or chat openly (the case where drafting has little to copy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Workload", "WORKLOADS", "workload"]

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
        "open_chat",
        [{"role": "user", "content": "Tell me a story about a lighthouse keeper who finds a message in a bottle."}],
        description="open-ended chat: little to copy",
    ),
)


def workload(name: str) -> Workload:
    for item in WORKLOADS:
        if item.name == name:
            return item
    raise KeyError(f"unknown workload {name!r}; choose from {', '.join(w.name for w in WORKLOADS)}")
