"""A trained draft head: drafting from the target's own features (EAGLE-style), for novel text.

Where nothing can be copied, the target's last hidden state already knows much of what comes next.
A ``DraftHead`` is one small decoder layer trained (``agentspec.drafting.train``) to predict the
target's next feature from its current one:

    feature f_p (the target's final, normed hidden state at position p: what its LM head reads)
    + the embedding of token x_{p+1}
    → RMSNorm each, concatenate, project 2H → H
    → one Llama decoder layer (its own small KV cache; the target's rotary embedding and positions)
    → RMSNorm: the predicted feature f̂_{p+1}
    → the target's frozen LM head, restricted to a frequency-ranked draft vocabulary
      (mapped back to target ids): the draft of x_{p+2}.

Drafting several tokens, the head feeds its own predicted feature back with the token it drafted.
Its weights are small (the embedding and LM head are the target's, read at load, never stored): a
head for the default model is ~3 M parameters, 6 MB in bfloat16 on disk.

``HeadDrafter`` is the ``Drafter`` (``source="model"``): the engine hands it the target's features
of committed positions after every pass (``observe_features``); its KV cache holds committed
positions only (speculative ones live for one ``propose``). It chooses tokens exactly as a draft
model does (``DraftChooser``: the request's logits processors; under sampling the request's noise),
so everything the arbiter, grammar and verification do with a draft model holds for it.

A head belongs to one target: its ``head.json`` names the target's fingerprint
(``target_fingerprint``), and loading it for another model is refused with the reason.

Shape letters: T positions, H hidden size, N draft vocabulary, V the target's vocabulary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelLoadError
from ..params import GenerationParams
from ..passes.arch import head_dim
from .base import Draft
from .model import DraftChooser

__all__ = [
    "HEAD_PREFIX",
    "DraftHead",
    "HeadConfig",
    "HeadDrafter",
    "load_head",
    "shipped_head",
    "target_fingerprint",
]

HEAD_PREFIX = "head:"
CONFIG_FILE = "head.json"
WEIGHTS_FILE = "head.safetensors"
FORMAT = "agentspec-draft-head/1"
SHIPPED = Path(__file__).resolve().parent.parent / "heads"  # heads that ship with agentspec

KV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [kv_heads, positions, head_dim] each


def target_fingerprint(target: Any) -> str:
    """Identifies a target model's weights (``target``: a ``LoadedModel``), whatever dtype it was
    loaded in: a hash of its shape and of every 64th row of its input embedding, rounded to bfloat16."""
    config = target.module.config
    shape = {key: getattr(config, key, None) for key in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")}
    rows = target.input_rows(torch.arange(0, target.module.get_input_embeddings().weight.shape[0], 64))
    rows = rows.to(device="cpu", dtype=torch.bfloat16)
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode())
    digest.update(rows.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:24]


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """What ``head.json`` holds: the shape of the head and the target it belongs to."""

    target: str  # target_fingerprint of the model it was trained on
    target_name: str  # for messages only
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab: int  # N
    rms_eps: float = 1e-5
    training: dict[str, Any] = dataclasses.field(default_factory=dict)  # how it was trained and what it measured
    format: str = FORMAT

    @classmethod
    def for_target(cls, target: Any, name: str, draft_vocab: int, intermediate_size: int | None = None) -> "HeadConfig":
        config = target.module.config
        heads = config.num_attention_heads
        return cls(
            target=target_fingerprint(target),
            target_name=name,
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim(config),
            intermediate_size=intermediate_size or config.intermediate_size // 2,
            draft_vocab=draft_vocab,
            rms_eps=getattr(config, "rms_norm_eps", 1e-5),
        )


class DraftHead(nn.Module):
    """The head's trainable layers, plus the target's frozen embedding, rotary embedding and LM-head
    rows of the draft vocabulary (held, never copied into its state dict)."""

    def __init__(self, config: HeadConfig, target: Any, draft_ids: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        h, heads, kv, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.norm_feature = nn.RMSNorm(h, eps=config.rms_eps)
        self.norm_embedding = nn.RMSNorm(h, eps=config.rms_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.norm_attention = nn.RMSNorm(h, eps=config.rms_eps)
        self.qkv = nn.Linear(h, (heads + 2 * kv) * d, bias=False)
        self.o = nn.Linear(heads * d, h, bias=False)
        self.norm_mlp = nn.RMSNorm(h, eps=config.rms_eps)
        self.gate_up = nn.Linear(h, 2 * config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, h, bias=False)
        self.norm_out = nn.RMSNorm(h, eps=config.rms_eps)
        self.register_buffer("draft_ids", draft_ids.to(torch.long), persistent=True)
        # The target's, frozen and shared: a plain attribute keeps them out of parameters and state.
        self.target = _TargetParts(target, self.draft_ids)

    @property
    def draft_vocab(self) -> torch.Tensor:
        """[N] target token ids of the draft vocabulary, most frequent first."""
        return self.draft_ids

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor, past: KV | None = None) -> tuple[torch.Tensor, KV]:
        """Predicted features [T, H] after each (feature, next token) pair and the KV cache extended
        by them. ``features`` [T, H] at positions p, ``next_tokens`` [T] the tokens at p + 1,
        ``positions`` [T] = p + 1; ``past`` the keys/values of earlier pairs (all before these)."""
        config = self.config
        heads, kv_heads, d = config.num_heads, config.num_kv_heads, config.head_dim
        tokens = features.shape[0]
        embedded = self.target.embed(next_tokens)
        x = self.fc(torch.cat([self.norm_feature(features), self.norm_embedding(embedded)], dim=-1))
        qkv = self.qkv(self.norm_attention(x))
        q = qkv[:, : heads * d].view(tokens, heads, d)
        k = qkv[:, heads * d : (heads + kv_heads) * d].view(tokens, kv_heads, d)
        v = qkv[:, (heads + kv_heads) * d :].view(tokens, kv_heads, d)
        cos, sin = self.target.rotary(x[None], positions[None])
        cos, sin = cos[0, :, None, :].to(x.dtype), sin[0, :, None, :].to(x.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, T, d]
        if past is not None:
            keys, values = torch.cat([past[0], keys], dim=1), torch.cat([past[1], values], dim=1)
        length = keys.shape[1]
        mask = None
        if tokens > 1:  # query i (at length - tokens + i) sees keys up to itself
            mask = torch.arange(length, device=x.device)[None, :] <= torch.arange(length - tokens, length, device=x.device)[:, None]
        attention = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, enable_gqa=True)
        x = x + self.o(attention[0].transpose(0, 1).reshape(tokens, heads * d))
        gate, up = self.gate_up(self.norm_mlp(x)).chunk(2, dim=-1)
        x = x + self.down(F.silu(gate) * up)
        return self.norm_out(x), (keys, values)

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """[T, N] draft-vocabulary logits of predicted (or true) features [T, H]."""
        return predicted @ self.target.lm_rows.T

    def save(self, folder: str | Path) -> Path:
        """Write ``head.safetensors`` (bfloat16) and ``head.json`` into ``folder``."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {name: (t.detach().to("cpu", torch.bfloat16) if t.is_floating_point() else t.detach().cpu()).contiguous() for name, t in self.state_dict().items()}
        save_file(state, str(folder / WEIGHTS_FILE))
        (folder / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(self.config), indent=2) + "\n")
        return folder


