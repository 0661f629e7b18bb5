"""Attention masks: builders, combination, and the one conversion to an additive bias.

Convention everywhere in attn_course: a mask is a **boolean tensor, True = may attend**.
It broadcasts against the score matrix of shape ``(..., L, S)`` (L query positions,
S key positions). This is the convention of
``torch.nn.functional.scaled_dot_product_attention``. It is the *opposite* of
``torch.nn.MultiheadAttention``, whose ``attn_mask`` / ``key_padding_mask`` use
True = NOT allowed; convert those with :func:`from_blocked_mask`.

Taught in lesson 03 (masking).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._checks import broadcast_shapes, check_positive_int

__all__ = [
    "causal_mask",
    "padding_mask",
    "combine_masks",
    "with_causal",
    "mask_to_bias",
    "from_blocked_mask",
    "to_blocked_mask",
    "fully_masked_rows",
]


def causal_mask(L: int, S: int | None = None, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean ``(L, S)`` mask where query ``i`` may attend to keys ``j <= i``.

    Top-left aligned, exactly like ``is_causal=True`` in PyTorch's
    ``scaled_dot_product_attention``: row ``i`` sees keys ``0..i`` whatever ``S`` is.
    (With a KV cache, where the queries are the *last* L of S positions, you want a
    bottom-right aligned mask instead: ``causal_mask(S)[-L:]``.)
    """
    L = check_positive_int("L", L)
    S = L if S is None else check_positive_int("S", S)
    ones = torch.ones(L, S, dtype=torch.bool, device=device)  # (L, S)
    return torch.tril(ones)  # (L, S), True on and below the main diagonal


def padding_mask(
    lengths: torch.Tensor | Sequence[int],
    max_len: int | None = None,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Boolean ``(B, S)`` mask, True where a position holds a real (non-padding) token.

    ``lengths[b]`` is the number of real tokens in sequence ``b``; the real tokens come
    first. ``max_len`` defaults to ``max(lengths)``. To use it as an attention mask for
    scores of shape ``(B, H, L, S)``, add the head and query axes:
    ``padding_mask(lengths)[:, None, None, :]`` -> ``(B, 1, 1, S)``.
    """
    if not isinstance(lengths, torch.Tensor):
        lengths = torch.as_tensor(list(lengths), device=device)
    elif device is not None:
        lengths = lengths.to(device)
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D with shape (B,), got shape {tuple(lengths.shape)}")
    if lengths.numel() == 0:
        raise ValueError("lengths is empty: expected one length per sequence, shape (B,) with B >= 1")
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise TypeError(f"lengths must hold integers, got dtype {lengths.dtype}")
    if (lengths < 0).any():
        raise ValueError(f"lengths must be >= 0, got {lengths.tolist()}")
    longest = int(lengths.max())
    if max_len is None:
        max_len = max(longest, 1)
    max_len = check_positive_int("max_len", max_len)
    if longest > max_len:
        raise ValueError(f"a length ({longest}) exceeds max_len ({max_len})")
    positions = torch.arange(max_len, device=lengths.device)  # (S,)
    return positions[None, :] < lengths[:, None]  # (B, S)


def combine_masks(*masks: torch.Tensor | None) -> torch.Tensor | None:
    """Logical AND of boolean masks, broadcast together (``None`` entries are skipped).

    A position may be attended only if every mask allows it. Returns ``None`` when all
    inputs are ``None``.
    """
    result = None
    for index, mask in enumerate(masks):
        if mask is None:
            continue
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise TypeError(f"combine_masks expects boolean tensors (True = may attend); argument {index} is {got}")
        if result is None:
            result = mask
            continue
        try:
            broadcast_shapes(result.shape, mask.shape)
        except RuntimeError:
            raise ValueError(
                f"cannot combine masks of shapes {tuple(result.shape)} and {tuple(mask.shape)}: they do not "
                "broadcast. A (B, S) padding mask needs [:, None, None, :] to become (B, 1, 1, S)."
            ) from None
        result = result & mask
    return result


def with_causal(
    mask: torch.Tensor | None, L: int, S: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """``mask`` with the top-left causal mask ``causal_mask(L, S)`` applied too: what ``is_causal=True`` adds.

    A boolean mask (True = may attend) is ANDed with it; an additive float mask gets ``-inf``
    at future keys; ``None`` gives the causal mask alone. The result broadcasts to ``(..., L, S)``.
    """
    causal = causal_mask(L, S, device=device)  # (L, S)
    if mask is None:
        return causal
    if mask.dtype == torch.bool:
        return mask & causal  # (..., L, S)
    return mask.masked_fill(~causal, float("-inf"))  # (..., L, S), additive: future set to -inf


def mask_to_bias(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Turn a boolean mask (True = may attend) into an additive bias of ``dtype``.

    Allowed positions get 0 and blocked positions get ``-inf``. ``-inf`` is exact in float16,
    bfloat16, float32 and float64 (unlike ``-1e9``, which does not fit in float16; float8
    ``e4m3fn`` has no infinity, so mask in the compute dtype, as lesson 03 shows), and
    ``softmax(score + bias)`` gives exactly 0 weight to blocked keys. A row with *no*
    allowed key becomes all ``-inf``; :func:`attn_course.scaled_dot_product_attention`
    detects such rows and returns zeros for them instead of NaN.
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"mask_to_bias expects a boolean mask (True = may attend), got {got}")
    if not dtype.is_floating_point:
        raise TypeError(f"bias dtype must be floating point, got {dtype}")
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill(~mask, float("-inf"))


def from_blocked_mask(blocked: torch.Tensor) -> torch.Tensor:
    """Convert an ``nn.MultiheadAttention``-style mask to the attn_course convention.

    ``nn.MultiheadAttention``'s ``attn_mask`` and ``key_padding_mask`` use True = NOT
    allowed (blocked); attn_course uses True = may attend. Boolean masks are inverted; a
    float mask is already additive and is returned unchanged.
    """
    if not isinstance(blocked, torch.Tensor):
        raise TypeError(f"expected a tensor, got {type(blocked).__name__}")
    if blocked.dtype == torch.bool:
        return ~blocked
    if blocked.dtype.is_floating_point:
        return blocked
    raise TypeError(f"expected a bool (True = blocked) or float (additive) mask, got dtype {blocked.dtype}")


def to_blocked_mask(mask: torch.Tensor) -> torch.Tensor:
    """Convert an attn_course mask (True = may attend) to ``nn.MultiheadAttention``'s (True = blocked)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"to_blocked_mask expects a boolean mask (True = may attend), got {got}")
    return ~mask


def fully_masked_rows(mask: torch.Tensor) -> torch.Tensor:
    """Boolean ``(..., L, 1)``: True for query rows that may attend to no key at all.

    Works for boolean masks (no True in the row) and additive float masks (every entry
    ``-inf``).
    """
    if mask.dtype == torch.bool:
        return ~mask.any(dim=-1, keepdim=True)
    return torch.isneginf(mask).all(dim=-1, keepdim=True)
