"""Synthetic token tasks, generated in code from a seed (nothing is downloaded).

* ``lookback_task``: at every position, name the tokens a fixed number of steps back
  (e.g. 1 and 3 steps): two different relations to fetch at once. A model with several heads
  learns them in different heads -- the demo of lesson 02 (multi-head attention).
* ``padded_batch``: a batch of random sequences of different lengths, padded, with its
  padding mask -- the demo input of lesson 03 (masking).
* ``token_labels``: letters for token ids, for heatmap tick labels.

Tokens are ``torch.long`` ids. Shape legend: N sequences, L length, B batch, S key length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._checks import check_int
from ..masks import padding_mask

__all__ = ["lookback_task", "decode_lookback", "padded_batch", "token_labels", "PAD"]

PAD = 0  # the padding id used by ``padded_batch``; real tokens are 1 .. vocab_size - 1
_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def lookback_task(
    num_sequences: int,
    *,
    length: int = 16,
    vocab_size: int = 8,
    offsets: Sequence[int] = (1, 3),
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random sequences and, at each position, the tokens ``offsets`` steps back as one class.

    With ``offsets=(1, 3)`` the target at position ``t`` encodes the pair
    ``(x[t-1], x[t-3])`` as the class ``x[t-1] * vocab_size + x[t-3]`` (``vocab_size**2``
    classes). Steps that would go before the start read the first token instead
    (``x[max(t - k, 0)]``), so every position has a target.

    Two relations at once: one head attends to a single weighted mix of positions, so the
    natural solution gives each offset its own head (lesson 02 measures that a trained
    multi-head model does). A single head is not strictly unable: with unequal weights on
    ``t-1`` and ``t-3`` its average still determines the ordered pair, but it must be
    untangled by the read-out.

    Returns:
        ``(inputs, targets)``, both ``(num_sequences, length)`` long tensors; targets lie in
        ``[0, vocab_size ** len(offsets))``. Decode them with ``decode_lookback``.
    """
    check_int("num_sequences", num_sequences, minimum=1)
    check_int("length", length, minimum=1)
    check_int("vocab_size", vocab_size, minimum=2)
    offsets = tuple(offsets)
    if not offsets:
        raise ValueError("offsets is empty: give at least one look-back step, e.g. (1, 3)")
    for k in offsets:
        check_int("each offset", k, minimum=1)
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, vocab_size, (num_sequences, length), generator=generator)  # (N, L)
    positions = torch.arange(length)  # (L,)
    targets = torch.zeros_like(inputs)  # (N, L)
    for k in offsets:  # mixed-radix code: the first offset is the most significant digit
        source = (positions - k).clamp_min(0)  # (L,) position read for this offset
        targets = targets * vocab_size + inputs[:, source]  # (N, L)
    return inputs, targets


def decode_lookback(targets: torch.Tensor, *, vocab_size: int = 8, num_offsets: int = 2) -> torch.Tensor:
    """Undo the class code of ``lookback_task``: ``(...)`` -> ``(..., num_offsets)`` token ids."""
    check_int("vocab_size", vocab_size, minimum=2)
    check_int("num_offsets", num_offsets, minimum=1)
    digits = []
    rest = targets
    for _ in range(num_offsets):
        digits.append(rest % vocab_size)
        rest = rest // vocab_size
    return torch.stack(digits[::-1], dim=-1)  # (..., num_offsets), first offset first


def padded_batch(
    lengths: Sequence[int] | torch.Tensor,
    *,
    vocab_size: int = 10,
    max_len: int | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random sequences of the given lengths, right-padded with ``PAD`` (0).

    Real tokens are drawn from ``1 .. vocab_size - 1`` so a real token never looks like
    padding. Returns ``(tokens, keep)``: tokens ``(B, S)`` long and the padding mask ``(B, S)``,
    True at real tokens (this course's convention: True = may attend), built with
    ``attn_course.padding_mask``.
    """
    check_int("vocab_size", vocab_size, minimum=2)
    keep = padding_mask(lengths, max_len)  # (B, S), validates lengths and max_len
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab_size, keep.shape, generator=generator)  # (B, S)
    return tokens.masked_fill(~keep, PAD), keep


def token_labels(tokens: torch.Tensor | Sequence[int], *, pad: int | None = None) -> list[str]:
    """Letters for token ids (0 -> "A", 1 -> "B", ...; ids past 25 as numbers); ``pad`` ids as "·"."""
    ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    if ids and isinstance(ids[0], list):
        raise ValueError("token_labels takes one sequence (L,), not a batch; pick one row first")
    labels = []
    for i in ids:
        i = int(i)
        if pad is not None and i == pad:
            labels.append("·")
        elif 0 <= i < len(_ALPHABET):
            labels.append(_ALPHABET[i])
        else:
            labels.append(str(i))
    return labels