class _TargetParts:
    """The target's embedding (rows read as the head needs them), rotary embedding and LM-head rows
    of the draft vocabulary. ``dtype``: what the head computes in (the target's, unless changed)."""

    def __init__(self, target: Any, draft_ids: torch.Tensor) -> None:
        self.rows, self.dtype = target.input_rows, target.dtype
        self.rotary = target.module.model.rotary_emb
        self.lm_rows = target.output_rows(draft_ids)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids).to(self.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# -- loading ----------------------------------------------------------------------------------------


def read_config(folder: str | Path) -> HeadConfig:
    """A head folder's ``head.json``; ``ModelLoadError`` if it is missing or not a head's."""
    path = Path(folder) / CONFIG_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"No draft head at {folder}: {path} does not exist. Train one with `agentspec train-draft --out {folder}`.") from None
    except ValueError as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({exc}).") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ModelLoadError(f"{path} is not an agentspec draft head (format {FORMAT!r}).")
    fields = {f.name for f in dataclasses.fields(HeadConfig)}
    return HeadConfig(**{key: value for key, value in data.items() if key in fields})


def load_head(folder: str | Path, target: Any, name: str = "the loaded model") -> DraftHead:
    """The head in ``folder`` on ``target``'s device and dtype; ``ModelLoadError`` if it was trained
    for another model."""
    from safetensors.torch import load_file

    config = read_config(folder)
    fingerprint = target_fingerprint(target)
    if config.target != fingerprint:
        raise ModelLoadError(
            f"The draft head at {folder} was trained for {config.target_name} (fingerprint {config.target}), "
            f"not for {name} (fingerprint {fingerprint}). Train a head for this model with "
            "`agentspec train-draft --model ... --out DIR`, or drop `draft=`."
        )
    state = load_file(str(Path(folder) / WEIGHTS_FILE))
    device, dtype = target.device, target.dtype
    head = DraftHead(config, target, state["draft_ids"].to(device))
    head.load_state_dict({k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in state.items()})
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


def shipped_head(target: Any) -> Path | None:
    """The folder of a head shipped with agentspec for ``target``, if there is one."""
    if not SHIPPED.is_dir():
        return None
    fingerprint = None
    for config in sorted(SHIPPED.glob(f"*/{CONFIG_FILE}")):
        try:
            trained_for = json.loads(config.read_text()).get("target")
        except ValueError:
            continue
        fingerprint = fingerprint or target_fingerprint(target)
        if trained_for == fingerprint:
            return config.parent
    return None


