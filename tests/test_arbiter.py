"""The arbiter picks the draft with the most expected tokens per ms, skips sources that cannot win,
falls back to no draft when nothing pays, and keeps greedy output identical to plain decoding."""

from __future__ import annotations

import pytest

from agentspec.engine.lengths import CostModel
from agentspec.drafting import NgramDrafter
from agentspec.drafting.arbiter import ArbiterDrafter, SourceHistory
from agentspec.drafting.base import Draft
from agentspec.drafting.draft_models import ModuleDraft
from agentspec.drafting.model import ModelDrafter
from agentspec.engine import Engine
from agentspec.params import GenerationParams
from agentspec.types import SpecConfig

from .conftest import decode, tiny_model
from .test_draft_model import PROMPTS, Distorted


def costs(base: float = 10.0, per_position: float = 2.0) -> CostModel:
    """A target pass costs ``base + per_position * P`` ms."""
    model = CostModel(max_positions=17)
    for positions in range(1, 18):
        model.record(positions, base + per_position * positions)
    return model


class Clock:
    """Fake time (seconds) that only drafters advance: the tests do not depend on the machine's load."""

    now = 0.0

    def __call__(self) -> float:
        return self.now


class Scripted:
    """A drafter that proposes ``continuation(k)`` and counts its calls; takes ``delay_ms`` per token
    (0.01 ms at least) on ``clock``."""

    def __init__(
        self, source: str, continuation, clock: Clock, delay_ms: float = 0.01
    ) -> None:
        self.source, self.continuation, self.clock, self.delay_ms = (
            source,
            continuation,
            clock,
            delay_ms,
        )
        self.calls = 0

    def reset(self, prompt) -> None:
        pass

    def propose(self, k: int, after=()) -> Draft:
        self.calls += 1
        tokens = self.continuation(k)
        self.clock.now += self.delay_ms * max(len(tokens), 1) / 1e3
        return Draft(tokens, self.source, evidence=4)

    def observe(self, committed) -> None:
        pass


TRUTH = list(range(1000, 2000))


def run(arbiter: ArbiterDrafter, steps: int, k: int = 8) -> list[Draft]:
    """Drive the arbiter as the engine would, committing the true text (accepted run + 1 token)."""
    position, drafts = 0, []
    arbiter.reset([1, 2, 3])
    for _ in range(steps):
        draft = arbiter.propose(k)
        drafts.append(draft)
        accepted = 0
        while (
            accepted < len(draft.tokens)
            and draft.tokens[accepted] == TRUTH[position + accepted]
        ):
            accepted += 1
        committed = TRUTH[position : position + accepted + 1]
        position += len(committed)
        arbiter.observe(committed)
    return drafts


def test_picks_the_cheap_source_and_stops_running_the_model():
    state = {"position": 0}
    clock = Clock()
    cheap = Scripted(
        "ngram", lambda k: TRUTH[state["position"] : state["position"] + k], clock
    )  # always right
    model = Scripted(
        "model", lambda k: [7] * k, clock, delay_ms=5.0
    )  # slow and always wrong
    arbiter = ArbiterDrafter([cheap, model], costs(), clock=clock)

    def observe_position(committed, original=arbiter.observe):
        state["position"] += len(committed)
        original(committed)

    arbiter.observe = observe_position
    drafts = run(arbiter, 40)
    assert all(d.source == "ngram" and d.tokens for d in drafts), [
        (d.source, len(d.tokens)) for d in drafts
    ]
    assert cheap.calls == 40
    # the model ran while unmeasured, then only on exploration steps
    assert model.calls <= 2 + 40 // SourceHistory().explore_every, model.calls


def test_requests_share_what_a_slow_wrong_model_costs_and_try_it_ever_less_often():
    """A client's next request does not pay again to learn that its draft model loses; the model
    is retried after 16, 32, 64, ... steps (at most 256), and sooner again once it is predicted to win."""
    clock = Clock()
    history = SourceHistory()
    tries = []
    for request in range(6):
        model = Scripted("model", lambda k: [7] * k, clock, delay_ms=5.0)  # a new drafter per request, as the client makes
        run(ArbiterDrafter([model], costs(), history=history, clock=clock), 100)
        tries.append(model.calls)
    # tried once unmeasured, then explored at steps 16, 32, 64, 128, 256, 512 of the client's 600
    assert tries[0] >= 1 and sum(tries) <= 1 + 6, tries  # without back-off and sharing: 6 × (1 + 100 // 16) = 42
    assert history._interval["model"] == history.max_explore_every  # backed off all the way
    history.won("model")
    assert not history.explore_due("model") and "model" not in history._interval
    assert all(t <= 2 for t in tries[2:]), tries  # later requests: at most the odd exploration


def test_falls_back_to_no_draft_when_nothing_is_accepted():
    clock = Clock()
    wrong = Scripted("ngram", lambda k: [7] * k, clock)
    arbiter = ArbiterDrafter([wrong], costs(), clock=clock)
    drafts = run(arbiter, 30)
    assert drafts[0].tokens  # tried while its acceptance was a prior
    assert all(not d.tokens and d.source == "none" for d in drafts[-10:])
    assert arbiter.chosen is None


def test_picks_the_model_when_only_it_is_right():
    state = {"position": 0}
    clock = Clock()
    empty = Scripted("ngram", lambda k: [], clock)
    model = Scripted(
        "model",
        lambda k: TRUTH[state["position"] : state["position"] + k],
        clock,
        delay_ms=1.0,
    )
    arbiter = ArbiterDrafter([empty, model], costs(), clock=clock)
    original = arbiter.observe

    def observe_position(committed):
        state["position"] += len(committed)
        original(committed)

    arbiter.observe = observe_position
    drafts = run(arbiter, 20)
    assert all(d.source == "model" for d in drafts)
    assert len(drafts[-1].tokens) > 1


@pytest.fixture(scope="module")
def tiny_pair(loaded):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    target = tiny_model(loaded, seed=0)
    yield target, ModuleDraft(Distorted(target.model, 0.3), target.device)
    torch.set_num_threads(threads)


def test_greedy_arbiter_over_ngram_and_model_equals_plain(tiny_pair):
    target, draft = tiny_pair
    plain = Engine(target, drafter_factory=lambda p: None)
    chosen: list[str | None] = []

    class Recording(ArbiterDrafter):
        def propose(self, k, after=()):
            result = super().propose(k, after)
            chosen.append(self.chosen)
            return result

    def factory(params):
        model = ModelDrafter(
            draft, params, target.vocab_size, target.device, min_confidence=0.0
        )
        # the arbiter believes the target is slow (50 ms a pass), so model drafts pay off too
        return Recording([NgramDrafter(), model], costs(base=50.0, per_position=1.0))

    engine = Engine(target, drafter_factory=factory)
    for k in (2, 5, 8):
        for prompt in PROMPTS:
            params = GenerationParams(
                max_tokens=32, spec=SpecConfig(adaptive=False, max_draft_tokens=k)
            )
            expected = decode(plain, prompt, GenerationParams(max_tokens=32))[
                0
            ].output_ids
            assert decode(engine, prompt, params)[0].output_ids == expected, (k, prompt)
    assert {"model", "ngram"} <= set(chosen), set(
        chosen
    )  # both kinds of draft were verified
