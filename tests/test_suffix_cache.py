"""Suffix drafting from earlier outputs: the bounded cache, its matching rule, the drafter, and an
agent loop on the real model where later requests repeat what earlier responses said."""

from __future__ import annotations

import threading

import pytest

from agentspec.drafting import NgramDrafter
from agentspec.drafting.arbiter import ArbiterDrafter
from agentspec.drafting.suffix import SuffixCache, SuffixDrafter
from agentspec.engine import Engine
from agentspec.engine.lengths import CostModel
from agentspec.params import GenerationParams

from .conftest import decode, quiet_costs


def test_longest_match_wins_across_documents():
    cache = SuffixCache(min_n=1, max_n=4)
    cache.add([1, 2, 3, 9, 9])  # 2-token match [2, 3] → 9, 9
    cache.add([7, 3, 5, 5])  # 1-token match [3] → 5, 5 (more recent, but shorter)
    assert cache.lookup([0, 8, 3], 2) == (
        [5, 5],
        1,
    )  # a tie on [3]: the more recent document
    assert cache.lookup([0, 2, 3], 2) == (
        [9, 9],
        2,
    )  # the longer match, in the older document
    assert cache.lookup([0, 8, 3], 2) == (
        [9, 9],
        1,
    )  # ... which that lookup made the most recently used
    assert cache.lookup([4, 4], 2) == ([], 0)
    assert cache.lookup([2, 3], 0) == ([], 0)


def test_ties_go_to_the_most_recently_used_document():
    cache = SuffixCache(min_n=2, max_n=4)
    cache.add([1, 2, 3])
    cache.add([1, 2, 4])
    assert cache.lookup([1, 2], 1) == ([4], 2)  # the newer document
    assert cache.lookup([5, 1, 2, 3], 1) == (
        [],
        0,
    )  # [2, 3] and [1, 2, 3] end both documents: no continuation


def test_lru_bound_by_tokens():
    cache = SuffixCache(max_tokens=10, min_n=2, max_n=2)
    cache.add([1, 2, 3, 4])  # a
    cache.add([5, 6, 7, 8])  # b
    assert cache.lookup([1, 2], 1) == (
        [3],
        2,
    )  # uses a: now b is the least recently used
    cache.add([9, 10, 11, 12])  # 12 tokens > 10: evict b
    assert len(cache) == 2 and cache.size == 8
    assert cache.lookup([5, 6], 1) == ([], 0)
    assert cache.lookup([1, 2], 1) == ([3], 2)
    cache.add(
        list(range(100, 130))
    )  # longer than the bound: only its last 10 tokens, alone
    assert len(cache) == 1 and cache.size == 10
    assert cache.lookup([120, 121], 2) == ([122, 123], 2)
    assert cache.lookup([101, 102], 1) == ([], 0)


def test_thread_safe_adds_and_lookups():
    cache = SuffixCache(max_tokens=500, min_n=2, max_n=4)

    def work(offset: int) -> None:
        for i in range(200):
            cache.add([offset, i, i + 1, i + 2])
            cache.lookup([offset, i], 2)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.size <= 500 and cache.size == 4 * len(cache)


def test_suffix_drafter_follows_the_protocol():
    cache = SuffixCache(min_n=2, max_n=4)
    cache.add([10, 11, 12, 13, 14, 15])
    drafter = SuffixDrafter(cache)
    drafter.reset([1, 2, 10, 11])
    draft = drafter.propose(3)
    assert (draft.tokens, draft.source, draft.evidence) == ([12, 13, 14], "suffix", 2)
    assert drafter.propose(2, after=[12]).tokens == [
        13,
        14,
    ]  # continues after another source's tokens
    drafter.observe([12, 13])
    assert drafter.propose(5).tokens == [14, 15] and drafter.propose(5).evidence == 4
    drafter.observe([99])
    assert drafter.propose(3).tokens == []


# -- an agent loop on the real model -------------------------------------------------------------------

FIELDS = ["name", "email", "city", "phone", "country"]
TURN = "Write a Python function get_{0}(record) that returns record['{0}'] or None when the key is missing. Explain it briefly."
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def agent_loop(loaded, engine):
    """Six requests, each a fresh conversation (earlier answers are not in the prompt): plain,
    n-gram only, and arbiter(n-gram, suffix) with the suffix cache filled by earlier answers."""
    cache = SuffixCache()
    ngram = Engine(
        loaded,
        drafter_factory=lambda p: NgramDrafter(
            min_n=p.spec.ngram_min, max_n=p.spec.ngram_max
        ),
    )
    both = Engine(loaded)
    both.drafter_factory = lambda p: ArbiterDrafter(
        [
            NgramDrafter(min_n=p.spec.ngram_min, max_n=p.spec.ngram_max),
            SuffixDrafter(cache),
        ],
        both.costs,
    )
    plain = Engine(loaded, drafter_factory=lambda p: None)
    # Fixed costs (conftest.quiet_costs), not the session engine's calibration: measured under the
    # suite's two workers, a plain step could look so cheap that no suffix draft was verified (CI: 0
    # accepted), and this test is about what the cache drafts, not about this machine's load.
    costs = CostModel(max_positions=17)
    quiet_costs(costs)
    ngram.costs = both.costs = costs
    runs = {"plain": [], "ngram": [], "suffix": []}
    params = GenerationParams(max_tokens=MAX_TOKENS)
    for field in FIELDS:
        prompt = loaded.chat.encode([{"role": "user", "content": TURN.format(field)}])
        runs["plain"].append(decode(plain, prompt, params)[0])
        runs["ngram"].append(decode(ngram, prompt, params)[0])
        seq = decode(both, prompt, params)[0]
        runs["suffix"].append(seq)
        cache.add(seq.output_ids)  # the client's on_finished hook does this
    return runs


def test_agent_loop_output_equals_plain(agent_loop):
    for plain, ngram, suffix in zip(
        agent_loop["plain"], agent_loop["ngram"], agent_loop["suffix"]
    ):
        assert ngram.output_ids == plain.output_ids
        assert suffix.output_ids == plain.output_ids


def test_agent_loop_drafts_from_earlier_outputs(agent_loop, capsys):
    later = agent_loop["suffix"][1:]  # the first request has no earlier output to copy
    assert sum(s.stats.accepted_by_source.get("suffix", 0) for s in later) > 0

    def per_pass(seqs) -> float:
        return sum(s.generated for s in seqs) / sum(
            s.stats.target_forward_passes for s in seqs
        )

    ngram, suffix = per_pass(agent_loop["ngram"][1:]), per_pass(later)
    with capsys.disabled():
        print(
            f"\nagent loop, turns 2-{len(FIELDS)}: tokens per target pass n-gram {ngram:.2f}, n-gram+suffix {suffix:.2f} ({suffix / ngram:.2f}x)"
        )
