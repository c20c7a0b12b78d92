"""``agentspec train-draft``: a draft head trained on the target's own answers to an agent's traffic.

Self-distillation, in four stages (each shows its progress on stderr):

1. **Answer**: the target answers every request of the traffic file (a JSONL of chats, each with
   the request's tools, tool choice, response format and max_tokens), batched through a ``Client``,
   under the same grammars as in production: greedily, and ``samples - 1`` more times sampled
   (temperature 0.8, seeded) for more of the target's own text from the same requests.
2. **Features**: one teacher-forced pass of the target over each prompt + answer records its
   features (the final normed hidden states: what its LM head reads) at every position.
3. **Draft vocabulary**: the N most frequent tokens of the answers (then of the prompts): the head's
   LM head is the target's, restricted to them.
4. **Train**: the head (``head.DraftHead``) learns, from (f_p, x_{p+1}), to predict f_{p+1} (smooth
   L1) and the target's next-token distribution at p + 1 over the draft vocabulary (KL to the
   target's distribution, not to the text's token). A second, unrolled step feeds the head its own
   predictions, as drafting does. Prompt positions count less than answer positions.

Requests are split into training and held-out ones (``held_out``, by request); the held-out answers
measure how often the head's first and second drafted tokens are the target's greedy tokens, which
``head.json`` records with how the head was trained.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..errors import InvalidRequestError
from .head import DraftHead, HeadConfig

__all__ = ["TrainReport", "read_traffic", "train_draft_head"]

REQUEST_KEYS = {"messages", "tools", "tool_choice", "response_format", "max_tokens"}
PROMPT_WEIGHT = 0.3  # a prompt position's weight in the loss (an answer position's is 1)
CLASSIFICATION_WEIGHT = 1.0  # the KL term's weight against the feature regression's
UNROLLED_WEIGHT = 0.5  # the second (self-fed) step's weight


@dataclasses.dataclass
class TrainReport:
    """What a training run did and measured (also written to ``head.json`` under ``training``)."""

    requests: int
    held_out_requests: int
    samples: int  # answers per request: one greedy, the rest sampled
    answer_tokens: int
    prompt_tokens: int
    draft_vocab: int
    draft_vocab_coverage: float  # share of answer tokens inside the draft vocabulary
    epochs: int
    steps: int
    seconds: dict[str, float]  # per stage
    held_out_first: float  # held-out answer positions where the head's first draft is the target's token
    held_out_second: float  # the same for its second, self-fed draft
    out: str


def read_traffic(path: str | Path) -> list[dict[str, Any]]:
    """A JSONL file of requests: ``{"messages": [...], "tools"?, "tool_choice"?, "response_format"?,
    "max_tokens"?}`` per line. ``InvalidRequestError`` names the first bad line."""
    requests = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise InvalidRequestError(f"Cannot read the traffic file {path}: {exc}.") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            request = json.loads(line)
        except ValueError as exc:
            raise InvalidRequestError(f"{path}:{number} is not JSON ({exc}).") from None
        if not isinstance(request, dict) or not isinstance(request.get("messages"), list) or not request["messages"]:
            raise InvalidRequestError(f"{path}:{number}: each line needs a non-empty 'messages' list (a chat request).")
        unknown = set(request) - REQUEST_KEYS
        if unknown:
            raise InvalidRequestError(f"{path}:{number}: unknown keys {sorted(unknown)}; a line may hold {sorted(REQUEST_KEYS)}.")
        requests.append(request)
    if len(requests) < 2:
        raise InvalidRequestError(f"{path} holds {len(requests)} request(s); training needs at least 2 (some are held out).")
    return requests


def train_draft_head(
    prompts: str | Path | list[dict[str, Any]],
    out: str | Path,
    *,
    model: str | Path | None = None,
    epochs: int = 4,
    draft_vocab: int = 8192,
    held_out: float = 0.1,
    concurrency: int = 8,
    samples: int = 1,
    learning_rate: float = 1e-3,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> TrainReport:
    """Train a draft head for ``model`` (default: the default model) on its answers to ``prompts``
    (a traffic file or its requests) and write it to ``out``. Blocks; runs its own event loop."""
    requests = read_traffic(prompts) if not isinstance(prompts, list) else prompts
    if not 0 < held_out < 1:
        raise InvalidRequestError(f"held_out must be a fraction between 0 and 1, got {held_out}.")
    if epochs < 1 or draft_vocab < 2 or samples < 1:
        raise InvalidRequestError("epochs and samples must be at least 1 and draft_vocab at least 2.")
    show = progress or _stderr_line
    torch.manual_seed(seed)
    seconds: dict[str, float] = {}

    started = time.perf_counter()
    loaded, answers = asyncio.run(_answer(requests, model, concurrency, samples, show))
    seconds["answer"] = time.perf_counter() - started

    started = time.perf_counter()
    sequences = [answer for request in answers for answer in request]
    features = [_features(loaded.model, ids, show, i, len(sequences)) for i, (ids, _) in enumerate(sequences)]
    seconds["features"] = time.perf_counter() - started

    rng = random.Random(seed)  # held-out requests (all their answers), never trained on
    order = list(range(len(answers)))
    rng.shuffle(order)
    held = max(1, round(held_out * len(order)))
    first_answer = [0]
    for request in answers:
        first_answer.append(first_answer[-1] + len(request))
    test = [first_answer[r] for r in order[:held]]  # measured on the greedy answer, as decoding runs
    train = [i for r in order[held:] for i in range(first_answer[r], first_answer[r + 1])]

    counts: Counter[int] = Counter()
    prompt_counts: Counter[int] = Counter()
    for i in train:
        ids, prompt_length = sequences[i]
        counts.update(ids[prompt_length:])
        prompt_counts.update(ids[:prompt_length])
    ranked = [token for token, _ in counts.most_common()] + [t for t, _ in prompt_counts.most_common() if t not in counts]
    draft_ids = torch.tensor(ranked[:draft_vocab], dtype=torch.long)
    coverage = sum(counts[t] for t in ranked[:draft_vocab]) / max(1, sum(counts.values()))

    name = loaded.name
    config = HeadConfig.for_target(loaded, name, len(draft_ids))
    device = loaded.device
    head = DraftHead(config, loaded, draft_ids.to(device)).to(device=device, dtype=torch.float32)
    with torch.no_grad():
        head.norm_out.weight.copy_(loaded.module.get_decoder().norm.weight.float())
    head.target.dtype, head.target.lm_rows = torch.float32, head.target.lm_rows.float()

    started = time.perf_counter()
    steps = _train(head, [sequences[i] for i in train], [features[i] for i in train], epochs, learning_rate, rng, show)
    seconds["train"] = time.perf_counter() - started
    first, second = _agreement(head, [sequences[i] for i in test], [features[i] for i in test])

    report = TrainReport(
        requests=len(order) - held,
        held_out_requests=held,
        samples=samples,
        answer_tokens=sum(len(ids) - p for ids, p in sequences),
        prompt_tokens=sum(p for _, p in sequences),
        draft_vocab=len(draft_ids),
        draft_vocab_coverage=round(coverage, 4),
        epochs=epochs,
        steps=steps,
        seconds={k: round(v, 1) for k, v in seconds.items()},
        held_out_first=round(first, 4),
        held_out_second=round(second, 4),
        out=str(out),
    )
    training = dataclasses.asdict(report)
    training.pop("out")
    head.config = dataclasses.replace(config, training=training)
    head.save(out)
    show(f"draft head written to {out}: held-out agreement {first:.0%} (first token), {second:.0%} (second); {sum(seconds.values()):.0f} s\n")
    return report


# -- stages -----------------------------------------------------------------------------------------


async def _answer(requests: list[dict[str, Any]], model: Any, concurrency: int, samples: int, show: Callable[[str], None]) -> tuple[Any, list[list[tuple[list[int], int]]]]:
    """The target's answers: per request, per sample, (prompt + answer token ids, prompt length)."""
    from ..client import Client
    from ..params import parse_params
    from ..types import SpecConfig

    sequences: list[list[tuple[int, list[int], int]]] = [[] for _ in requests]  # (sample, ids, prompt length)
    done = 0
    tokens = 0
    started = time.perf_counter()
    async with Client(model, draft="none") as client:
        loaded = client.loaded
        gate = asyncio.Semaphore(concurrency)

        async def answer(i: int, request: dict[str, Any], sample: int) -> None:
            nonlocal done, tokens
            params = {k: v for k, v in request.items() if k != "messages"}
            params.setdefault("max_tokens", 160)
            parsed = parse_params(dict(params), default_spec=SpecConfig())
            prompt_ids = loaded.chat.encode(request["messages"], parsed.tools)  # as serving renders them: the template's tool format, or agentspec's section
            sampling = {"temperature": 0.8, "seed": sample} if sample else {"temperature": 0}
            async with gate:
                completion = await client.generate(request["messages"], **sampling, **params)
            sequences[i].append((sample, prompt_ids + completion.token_ids, len(prompt_ids)))
            done += 1
            tokens += len(completion.token_ids)
            show(f"\ranswering {done}/{len(requests) * samples} ({tokens / (time.perf_counter() - started):.1f} tokens/s)")

        await asyncio.gather(*(answer(i, r, s) for s in range(samples) for i, r in enumerate(requests)))
    show("\n")
    return loaded, [[(ids, length) for _, ids, length in sorted(answers, key=lambda a: a[0])] for answers in sequences]  # greedy first


