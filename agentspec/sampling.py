"""Seeded sampling keyed by output position: the same seed gives the same tokens, however drafted.

A sampled request's randomness is a function of ``(seed, output position)`` and nothing else: not
of the draft lengths, the draft sources, the batch, the caches or the device. At output position n
the token is the exponential race (the Gumbel-max trick in another form)

    token = argmax_i  p_i / E_i,    E_i = -log u_i,    u_i = hash(seed, n, i) in (0, 1)

which is distributed exactly as p (the target's processed distribution; a token of probability 0
never wins). Plain decoding draws every token this way. Speculative verification computes the same
draw at every verified row and accepts a draft token iff it equals the draw there, so each committed
token is the one plain decoding would have drawn at that position: with deterministic drafts
(grammar, n-gram, suffix) and with a draft model that samples its own distribution with the same
noise (coupled sampling), the output is exactly plain sampling's with the same seed.

The noise is a counter-based hash computed with integer tensor operations (no random generator, no
state), so every device computes the same hash words: 32-bit words in int32 lanes, where additions
and products wrap modulo 2**32 (two's complement) and right shifts are masked to act as logical
shifts. ``reference_noise`` is the same hash on Python integers, one element at a time. (The float32
``-log`` and division after it may round differently on another device, which changes a draw only
where two tokens' ratios tie to within that rounding, as rare as a greedy argmax near-tie.)

Shape letters: T rows (positions), V vocabulary.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence

import torch

__all__ = ["fresh_seed", "position_keys", "position_noise", "reference_mix32", "reference_noise", "sample"]

MASK32 = 0xFFFF_FFFF
MASK64 = 0xFFFF_FFFF_FFFF_FFFF
MULTIPLIERS = (0x7FEB_352D, 0x68E3_1DA5)  # odd, below 2**31 (int32 scalars)
TOKEN_MULTIPLIER = 0x61C8_8647  # odd: token ids to distinct words before mixing
UNIFORM_BITS = 23  # (h + 0.5) / 2**23 needs 24 significant bits: exact in float32, strictly inside (0, 1)

_vocab_words: dict[tuple[int, str], torch.Tensor] = {}


def fresh_seed() -> int:
    """A random seed for a request sent without one (recorded, so the run can be reproduced)."""
    return secrets.randbits(63)


def splitmix64(x: int) -> int:
    """SplitMix64's output function: a bijective 64-bit mix (Python ints, for the few per-row keys)."""
    x = (x + 0x9E37_79B9_7F4A_7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58_476D_1CE4_E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D0_49BB_1331_11EB) & MASK64
    return x ^ (x >> 31)


def position_keys(seed: int, positions: Sequence[int]) -> list[int]:
    """One 32-bit key per output position of the request sampled with ``seed``, as a signed int32
    (the lanes' representation of the same 32 bits)."""
    base = splitmix64(seed)
    return [_signed32(splitmix64(base ^ position) & MASK32) for position in positions]


def _signed32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift, multiply, twice) on int32 lanes."""
    for multiplier in MULTIPLIERS:
        x = (x ^ ((x >> 16) & 0xFFFF)) * multiplier
    return x ^ ((x >> 16) & 0xFFFF)


def _words(vocab: int, device: torch.device) -> torch.Tensor:
    """[V] a distinct 32-bit word per token id (cached per vocabulary size and device)."""
    key = (vocab, str(device))
    if key not in _vocab_words:
        _vocab_words[key] = _mix32(torch.arange(vocab, dtype=torch.int32, device=device) * TOKEN_MULTIPLIER)
    return _vocab_words[key]


def position_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[T] int32 keys → [T, V] float32 Exp(1) draws, one per (position, token)."""
    words = _mix32(keys.to(torch.int32).unsqueeze(-1) + _words(vocab, keys.device))
    bits = (words >> (32 - UNIFORM_BITS)) & ((1 << UNIFORM_BITS) - 1)
    return -torch.log((bits.to(torch.float32) + 0.5) * 2.0**-UNIFORM_BITS)


def reference_mix32(word: int) -> int:
    """``_mix32`` on one Python integer below 2**32 (part of the hash's specification)."""
    for multiplier in MULTIPLIERS:
        word = ((word ^ (word >> 16)) * multiplier) & MASK32
    return word ^ (word >> 16)


def reference_noise(key: int, token: int) -> float:
    """``position_noise`` for one (key, token) on Python integers: the specification of the hash."""
    mix = reference_mix32
    word = mix(((key & MASK32) + mix(token * TOKEN_MULTIPLIER & MASK32)) & MASK32)
    uniform = ((word >> (32 - UNIFORM_BITS)) + 0.5) / 2**UNIFORM_BITS
    return -math.log(uniform)


def sample(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[T, V] distributions, [T] keys → [T] tokens, each distributed as its row (exponential race)."""
    return (probs.float() / position_noise(keys, probs.shape[-1])).argmax(dim=-1)
