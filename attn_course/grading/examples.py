"""Wrong first attempts that the lessons hand to the grader, kept out of the lessons' own cells.

A lesson shows what the grader says about a realistic first attempt, so that learners know what
feedback looks like before they start. Some realistic attempts are one keystroke away from an
exercise's answer: lesson 00's causal mask "shifted by one" becomes exercise 03's answer once its
``+ 1`` is deleted, and lesson 03's attention that zeroes blocked weights after the softmax becomes
exercise 01's answer once its ``* mask`` is deleted. Those lessons import the attempt from here,
describe its bug in words and show the grader's report, without printing the code.

Taught in lesson 00 (how exercises and grading work) and lesson 03 (masking).
"""

from __future__ import annotations

import math

import torch

__all__ = ["causal_mask_shifted_by_one", "masked_attention_zeroing_after_softmax"]


def causal_mask_shifted_by_one(L: int, S: int) -> torch.Tensor:
    """A causal mask ``(L, S)`` with the classic off-by-one: query ``i`` also sees key ``i + 1``."""
    return torch.ones(L, S, dtype=torch.bool).tril(diagonal=1)  # (L, S), one diagonal too many


def masked_attention_zeroing_after_softmax(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Attention that ignores the mask in the softmax and zeroes the blocked weights afterwards.

    Blocked keys do get weight 0, but the remaining weights of a row no longer sum to 1 (and a
    row with nothing to attend to gets zeros by accident, not by design).
    """
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)  # (..., L, S)
    return (weights * mask) @ v  # (..., L, Dv): no renormalisation after the zeroing