@torch.no_grad()  # not inference mode: training reads these tensors under autograd
def _features(model: Any, ids: list[int], show: Callable[[str], None], index: int, total: int) -> torch.Tensor:
    """[L, H] the target's features (final normed hidden states) at every position of ``ids``."""
    captured: list[torch.Tensor] = []
    hook = model.get_decoder().norm.register_forward_hook(lambda module, args, out: captured.append(out[0]))
    try:
        model(input_ids=torch.tensor([ids], device=model.device), logits_to_keep=1)
    finally:
        hook.remove()
    show(f"\rtarget features {index + 1}/{total}" + ("\n" if index + 1 == total else ""))
    return captured[0].float().clone()


def _losses(head: DraftHead, ids: torch.Tensor, features: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and the unrolled step's losses over one sequence: feature regression + KL."""
    positions = torch.arange(1, len(ids), device=ids.device)
    first, _ = head(features[:-1], ids[1:], positions)  # predicts f_1 .. f_{L-1}
    target_log = F.log_softmax(head.logits(features[1:]), dim=-1)

    def loss(predicted: torch.Tensor, truth: torch.Tensor, log_p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        regression = F.smooth_l1_loss(predicted, truth, reduction="none").mean(-1)
        kl = F.kl_div(F.log_softmax(head.logits(predicted), dim=-1), log_p, log_target=True, reduction="none").sum(-1)
        return ((regression + CLASSIFICATION_WEIGHT * kl) * w).sum() / w.sum()

    one = loss(first, features[1:], target_log, weights[1:])
    if len(ids) < 3:
        return one, one.new_zeros(())
    second, _ = head(first[:-1], ids[2:], positions[1:])  # its own f̂_1 .. f̂_{L-2}: predicts f_2 .. f_{L-1}
    return one, loss(second, features[2:], target_log[1:], weights[2:])


def _train(head: DraftHead, sequences: list[tuple[list[int], int]], features: list[torch.Tensor], epochs: int, learning_rate: float, rng: random.Random, show: Callable[[str], None]) -> int:
    device = features[0].device
    parameters = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=learning_rate, weight_decay=0.0)
    total = epochs * len(sequences)
    warmup = max(1, total // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(step, total) / total)))
    )
    head.train()
    step = 0
    recent: list[float] = []
    for epoch in range(epochs):
        order = list(range(len(sequences)))
        rng.shuffle(order)
        for i in order:
            ids, prompt_length = sequences[i]
            tensor = torch.tensor(ids, device=device)
            weights = torch.full((len(ids),), PROMPT_WEIGHT, device=device)
            weights[prompt_length:] = 1.0
            one, two = _losses(head, tensor, features[i], weights)
            loss = one + UNROLLED_WEIGHT * two
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
            schedule.step()
            step += 1
            recent = (recent + [loss.item()])[-50:]
            show(f"\rtraining epoch {epoch + 1}/{epochs}, step {step}/{total}, loss {sum(recent) / len(recent):.3f}")
    show("\n")
    head.eval()
    return step


@torch.no_grad()
def _agreement(head: DraftHead, sequences: list[tuple[list[int], int]], features: list[torch.Tensor]) -> tuple[float, float]:
    """Over held-out answers: how often the head's first draft (on the target's features) and its
    second (on its own prediction) are the token the target wrote."""
    first_hits = second_hits = first_total = second_total = 0
    for (ids, prompt_length), feats in zip(sequences, features):
        if len(ids) - prompt_length < 3:
            continue
        tensor = torch.tensor(ids, device=feats.device)
        positions = torch.arange(1, len(ids), device=feats.device)
        first, _ = head(feats[:-1], tensor[1:], positions)  # first[p] drafts token p + 2
        guess = head.draft_ids[head.logits(first).argmax(-1)]
        answer = slice(max(prompt_length - 2, 0), len(ids) - 2)  # positions whose drafted token is an answer token
        first_hits += int((guess[answer] == tensor[2:][answer]).sum())
        first_total += len(range(*answer.indices(len(ids))))
        second, _ = head(first[:-1], tensor[2:], positions[1:])  # second[p] drafts token p + 3
        guess2 = head.draft_ids[head.logits(second).argmax(-1)]
        answer2 = slice(max(prompt_length - 3, 0), len(ids) - 3)
        second_hits += int((guess2[answer2] == tensor[3:][answer2]).sum())
        second_total += len(range(*answer2.indices(len(ids))))
    return first_hits / max(first_total, 1), second_hits / max(second_total, 1)


def _stderr_line(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()
