"""``agentspec demo``: three agent requests, each streamed speculatively, then decoded plainly to
show that the output is the same and how much sooner it came.

The requests are the kinds agentspec is built for, chosen so that each answer ends on its own: an
answer quoting a retrieved document (greedy, one paragraph: the ``stop`` string ends it where the
small default model would start repeating itself), a tool call streamed as it is written (sampled
with a seed: the same seed gives the same tokens plainly), and a structured extraction into a
pydantic model. Once the pass shapes start-up left for idle time are measured (a timed run would wait on
them), each request runs, after an untimed one-token warm-up that builds its grammar, twice speculatively
(the first streamed) and twice plainly with the same parameters, each with the caches cleared so no
run replays another; the speedup is the ratio of the faster wall time of each on this machine, and
the identity line compares the token ids of all four.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from .bench.passes import until_calibrated
from .bench.workloads import DOCUMENT, EMAIL_TOOL, WEATHER_TOOL
from .client import Client
from .types import Done, SpecStats, TextDelta, ToolCall, ToolCallDelta

__all__ = ["DEMO_TASKS", "DemoTask", "Contact", "run_demo"]


class Contact(BaseModel):
    name: str
    email: str
    company: str
    role: str


@dataclass(frozen=True)
class DemoTask:
    title: str
    ask: str  # the user's request as the demo prints it
    messages: list[dict[str, Any]]
    params: dict[str, Any] = field(default_factory=dict)


SIGNATURE = "Maria Garcia\nHead of Platform Engineering\nNorthwind Traders\nmaria.garcia@northwind.example.com"

DEMO_TASKS: tuple[DemoTask, ...] = (
    DemoTask(
        "Answer from a retrieved document (greedy; one paragraph)",
        "What is the known issue on large volumes?",
        [
            {"role": "system", "content": "Answer using the document. Quote it where you can."},
            {"role": "user", "content": f"{DOCUMENT}\nWhat is the known issue on large volumes?"},
        ],
        {"max_tokens": 96, "stop": ["\n\n"]},
    ),
    DemoTask(
        "A tool call, streamed as it is written (sampled: temperature 0.2, top_p 0.9, seed 7)",
        "E-mail maria.garcia@example.com that the Harbor 4.2 upgrade is scheduled for Friday.",
        [{"role": "user", "content": "Send an e-mail to maria.garcia@example.com with the subject 'Harbor 4.2 upgrade' "
          "telling her the upgrade to Harbor 4.2 is scheduled for Friday."}],
        {"tools": [WEATHER_TOOL, EMAIL_TOOL], "tool_choice": "required", "max_tokens": 160,
         "temperature": 0.2, "top_p": 0.9, "seed": 7},
    ),
    DemoTask(
        "Structured extraction into a pydantic model (response_format=Contact)",
        "From this signature, extract the contact: " + " / ".join(SIGNATURE.splitlines()),
        [{"role": "user", "content": f"From this signature, extract the contact:\n\n{SIGNATURE}"}],
        {"response_format": Contact, "max_tokens": 96},
    ),
)


@dataclass
class _Run:
    token_ids: list[int]
    seconds: float
    stats: SpecStats
    finish_reason: str


async def _speculative(client: Client, task: DemoTask) -> _Run:
    """Stream the request, printing verified text and tool-call fragments as they arrive."""
    started = time.perf_counter()
    async with client.stream(task.messages, **task.params) as stream:
        async for event in stream:
            match event:
                case TextDelta(text=text):
                    print(text, end="", flush=True)
                case ToolCallDelta(name=name, arguments=arguments):
                    print((f"{name}(" if name else "") + arguments, end="", flush=True)
                case ToolCall(name=name, arguments=arguments):
                    print(f")\n→ ToolCall {name}: {len(arguments)} arguments, valid against the tool's schema", end="")
                case Done(stats=stats):
                    return _Run(stream.token_ids, time.perf_counter() - started, stats, event.finish_reason)
    raise RuntimeError("the stream ended without Done")


async def _timed(client: Client, task: DemoTask, speculative: bool) -> tuple[_Run, Any]:
    await client.clear_caches()
    started = time.perf_counter()
    done = await client.generate(task.messages, **task.params, speculative=speculative)
    return _Run(done.token_ids, time.perf_counter() - started, done.stats, done.finish_reason), done


async def run_demo(client: Client) -> bool:
    """Run ``DEMO_TASKS`` on a started local client, printing as it goes; True if every speculative
    output equalled its plain decoding."""
    await until_calibrated(client)  # the pass shapes start-up left for idle time measured first: no timed run waits on one
    rows: list[tuple[_Run, _Run, bool]] = []
    for number, task in enumerate(DEMO_TASKS, 1):
        await client.generate(task.messages, **{**task.params, "max_tokens": 1}, speculative=False)  # builds the grammar
        print(f"━━ {number}. {task.title} ━━\nuser: {task.ask}\nassistant: ", end="", flush=True)
        await client.clear_caches()
        spec = await _speculative(client, task)
        plain, done = await _timed(client, task, speculative=False)
        if done.parsed is not None:
            print(f"\n→ {done.parsed!r}", end="")
        # once more each, silently: a busy machine's noise is mostly added time, so keep the faster run
        again, _ = await _timed(client, task, speculative=True)
        plain_again, _ = await _timed(client, task, speculative=False)
        identical = spec.token_ids == plain.token_ids == again.token_ids == plain_again.token_ids
        spec = min(spec, again, key=lambda run: run.seconds)
        plain = min(plain, plain_again, key=lambda run: run.seconds)
        rows.append((spec, plain, identical))
        print("\n" + _comparison(spec, plain, identical) + "\n")
    return _summary(rows)


def _comparison(spec: _Run, plain: _Run, identical: bool) -> str:
    same = "identical to plain decoding" if identical else "DIFFERENT FROM PLAIN DECODING (a bug: please report it)"
    return (
        f"   {len(spec.token_ids)} tokens ({spec.finish_reason}) · speculative: {spec.stats.target_forward_passes} target passes, {spec.seconds:.2f} s · "
        f"plain: {plain.stats.target_forward_passes} passes, {plain.seconds:.2f} s · speedup {plain.seconds / spec.seconds:.2f}× · {same}"
    )


def _summary(rows: list[tuple[_Run, _Run, bool]]) -> bool:
    tokens = sum(len(spec.token_ids) for spec, _, _ in rows)
    passes = sum(spec.stats.target_forward_passes or 0 for spec, _, _ in rows)
    spec_s = sum(spec.seconds for spec, _, _ in rows)
    plain_s = sum(plain.seconds for _, plain, _ in rows)
    identical = all(same for _, _, same in rows)
    print("━━ Summary ━━")
    print(f"{len(rows)} requests, {tokens} tokens in {passes} target passes instead of {tokens} ({tokens / max(passes, 1):.2f} tokens a pass): "
          f"{spec_s:.2f} s against {plain_s:.2f} s plain, speedup {plain_s / spec_s:.2f}× on this machine.")
    print("Every output is token for token the plain decoding's." if identical else "SOME OUTPUT DIFFERS FROM PLAIN DECODING: please report it.")
    return identical
