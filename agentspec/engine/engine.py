"""The speculative decoding engine: synchronous torch code, driven by one worker thread.

``Engine.step_many(seqs)`` advances every given sequence by one step, all in ONE target pass:

1. **Draft**: per sequence, the tokens its grammar forces, then its drafter's continuation, cut at
   the first token the grammar rejects (``SequenceState.draft``).
2. **Draft lengths**: keep of each free draft the length that maximises the tokens the whole pass
   commits per millisecond (``lengths.choose_lengths``, from measured acceptance and the measured
   cost of passes by their positions). Under load extra positions stop paying and K falls to 0.
3. **Plan**: freeze each sequence's part of the pass (``Plan``): its inputs, its verified draft and
   the grammar masks along it.
4. **Pad** a pass of decode steps to the cheapest measured shape of at least its positions (on a
   2-core CPU a pass over 2-3 positions costs more than one over 4-9: two plain sequences step faster
   padded to 4). A lone plain step is never padded, so plain decoding of one request does not hang on
   timings; padded positions are written past the committed tokens and dropped with the rejected drafts.
5. **One pass**: every plan's tokens packed into one target forward (``Engine.forward``: ``packed.forward_packed``
   or a faster pass that gives the same logits, ``weights.py``).
6. **Verify** every decoding sequence at once (``verify``, flattened over the pass, one host read):
   each gets its accepted run and one recovered/bonus token.
7. **Commit** token by token under the stop rules plain decoding applies (stop tokens, stop strings,
   grammar completion, max_tokens), then roll the keys/values back to the committed tokens.
8. **Account**: per-sequence statistics and acceptance; the pass's cost for the cost model.

Plain decoding is this loop with K = 0, which is what makes "identical to plain decoding" testable;
a sequence decodes the same alone or in any batch (up to float rounding between pass shapes, as
between a verification and a plain step). A sequence's first steps are its prefill (chunks of at most
``PREFILL_CHUNK`` tokens, minus what the prefix cache supplies).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
import threading
import time
import weakref
from typing import Callable, NamedTuple

import torch

from ..drafting import NO_DRAFT, Draft, Drafter, ngram_drafter
from ..drafting.grammar import Spellings
from ..errors import ModelLoadError
from ..gguf.modules import weights_on_meta
from ..model import LoadedModel
from ..params import GenerationParams
from ..passes.packed import PackedRow, check_packed, use_packed_attention
from ..passes.threads import kernel_scope
from ..passes.weights import GGUF_ACTIVATIONS, fastest_pass_ms, pass_layout, select_weights
from .kv import KVBlock, KVLayout
from .lengths import CostModel, RowBudget, choose_lengths
from .prefix import PrefixCache
from .sequence import GrammarDeadEnd, Sequence, SequenceState, StepOutput
from .verify import flatten, verify_greedy, verify_greedy_rows, verify_sampling

__all__ = ["Engine", "Kind", "Plan"]

log = logging.getLogger("agentspec.engine")

# The latest calibration per model (weakly held) and (pass, shapes, context, repeats), for ``reuse``.
_calibrations: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, CostModel]]" = weakref.WeakKeyDictionary()
_calibrations_lock = threading.Lock()

DrafterFactory = Callable[[GenerationParams], Drafter | None]
Verdict = tuple[int, int]  # (accepted draft tokens, the recovered or bonus token)


class Kind(enum.Enum):
    PREFILL = "prefill"  # a chunk of a long prompt: writes keys/values, commits nothing
    PROMPT_TAIL = "prompt_tail"  # the prompt's last uncached tokens and a draft: commits the first tokens
    DECODE = "decode"  # the newest committed token and a draft: verified, commits 1..K+1 tokens


@dataclasses.dataclass(frozen=True)
class Plan:
    """One sequence's part of a pass, frozen once drafting ends.

    inputs: its uncached tokens (a prefill chunk, or the newest committed token);
    proposed: its draft before the pass's draft lengths cut it; draft: the draft verified;
    masks: [K+1, V] the grammar's allowed tokens at each verified position (None: unconstrained);
    pad: filler positions after it (their keys/values are dropped with the rejected drafts).
    """

    index: int  # the sequence's place in step_many's list
    state: SequenceState
    kind: Kind
    inputs: list[int]
    proposed: Draft
    draft: Draft
    masks: torch.Tensor | None
    draft_ms: float
    pad: int = 0

    @property
    def positions(self) -> int:
        return len(self.inputs) + len(self.draft.tokens) + self.pad

    def committed_inputs(self, verdict: "Verdict | None") -> int:
        """How many of this plan's positions hold committed tokens after its verdict: its inputs and
        its accepted drafts (their features are the target's; the rest were rolled back)."""
        return len(self.inputs) + (verdict[0] if verdict is not None else 0)

    def row(self) -> PackedRow:
        tokens = self.inputs + self.draft.tokens
        logits = 0 if self.kind is Kind.PREFILL else len(self.draft.tokens) + 1
        return PackedRow(self.state.block, tokens + tokens[-1:] * self.pad, logits, self.pad, features=self.state.wants_features)


class _Proposal(NamedTuple):
    """A sequence's step between drafting and freezing its plan."""

    index: int
    state: SequenceState
    kind: Kind
    inputs: list[int]
    draft: Draft
    states: list[int]  # grammar states along the draft ([] without a grammar)
    budget: RowBudget
    draft_ms: float  # this sequence's own drafting time


@dataclasses.dataclass
class _IdleCalibration:
    """What ``Engine.calibrate(idle=True)`` left to measure while the engine is idle."""

    jobs: list[Callable[[], bool]]  # each runs one pass (True) or, skipped, none (False)
    key: tuple  # of _calibrations
    spent: float = 0.0  # seconds measured so far


def _on_pass_threads(method: Callable) -> Callable:
    """``method`` within the engine's thread scope (``Engine._threads``): where the pass runs on the
    kernels' own threads, torch's operations of the step run on the calling thread alone."""

    @functools.wraps(method)
    def scoped(self: "Engine", *args, **kwargs):
        with self._threads():
            return method(self, *args, **kwargs)

    return scoped


class Engine:
    """Decodes sequences of one model. Not thread-safe: one worker thread calls ``start``/``step_many``."""

    PREFILL_CHUNK = 512  # prompt tokens per pass: a long prompt joining a batch delays the others' step by at most this
    CALIBRATION_SHAPES = (24, 32, 48, 64)  # beyond 1..K+1: the passes of a batch
    CALIBRATION_TOKEN = 100  # any ordinary token: calibration times pass shapes, whatever the text
    # Seconds of start-up spent measuring pass shapes beyond the first two (1 and the longest
    # verification): a small model measures them all, a large one the most useful within this and
    # the rest as they run (a 3B model's 21 shapes took 15 s of start-up, three runs each)
    CALIBRATION_BUDGET_S = 2.0
    LONG_PASS_MS = 250.0  # a pass this long is measured once (an 8B model's verifications on 2 cores)

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_draft_tokens: int = 16,
        drafter_factory: DrafterFactory | None = None,
        prefix_cache: PrefixCache | None = None,
        weights: str = "auto",
    ) -> None:
        self.loaded = loaded
        # the module tree the block passes read (a GGUF file's holds no float weights); passes on
        # float weights, asked for by name, take the float model (dequantised on first use)
        self.model = loaded.module if weights == "auto" or weights in GGUF_ACTIVATIONS else loaded.model
        self.device = loaded.device
        if not weights_on_meta(self.model):  # a module tree only the block passes run needs no attention of its own
            use_packed_attention(self.model)
        self.layout = KVLayout.of(self.model)
        # The target pass: over the model's own modules, or a faster one that gives the same logits.
        try:
            self.weights = select_weights(self.model, self.layout, weights, loaded.gguf_file)
        except NotImplementedError as exc:
            raise ModelLoadError(f"weights={weights!r} cannot run here: {exc}. Use weights='auto' or 'eager'.") from exc
        self.forward = self.weights.forward
        # a pass on the kernels' own threads: this thread's torch operations on it alone (passes/threads.py)
        self._threads = kernel_scope if self.weights.isa is not None else contextlib.nullcontext
        self.layout = pass_layout(self.layout, self.forward)  # the keys and values as the pass stores them
        self.costs = CostModel(max_positions=max(max_draft_tokens + 1, *self.CALIBRATION_SHAPES))
        self._calibrate_shapes = [*range(1, max_draft_tokens + 2), *self.CALIBRATION_SHAPES]
        self.drafter_factory = drafter_factory or (lambda params: ngram_drafter(params, loaded))
        self.prefix_cache = prefix_cache
        self.spellings = Spellings(loaded.token_bytes)  # how the model writes held tokens, learned from all outputs
        # Test seam: called with the sequences of every decoding pass before it runs; raising fails
        # that pass as a real fault (out of memory, say) would.
        self.before_pass: Callable[[list[Sequence]], None] | None = None
        self._state: dict[Sequence, SequenceState] = {}  # per-sequence helpers, so `Sequence` stays plain data
        self._idle_calibration: _IdleCalibration | None = None  # shapes calibrate(idle=True) left

    # -- lifecycle ---------------------------------------------------------------------------------

    @_on_pass_threads
    @torch.inference_mode()
    def calibrate(self, context: int = 64, repeats: int = 3, *, reuse: bool = False, idle: bool = False) -> None:
        """Check the packed attention against the model's own (where the pass asks for it:
        ``SelectedWeights.check_at_start``), then measure the pass shapes, most useful first, for
        ``CALIBRATION_BUDGET_S`` beyond the first two (which also warms the kernels up). The fastest
        of ``repeats`` runs is kept: interference from other processes only adds time.

        reuse: where an engine of this process already calibrated the same model, pass and shapes,
          start from its measurements instead (a second client on a loaded model starts without
          measuring again); the costs are tracked live from the first pass either way.
        idle: measure only the first two shapes now, one run each, and the rest (their other runs,
          the cost of a further sequence, then the other shapes) within the budget one pass at a
          time while nothing else runs (``calibrate_idle``: the client's worker thread calls it when
          no request is active or queued), so that start-up does not wait for them.
        """
        key = (self.weights.name, tuple(self._calibrate_shapes), context, repeats)
        if reuse:
            with _calibrations_lock:
                earlier = _calibrations.get(self.model, {}).get(key)
            if earlier is not None:
                self.costs.copy_from(earlier)
                return
        try:
            if self.weights.check_at_start:
                check_packed(self.model, self.layout, self.weights.tolerance, forward=self.forward)
        except NotImplementedError as exc:
            raise ModelLoadError(
                f"{self.loaded.name}: this architecture's attention is not supported by agentspec's batched passes ({exc})."
            ) from exc
        token = self.CALIBRATION_TOKEN
        block = KVBlock(self.layout)
        # the shapes' past: its length is what they cost, not its keys (an 8B model's prefill of it took
        # ~3 s), then one token's pass on it, which warms the kernels up
        block.pad(max(context, 1) - 1)
        started = time.perf_counter()
        self.forward([PackedRow(block, [token], 1)])
        order = self._calibration_order()
        for index, positions in enumerate(order):
            if index >= 2 and (idle or time.perf_counter() - started > self.CALIBRATION_BUDGET_S):
                break  # the rest are measured as passes of those shapes run (CostModel.record)
            self.costs.record(positions, self._shape_ms(block, positions, 1 if idle else repeats))
        if idle:  # the rest one pass at a time while idle: the two shapes' other runs, the cost of a further sequence, the shapes
            skipped: set[int] = set()
            # (a later run of a shape never skips; one of LONG_PASS_MS or more is measured once, as _fastest does)
            again = [self._shape_job(block, p, run, skipped) for p in order[:2] if self.costs.cost(p) < self.LONG_PASS_MS for run in range(1, repeats)]
            jobs = [*again, *self._segment_jobs(context, 1), *(self._shape_job(block, p, run, skipped) for p in order[2:] for run in range(repeats))]
            self._idle_calibration = _IdleCalibration(jobs, key)
        else:
            for job in self._segment_jobs(context, repeats):
                job()
        self._remember_calibration(key)

    def _segment_jobs(self, context: int, repeats: int) -> list[Callable[[], bool]]:
        """What each further sequence adds to a pass (``CostModel.segment_ms``): one token each of
        ``segments`` sequences against one sequence of ``segments`` tokens (same positions, same linear
        layers), both over a past of one token (against the shapes' past of ``context`` the attention
        it saves hid the cost). Three passes of ``segments`` positions, one a job (each returns True:
        it ran one), so that none while idle is longer than a verification of 7 drafted tokens."""
        segments, past, token = 8, 1, self.CALIBRATION_TOKEN
        blocks: list[KVBlock] = []
        one: list[float] = []

        def prefill() -> bool:
            blocks.extend(KVBlock(self.layout) for _ in range(segments))
            self.forward([PackedRow(b, list(range(token, token + past)), 1) for b in blocks])
            return True

        def one_sequence() -> bool:
            one.append(self._shape_ms(blocks[0], segments, repeats))
            return True

        def many_sequences() -> bool:
            ms = self._fastest([PackedRow(b, [token], 1) for b in blocks], repeats)
            self.costs.segment_ms = max(0.0, (ms - one[0]) / (segments - 1))
            blocks.clear()
            return True

        return [prefill, one_sequence, many_sequences]

    def _shape_job(self, block: KVBlock, positions: int, run: int, skipped: set[int]) -> Callable[[], bool]:
        """One run of a pass of ``positions`` over ``block`` (calibration's past), recorded; nothing
        (False) for a shape measured before its first run (passes measure their own as they run) or
        estimated at ``LONG_PASS_MS`` or more (a request arriving would wait for it)."""

        def job() -> bool:
            if positions in skipped or (run == 0 and (self.costs.measured(positions) or self.costs.cost(positions) >= self.LONG_PASS_MS)):
                skipped.add(positions)
                return False
            self.costs.record(positions, self._shape_ms(block, positions, 1))
            return True

        return job

    def _remember_calibration(self, key: tuple) -> None:
        measured = CostModel(self.costs.max_positions)
        measured.copy_from(self.costs)
        with _calibrations_lock:
            _calibrations.setdefault(self.model, {})[key] = measured

    @property
    def calibrating(self) -> bool:
        """Whether ``calibrate(idle=True)`` left shapes to measure (``calibrate_idle``)."""
        return self._idle_calibration is not None

    @_on_pass_threads
    @torch.inference_mode()
    def calibrate_idle(self) -> None:
        """One pass of what ``calibrate(idle=True)`` left, while nothing else runs (a request arriving
        waits for one pass at most): the cost of a further sequence, then shapes not measured yet,
        each run as often as calibration runs it, until none or ``CALIBRATION_BUDGET_S`` is left."""
        idle = self._idle_calibration
        if idle is None:
            return
        while idle.jobs and idle.spent <= self.CALIBRATION_BUDGET_S:
            job, started = idle.jobs.pop(0), time.perf_counter()
            try:
                ran = job()
            except Exception:  # out of memory, say: the shapes left are measured as they run instead
                log.exception("calibration while idle failed; the pass shapes left are measured as they run")
                break
            if ran:
                idle.spent += time.perf_counter() - started
                self._remember_calibration(idle.key)
                return
        self._idle_calibration = None  # done: its blocks of keys and values go with it

    def _calibration_order(self) -> list[int]:
        """The shapes to measure, most useful first: a plain step and the longest verification, the
        powers of two between, the batch shapes, then the rest."""
        shapes, longest = self._calibrate_shapes, self._calibrate_shapes[: -len(self.CALIBRATION_SHAPES)][-1]
        first = [1, longest, *(p for p in (2, 4, 8, 16, 32) if p < longest), *self.CALIBRATION_SHAPES]
        return list(dict.fromkeys([*first, *shapes]))

    @_on_pass_threads
    @torch.inference_mode()
    def time_pass(self, positions: int, repeats: int = 1, context: int = 64) -> float:
        """The fastest of ``repeats`` passes of ``positions`` tokens after a past of ``context``
        (calibration's shape; one run where it takes ``LONG_PASS_MS`` or more), in ms, measured now
        and not recorded in ``costs``: a figure to set beside another measurement taken in turn with
        it (``agentspec bench``: the machine's read bandwidth). Call it on the engine's thread,
        between steps (``Client.run_on_worker``)."""
        for name, value in (("positions", positions), ("repeats", repeats), ("context", context)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, not {value!r}")
        if context - 1 + positions > self.loaded.context_window:
            raise ValueError(f"a pass of {positions} positions after {context - 1} does not fit the context window of {self.loaded.context_window}")
        block = KVBlock(self.layout)
        block.pad(context - 1)
        return self._shape_ms(block, positions, repeats)

    def _shape_ms(self, block: KVBlock, positions: int, repeats: int) -> float:
        """``_fastest`` of a pass of ``positions`` calibration tokens over ``block``, every one with logits."""
        return self._fastest([PackedRow(block, [self.CALIBRATION_TOKEN] * positions, positions)], repeats)

    def _fastest(self, rows: list[PackedRow], repeats: int) -> float:
        """The fastest of ``repeats`` runs of one pass over ``rows`` (rolled back after each), in ms;
        one run where it takes ``LONG_PASS_MS`` or more (interference is a small part of it)."""
        first = fastest_pass_ms(self.forward, rows, 1)
        return first if first >= self.LONG_PASS_MS or repeats <= 1 else min(first, fastest_pass_ms(self.forward, rows, repeats - 1))

    def start(self, seq: Sequence) -> None:
        """Register a sequence; its first ``step`` is the prefill (of what the prefix cache lacks)."""
        loaded = self.loaded
        state = SequenceState(
            seq,
            layout=self.layout,
            vocab_size=loaded.vocab_size,
            device=self.device,
            token_bytes=loaded.token_bytes,
            stop_token_ids=loaded.stop_token_ids,
            drafter=self.drafter_factory(seq.params),
            spellings=self.spellings,
        )
        if self.prefix_cache is not None:
            seq.num_cached = self.prefix_cache.fill(state.block, seq.prompt_ids, salt=seq.params.cache_salt)
            seq.stats.cached_prompt_tokens = seq.num_cached
        self._state[seq] = state

    def release(self, seq: Sequence) -> None:
        """A sequence ended (finished, cancelled or failed): finish its statistics, free its keys/values
        and helpers. A finished sequence's keys/values go to the prefix cache: the next turn of a
        conversation starts with them."""
        seq.finish_stats()
        state = self._state.pop(seq, None)
        if state is not None and self.prefix_cache is not None and seq.finish_reason in ("stop", "length"):
            self.prefix_cache.add(seq.tokens[: state.block.length], state.block, salt=seq.params.cache_salt)

    def close(self) -> None:
        """Drop every sequence, the prefix cache and what calibration left (their keys/values are freed now)."""
        self._state.clear()
        self._idle_calibration = None
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    @property
    def active(self) -> int:
        return len(self._state)

    @property
    def kv_bytes(self) -> int:
        """Memory held by the keys/values of active sequences."""
        return sum(state.block.nbytes for state in self._state.values())

    def __contains__(self, seq: Sequence) -> bool:
        """Whether ``seq`` is started and not yet released."""
        return seq in self._state

    def grammar_state(self, seq: Sequence) -> int | None:
        """The grammar state after ``seq``'s committed tokens (None without a grammar): diagnostics."""
        grammar = self._state[seq].grammar
        return grammar.state if grammar is not None else None

    # -- the step ----------------------------------------------------------------------------------

    def step(self, seq: Sequence) -> StepOutput:
        """One step of one sequence; raises what failed it."""
        result = self.step_many([seq])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    @_on_pass_threads
    @torch.inference_mode()
    def step_many(self, seqs: list[Sequence]) -> list[StepOutput | Exception]:
        """One step of every sequence in one target pass: what each committed, or what failed it.

        A failure in one sequence (its drafter, grammar, logits) ends that sequence only. If the
        shared pass itself fails (out of memory, say), each sequence is retried in a pass of its own,
        so only the ones that fail alone fail.
        """
        results: list[StepOutput | Exception | None] = [None] * len(seqs)
        # 1. Draft: grammar-forced tokens, then the drafter's, cut where the grammar rejects one.
        proposals = []
        for index, seq in enumerate(seqs):
            try:
                proposals.append(self._propose(index, self._state[seq]))
            except Exception as exc:
                results[index] = exc
        # 2. Draft lengths: what pays for the whole pass (forced tokens always verify).
        budgets = [proposal.budget for proposal in proposals]
        lengths = choose_lengths(budgets, self.costs) if any(b.available for b in budgets) else [0] * len(budgets)
        # 3. Plan: each sequence's part of the pass, frozen.
        plans = []
        for proposal, free in zip(proposals, lengths):
            try:
                plans.append(self._freeze(proposal, free))
            except Exception as exc:
                results[proposal.index] = exc
        # 4. Pad to the cheapest measured shape.  5.-8. One pass, verify, commit, account.
        if plans:
            self._run_pass(self._pad(plans), results)
        return [result if result is not None else RuntimeError("not stepped") for result in results]

    def _propose(self, index: int, state: SequenceState) -> _Proposal:
        """1. A prefill chunk, or the newest committed token with this step's draft."""
        seq = state.seq
        uncached = seq.tokens[seq.num_cached :]
        if len(uncached) > self.PREFILL_CHUNK:  # a long prompt: this pass only writes its keys/values
            chunk = uncached[: self.PREFILL_CHUNK]
            return _Proposal(index, state, Kind.PREFILL, chunk, NO_DRAFT, [], state.budget(NO_DRAFT, len(chunk)), 0.0)
        started = time.perf_counter()
        draft, states = state.draft()
        kind = Kind.DECODE if len(uncached) == 1 else Kind.PROMPT_TAIL
        draft_ms = (time.perf_counter() - started) * 1e3
        return _Proposal(index, state, kind, uncached, draft, states, state.budget(draft, len(uncached)), draft_ms)

    def _freeze(self, proposal: _Proposal, free: int) -> Plan:
        """3. The plan: the draft cut to its forced tokens and ``free`` more, the masks along it."""
        started = time.perf_counter()
        draft = proposal.draft.cut(proposal.draft.forced + free)
        grammar = proposal.state.grammar
        masks = grammar.masks(proposal.states[: len(draft.tokens) + 1]) if grammar is not None and proposal.kind is not Kind.PREFILL else None
        draft_ms = proposal.draft_ms + (time.perf_counter() - started) * 1e3  # its own drafting and masks only
        return Plan(proposal.index, proposal.state, proposal.kind, proposal.inputs, proposal.draft, draft, masks, draft_ms)

    def _pad(self, plans: list[Plan]) -> list[Plan]:
        """4. Pad a pass of decode steps to the cheapest measured shape of at least its positions (a
        2-core CPU runs 2-3 positions slower than 4-9). Never a lone plain step: its output must not
        hang on timings. Passes with prompt tokens are left as they are."""
        if any(plan.kind is not Kind.DECODE for plan in plans):
            return plans
        positions = sum(plan.positions for plan in plans)
        pad = self.costs.best_shape(positions) - positions
        if positions == 1 or pad <= 0:
            return plans
        window = self.loaded.context_window
        room = [window - plan.state.block.length - plan.positions for plan in plans]
        roomiest = max(range(len(plans)), key=room.__getitem__)
        if room[roomiest] < pad:
            return plans
        return [dataclasses.replace(plan, pad=pad) if i == roomiest else plan for i, plan in enumerate(plans)]

    def _run_pass(self, plans: list[Plan], results: list[StepOutput | Exception | None]) -> None:
        """5.-8. One target pass over ``plans``, verification, then each one's commit into ``results``.
        If the pass itself fails with several sequences in it, each is retried in a pass of its own."""
        started = time.perf_counter()
        try:
            if self.before_pass is not None:
                self.before_pass([plan.state.seq for plan in plans])
            rows = [plan.row() for plan in plans]
            starts = [plan.state.block.length for plan in plans]  # each row's first position
            logits = self.forward(rows)  # 5. one pass
            self._sync()
        except Exception as exc:
            if len(plans) == 1:
                results[plans[0].index] = exc
                return
            log.warning("a batched pass failed (%s); retrying its %d sequences one by one", exc, len(plans))
            for plan in plans:
                self._run_pass([plan], results)
            return
        pass_ms = (time.perf_counter() - started) * 1e3
        if all(plan.kind is Kind.DECODE for plan in plans):  # prompt tokens say nothing about verification cost
            self.costs.record(sum(plan.positions for plan in plans), pass_ms, segments=len(plans))
        verdicts = self._verify(plans, logits, results)  # 6. verify
        for plan, verdict, row, start in zip(plans, verdicts, rows, starts):
            if results[plan.index] is not None:  # its logits pipeline failed
                continue
            try:
                results[plan.index] = output = self._commit(plan, verdict, pass_ms)  # 7. commit, 8. account
                if row.hidden is not None and output.finish_reason is None:  # a drafter reads the target's features
                    plan.state.observe_features(start, row.hidden[: plan.committed_inputs(verdict)])
            except Exception as exc:
                results[plan.index] = exc

    def _verify(self, plans: list[Plan], logits: list[torch.Tensor], results: list[StepOutput | Exception | None]) -> list[Verdict | None]:
        """6. Every decoding plan's verdict (None for a prefill chunk): its rows through its logits
        pipeline, then one vectorised call per decoding mode over the pass's flattened rows, read
        back in one transfer (on a CPU, greedy rows are read back and verified in a loop:
        ``verify_greedy_rows``). A plan whose pipeline fails gets its exception in ``results``."""
        greedy: list[tuple[int, torch.Tensor]] = []  # (plan, [K+1] greedy tokens)
        sampled: list[tuple[int, torch.Tensor]] = []  # (plan, [K+1, V] distributions)
        for i, (plan, rows) in enumerate(zip(plans, logits)):
            if plan.kind is not Kind.PREFILL:
                try:
                    (greedy if plan.state.seq.params.greedy else sampled).append((i, plan.state.target(rows, plan.draft, plan.masks)))
                except Exception as exc:
                    results[plan.index] = exc
        found: list[Verdict] = []  # the greedy plans' verdicts, then the sampled ones'
        on_device = []  # ([S] accepted, [S] tokens) of each mode verified on the device
        if greedy:
            targets = torch.cat([t for _, t in greedy])
            drafts = [plans[i].draft.tokens for i, _ in greedy]
            if self.device.type == "cpu":  # a loop over the pass's few rows (verify_greedy_rows says why)
                found += verify_greedy_rows(targets.tolist(), drafts)
            else:
                on_device.append(verify_greedy(targets, *flatten(drafts, self.device)))
        if sampled:
            chosen = [plans[i] for i, _ in sampled]
            drafted, counts = flatten([p.draft.tokens for p in chosen], self.device)
            keys = [key for p in chosen for key in p.state.noise_keys(len(p.draft.tokens) + 1)]  # seed, output position
            keys_tensor = torch.tensor(keys, dtype=torch.int32, device=self.device)
            on_device.append(verify_sampling(torch.cat([t for _, t in sampled]), drafted, keys_tensor, counts))
        if on_device:
            accepted, tokens = torch.cat([torch.stack(v) for v in on_device], dim=1).tolist()  # the pass's one host read
            found += zip(accepted, tokens)
        out: list[Verdict | None] = [None] * len(plans)
        for (i, _), verdict in zip(greedy + sampled, found):
            out[i] = verdict
        return out

    def _commit(self, plan: Plan, verdict: Verdict | None, pass_ms: float) -> StepOutput:
        """7. Commit the verdict, roll the keys/values back to the committed tokens. 8. Account."""
        state, seq = plan.state, plan.state.seq
        if verdict is None:  # a prefill chunk
            seq.num_cached = state.block.length
            state.account(plan.proposed, plan.draft, None, 0, plan.draft_ms, pass_ms)
            return StepOutput("", [])
        accepted, token = verdict
        if plan.masks is not None and not bool(plan.masks[accepted].any()):  # rows before it accepted a draft token
            raise GrammarDeadEnd(
                f"The grammar allows no token after {seq.generated + accepted} generated tokens; the schema cannot "
                "be continued with this vocabulary. Simplify the schema."
            )
        committed_before = len(seq.tokens)
        output = state.commit(plan.draft.tokens[:accepted] + [token])
        state.block.length = seq.num_cached = committed_before + accepted  # all but the newest token
        state.account(plan.proposed, plan.draft, verdict, committed_before, plan.draft_ms, pass_ms)
        return output

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