# -- drafting ---------------------------------------------------------------------------------------


class HeadDrafter:
    """Drafts with a ``DraftHead`` on the target's features (``source="model"``).

    The engine calls ``observe_features(start, features)`` with the target's features [n, H] of the
    committed positions start..start+n-1 after each pass (``wants_features``). A propose feeds the
    head the (feature, next token) pairs it has not seen — all committed — then drafts on its own
    predictions; only the committed pairs stay in its cache.

    max_tokens: most tokens drafted per step; min_confidence: stop once the head's probability of
    its own token falls below it (after the first). Neither changes what is committed.
    """

    source = "model"
    wants_features = True

    def __init__(self, head: DraftHead, params: GenerationParams, vocab_size: int, *, max_tokens: int = 8, min_confidence: float = 0.3) -> None:
        self.head, self.params, self.vocab_size = head, params, vocab_size
        self.max_tokens, self.min_confidence = max_tokens, min_confidence
        self.device = head.draft_ids.device
        self.reset(())

    def reset(self, prompt: Sequence[int]) -> None:
        self.chooser = DraftChooser(self.params, self.vocab_size, self.device, prompt)
        self.first: int | None = None  # position of the first feature received
        self.held = 0  # features received: positions first .. first + held - 1
        self.pending: list[torch.Tensor] = []  # received, not yet fed: positions first + fed ..
        self.cache: KV | None = None  # keys/values of the pairs fed so far (all committed)
        self.fed = 0  # pairs fed: (f_p, x_{p+1}) for p = first .. first + fed - 1
        self.last: torch.Tensor | None = None  # [1, H] the prediction after the last pair fed

    @property
    def tokens(self) -> list[int]:
        """The committed tokens: the prompt and the output observed so far."""
        return self.chooser.tokens

    def observe_features(self, start: int, features: torch.Tensor) -> None:
        """The target's features [n, H] of committed positions ``start`` .. ``start + n - 1``."""
        if not len(features):
            return
        if self.first is None or start != self.first + self.held:
            # The first features, or not the ones that follow (positions the prefix cache supplied,
            # or recomputed ones): start the head's context over from these.
            self.first, self.held, self.pending, self.cache, self.fed, self.last = start, 0, [], None, 0, None
        self.pending.append(features)
        self.held += len(features)

    def observe(self, committed: Sequence[int]) -> None:
        self.chooser.observe(committed)

    @torch.inference_mode()
    def propose(self, k: int, after: Sequence[int] = ()) -> Draft:
        k = min(k, self.max_tokens)
        tokens = self.tokens
        if k <= 0 or self.first is None:
            return Draft([], self.source)
        # Pairs (f_p, x_{p+1}) up to the newest committed token: the features of every committed
        # position but the newest one (its feature comes from the next pass).
        pairs = len(tokens) - 1 - self.first
        if pairs <= 0 or self.held < pairs:
            return Draft([], self.source)
        if pairs > self.fed:
            pending = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
            new, rest = pending[: pairs - self.fed], pending[pairs - self.fed :]
            self.pending = [rest] if len(rest) else []
            start = self.first + self.fed
            predicted, self.cache = self._run(new, tokens[start + 1 : self.first + pairs + 1], start + 1, self.cache)
            self.fed, self.last = pairs, predicted[-1:]
        assert self.last is not None
        position = self.first + pairs + 1  # where the next pair goes: the token the last prediction drafts
        predicted, cache = self.last, self.cache

        def feed(token: int) -> torch.Tensor:  # the head run on one more token: its new prediction
            nonlocal predicted, cache, position
            predicted, cache = self._run(predicted, [token], position, cache)
            position += 1
            return predicted[-1]

        for token in after:  # the grammar's tokens: run through, not chosen
            feed(token)
        first = self._vocab_logits(predicted[-1])
        return self.chooser.draft(first, k, after, self.min_confidence, lambda token: self._vocab_logits(feed(token)), self.source)

    # -- helpers ------------------------------------------------------------------------------------

    def _run(self, features: torch.Tensor, next_tokens: list[int], position: int, cache: KV | None) -> tuple[torch.Tensor, KV]:
        ids = torch.tensor(next_tokens, device=self.device)
        positions = torch.arange(position, position + len(next_tokens), device=self.device)
        return self.head(features.to(self.head.target.lm_rows.dtype), ids, positions, cache)

    def _vocab_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """[V] target-vocabulary logits of one prediction: the draft vocabulary's, -inf elsewhere."""
        logits = torch.full((self.vocab_size,), float("-inf"), device=self.device)
        ids = self.head.draft_ids
        keep = ids < self.vocab_size
        logits[ids[keep]] = self.head.logits(predicted[None])[0][keep].float()
        return logits
