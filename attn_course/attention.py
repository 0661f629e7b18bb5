"""Scaled dot-product attention: the explicit path that teaches, and the fused path.

    Attention(Q, K, V) = softmax(Q K^T * scale + mask) V,   scale = 1 / sqrt(D)

Shapes: q ``(..., L, D)``, k ``(..., S, D)``, v ``(..., S, Dv)`` -> out ``(..., L, Dv)``,
weights ``(..., L, S)``. Mask convention: bool, True = may attend (see ``masks``).

Two paths compute the same thing (tests hold them equal):

* the **explicit** path writes out every step (scores, mask, stable softmax, weighted sum)
  and is the one lessons 01 and 03 build; it is used whenever the weights are requested;
* the **fused** path calls ``torch.nn.functional.scaled_dot_product_attention``, which
  never stores the ``(L, S)`` weight matrix and is several times faster.

Edge cases, on both paths:

* a query row that may attend to no key gives a zero output row and zero weights, with
  zero (finite) gradients -- never NaN;
* float16 / bfloat16 inputs get their softmax computed in float32 on the explicit path,
  so huge logits stay finite; no ``-1e9`` literal is used anywhere (it overflows fp16).

Taught in lessons 01 (scaled dot-product attention) and 03 (masking).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._checks import broadcast_shapes, check_mask, check_qkv
from .masks import fully_masked_rows, with_causal

__all__ = ["scaled_dot_product_attention", "stable_softmax"]


def stable_softmax(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax that subtracts the row maximum first, and gives 0 (not NaN) for all ``-inf`` rows.

    ``exp(x - max)`` never overflows because every exponent is <= 0. A row whose entries
    are all ``-inf`` (nothing to attend to) has no finite maximum; we subtract 0 there, so
    every ``exp`` is 0 and the row of weights is 0.
    """
    # Softmax does not depend on the shift, so the max needs no gradient (and no autograd node:
    # detaching first means nothing is saved for a backward pass that would never use it).
    row_max = scores.detach().amax(dim=dim, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exps = torch.exp(scores - row_max)
    total = exps.sum(dim=dim, keepdim=True)
    # total is >= 1 in any row with an allowed key; 0 only in empty rows, where exps is 0 too.
    return exps / total.clamp_min(torch.finfo(total.dtype).tiny)


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    fused: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention over the last two dims.

    Args:
        q: queries ``(..., L, D)``.
        k: keys ``(..., S, D)``.
        v: values ``(..., S, Dv)``.
        mask: optional, broadcastable to ``(..., L, S)``. Bool: True = may attend (the
            opposite of ``nn.MultiheadAttention``; see ``from_blocked_mask``). Float: added
            to the scores (0 = keep, ``-inf`` = block).
        is_causal: also block keys after the query, top-left aligned (query ``i`` sees
            keys ``0..i``) exactly as in PyTorch. Unlike PyTorch, it may be combined with
            ``mask``: a key must be allowed by both.
        scale: multiplies ``q @ k^T``; default ``1 / sqrt(D)``.
        dropout_p: probability of zeroing a weight (pass 0.0 at evaluation time).
        need_weights: also return the attention weights ``(..., L, S)`` (before dropout).
        fused: ``True`` forces PyTorch's fused kernel (cannot return weights), ``False``
            forces the explicit path, ``None`` picks fused unless weights are requested.

    Returns:
        ``out`` of shape ``(..., L, Dv)``, or ``(out, weights)`` if ``need_weights``.
    """
    L, S, batch_shape = check_qkv(q, k, v)
    target = (*batch_shape, L, S)
    if mask is not None:
        mask = check_mask(mask, target, device=q.device)
        if mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if fused is None:
        fused = not need_weights
    if fused and need_weights:
        raise ValueError("the fused kernel never forms the weights: use fused=False (or None) with need_weights=True")

    allowed = with_causal(mask, L, S, device=q.device) if is_causal else mask  # (..., L, S) or None
    if fused:
        return _fused_attention(q, k, v, allowed, scale=scale, dropout_p=dropout_p)
    out, weights = _explicit_attention(q, k, v, allowed, scale=scale, dropout_p=dropout_p)
    return (out, weights) if need_weights else out


def _explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    *,
    scale: float,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The lesson-01 recipe, step by step. Returns ``(out, weights)``."""
    # Low-precision inputs: form the scores and the softmax in float32, so that large
    # logits (fp16 tops out at 65504) cannot overflow. Autocast is paused for this matmul,
    # or it would cast the float32 operands straight back down.
    compute_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    with torch.autocast(device_type=q.device.type, enabled=False):
        scores = torch.matmul(q.to(compute_dtype), k.to(compute_dtype).transpose(-2, -1)) * scale  # (..., L, S)
    if allowed is not None:
        if allowed.dtype == torch.bool:
            scores = scores.masked_fill(~allowed, float("-inf"))  # (..., L, S)
        else:
            scores = scores + allowed.to(compute_dtype)  # (..., L, S)
    weights = stable_softmax(scores, dim=-1).to(q.dtype)  # (..., L, S), rows sum to 1 (or 0 if empty)
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    out = torch.matmul(dropped, v)  # (..., L, Dv)
    return out, weights


def _fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    *,
    scale: float,
    dropout_p: float,
) -> torch.Tensor:
    """PyTorch's kernel, with empty rows made safe on every backend."""
    batch_shape = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    # Not every backend broadcasts batch dims (e.g. one K/V head shared by all query heads).
    q = q.expand(*batch_shape, *q.shape[-2:])  # (..., L, D), a view
    k = k.expand(*batch_shape, *k.shape[-2:])  # (..., S, D), a view
    v = v.expand(*batch_shape, *v.shape[-2:])  # (..., S, Dv), a view
    if allowed is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale)
    # Some backends return NaN (and NaN gradients) for a row with nothing to attend to.
    # Let such rows attend everywhere inside the kernel, then zero them: finite everywhere.
    empty = fully_masked_rows(allowed)  # (..., L, 1)
    if allowed.dtype == torch.bool:
        safe = allowed | empty  # (..., L, S)
    else:
        safe = allowed.masked_fill(empty, 0.0)  # (..., L, S)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe, dropout_p=dropout_p, scale=scale)  # (..., L, Dv)
    return out.masked_fill(empty, 0.0)
