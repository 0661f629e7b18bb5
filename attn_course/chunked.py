"""Chunked, memory-efficient attention: from query chunking to the online softmax.

Dense attention forms the whole ``(..., L, S)`` score matrix. Both functions here give the
same result (exactly, up to rounding) while holding only one chunk of scores at a time:

* :func:`query_chunked_attention` -- the stepping stone, the source article's
  ``MemoryEfficientAttention`` done right. It splits the *queries* into chunks and runs
  ordinary attention for each chunk against *all* keys.

  - Saves: the activations, i.e. the scores and weights held at once shrink from
    ``(L, S)`` to ``(chunk, S)`` per batch and head, in a forward pass without autograd.
  - Does not save: every chunk still reads all ``S`` keys, so its working set still grows
    with ``S`` (an ``(chunk, S)`` matrix); the FLOPs are the same as dense attention; and
    when autograd records the forward pass it keeps every chunk's ``(chunk, S)`` weights
    for the backward pass, so training memory is still ``O(L S)``.
  - The article's version also wrote into ``torch.zeros_like(V)``, which has S rows, not L:
    with fewer queries than keys it silently returns S rows (the extra ones zero), with more
    it raises. It had no mask and no causal option, and hard-coded the chunk size. (Its
    in-place writes into the output are fine for autograd: the gradients are exact.)

* :func:`chunked_attention` -- queries *and* keys in chunks, combined with the **online
  softmax** (Milakov & Gimelshein 2018; Rabe & Staats 2021, "Self-attention does not need
  O(n^2) memory"; Dao et al. 2022, FlashAttention). For each query row it keeps three running
  statistics while it walks over the key chunks:

  - ``m``: the largest score seen so far (the softmax shift),
  - ``l``: the sum of ``exp(score - m)`` so far,
  - ``acc``: the sum of ``exp(score - m) * v`` so far.

  When a new chunk raises the maximum from ``m`` to ``m'``, the old ``l`` and ``acc`` are
  rescaled by ``exp(m - m')``; at the end ``out = acc / l``. Memory is ``O(chunk^2)`` per
  batch and head instead of ``O(L S)``. With ``recompute=True`` (the default) a custom
  ``torch.autograd.Function`` stores only q, k, v, the output and one log-sum-exp per row,
  and its backward pass recomputes each chunk's weights -- FlashAttention's backward, in
  PyTorch, so training memory is ``O(L + S)`` beyond the inputs too.

The three building blocks of the recurrence are public (:class:`PartialAttention`,
:func:`partial_attention`, :func:`merge_partials`, :func:`finish_partial`) because lesson 07
builds them by hand and :mod:`attn_course.sparse` reuses them to merge its parts.

Shapes: q ``(..., L, D)``, k ``(..., S, D)``, v ``(..., S, Dv)`` -> ``(..., L, Dv)``. Masks
are boolean, True = may attend, broadcastable to ``(..., L, S)``; ``is_causal`` is top-left
aligned as in PyTorch. A row with nothing to attend to gives zeros, never NaN. float16 /
bfloat16 inputs are computed in float32 and cast back.

Taught in lesson 07 (chunked & memory-efficient attention).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from ._checks import check_mask, check_positive_int, check_qkv
from .attention import scaled_dot_product_attention

__all__ = [
    "PartialAttention",
    "partial_attention",
    "merge_partials",
    "finish_partial",
    "log_sum_exp",
    "query_chunked_attention",
    "chunked_attention",
]


class PartialAttention(NamedTuple):
    """Attention over *some* of the keys, kept unnormalised so more keys can be merged in.

    For each query row ``i`` over the keys ``j`` seen so far:

    * ``acc``: ``(..., L, Dv)``, ``sum_j exp(s_ij - m_i) v_j``;
    * ``row_max``: ``(..., L, 1)``, ``m_i = max_j s_ij`` (``-inf`` if no key was allowed);
    * ``row_sum``: ``(..., L, 1)``, ``l_i = sum_j exp(s_ij - m_i)``.

    ``row_max`` carries no gradient: the softmax does not depend on the shift, and
    ``acc / row_sum`` is exact whatever shift was used.
    """

    acc: torch.Tensor
    row_max: torch.Tensor
    row_sum: torch.Tensor


def partial_attention(scores: torch.Tensor, v: torch.Tensor) -> PartialAttention:
    """Start a :class:`PartialAttention` from one chunk of scores.

    Args:
        scores: ``(..., L, C)`` scaled scores of the queries against C keys, with blocked
            positions already set to ``-inf``.
        v: ``(..., C, Dv)`` the values of those keys.
    """
    row_max = scores.amax(dim=-1, keepdim=True).detach()  # (..., L, 1)
    # A row with no allowed key has max -inf; shift it by 0 instead, so exp(-inf) = 0.
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))  # (..., L, 1)
    exps = torch.exp(scores - shift)  # (..., L, C), every exponent <= 0: no overflow
    return PartialAttention(
        acc=torch.matmul(exps, v.to(exps.dtype)),  # (..., L, Dv)
        row_max=row_max,
        row_sum=exps.sum(dim=-1, keepdim=True),  # (..., L, 1)
    )


def merge_partials(first: PartialAttention, second: PartialAttention) -> PartialAttention:
    """Combine two partial results over disjoint sets of keys (the online-softmax step).

    Both are rescaled to the common maximum ``m = max(m1, m2)``: ``acc = acc1 * exp(m1 - m)
    + acc2 * exp(m2 - m)`` and the same for ``row_sum``. Order does not matter. Either argument
    may be a :class:`PartialAttention` or any ``(acc, row_max, row_sum)`` tuple or list.
    """
    (acc1, max1, sum1), (acc2, max2, sum2) = _triple(first, "first"), _triple(second, "second")
    new_max = torch.maximum(max1, max2)  # (..., L, 1)
    # Where both are -inf (no key yet) use 0, so exp(-inf - 0) = 0 instead of exp(nan).
    safe_max = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))  # (..., L, 1)
    first_scale = torch.exp(max1 - safe_max)  # (..., L, 1), in [0, 1]
    second_scale = torch.exp(max2 - safe_max)  # (..., L, 1), in [0, 1]
    return PartialAttention(
        acc=acc1 * first_scale + acc2 * second_scale,  # (..., L, Dv)
        row_max=new_max,
        row_sum=sum1 * first_scale + sum2 * second_scale,  # (..., L, 1)
    )


def _triple(partial, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(acc, row_max, row_sum)`` of a PartialAttention or a plain 3-tuple; TypeError naming what it got."""
    if isinstance(partial, (tuple, list)) and len(partial) == 3 and all(isinstance(t, torch.Tensor) for t in partial):
        return tuple(partial)
    got = type(partial).__name__ + (f" of length {len(partial)}" if isinstance(partial, (tuple, list)) else "")
    raise TypeError(f"merge_partials: {name} must be a PartialAttention or an (acc, row_max, row_sum) tuple of "
                    f"tensors, got a {got}")


def finish_partial(partial: PartialAttention) -> torch.Tensor:
    """``acc / row_sum``: the attention output ``(..., L, Dv)``; rows with no allowed key give 0.

    Empty rows have ``acc = 0`` and ``row_sum = 0``; dividing them by 1 instead of 0 keeps
    the output *and* its gradient finite (a ``clamp`` to a tiny number would give a finite
    output but an overflowing gradient).
    """
    empty = partial.row_sum == 0  # (..., L, 1)
    denominator = torch.where(empty, torch.ones_like(partial.row_sum), partial.row_sum)  # (..., L, 1)
    return partial.acc / denominator  # (..., L, Dv)


def log_sum_exp(partial: PartialAttention) -> torch.Tensor:
    """``m + log(l)`` per row, ``(..., L, 1)``: the log of the softmax denominator; ``-inf`` for empty rows.

    The one statistic per row a recomputing backward pass keeps: the weights of any chunk are then
    ``exp(scores - lse)`` (used by :func:`chunked_attention`'s backward and by ``attn_course.distributed``).
    """
    return torch.where(
        partial.row_sum > 0,
        partial.row_max + torch.log(partial.row_sum.clamp_min(torch.finfo(partial.row_sum.dtype).tiny)),
        torch.full_like(partial.row_sum, float("-inf")),
    )


_log_sum_exp = log_sum_exp  # the old private name; import log_sum_exp instead


# ----------------------------------------------------------------------------------------
# Shared input handling


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float16 / bfloat16 are computed in float32 (exp and long sums overflow or lose digits)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _check_bool_mask(mask: object, target: tuple[int, ...], *, device: torch.device) -> torch.Tensor:
    mask = check_mask(mask, target, device=device)
    if mask.dtype != torch.bool:
        raise TypeError(
            f"chunked attention takes a boolean mask (True = may attend), got dtype {mask.dtype}; "
            "for an additive float mask use attn_course.scaled_dot_product_attention"
        )
    return mask


def _slice_mask(mask: torch.Tensor | None, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor | None:
    """The part of a broadcastable ``(..., L, S)`` mask for queries q0:q1 and keys k0:k1."""
    if mask is None:
        return None
    if mask.shape[-2] != 1:  # a broadcast (size-1) axis is kept whole
        mask = mask[..., q0:q1, :]  # (..., cq, S)
    if mask.shape[-1] != 1:
        mask = mask[..., k0:k1]  # (..., cq, ck)
    return mask


def _chunk_allowed(
    mask: torch.Tensor | None, *, is_causal: bool, q0: int, q1: int, k0: int, k1: int, device: torch.device
) -> torch.Tensor | None:
    """Boolean ``(..., cq, ck)`` of allowed pairs in one chunk: the mask AND top-left causality."""
    allowed = _slice_mask(mask, q0, q1, k0, k1)
    if is_causal and k1 - 1 > q0:  # some key in this chunk lies after some query
        query_pos = torch.arange(q0, q1, device=device)[:, None]  # (cq, 1)
        key_pos = torch.arange(k0, k1, device=device)[None, :]  # (1, ck)
        causal = key_pos <= query_pos  # (cq, ck)
        allowed = causal if allowed is None else allowed & causal  # (..., cq, ck)
    return allowed


def _prepare(q, k, v, mask, *, scale, names):
    """Validate and return (L, S, batch_shape, mask, scale)."""
    L, S, batch_shape = check_qkv(q, k, v)
    if mask is not None:
        mask = _check_bool_mask(mask, (*batch_shape, L, S), device=q.device)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    for name, value in names.items():
        check_positive_int(name, value)
    return L, S, batch_shape, mask, float(scale)


# ----------------------------------------------------------------------------------------
# The stepping stone: chunk the queries only


def query_chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    chunk_size: int = 256,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention computed ``chunk_size`` queries at a time, each chunk against all keys.

    Equal to dense attention. Saves activation memory in inference (one ``(chunk, S)``
    score block at a time instead of ``(L, S)``); does *not* reduce the keys each chunk
    reads, the FLOPs, or the memory autograd keeps for the backward pass (every chunk's
    weights). See the module docstring; :func:`chunked_attention` fixes all three.

    Args:
        q, k, v: ``(..., L, D)``, ``(..., S, D)``, ``(..., S, Dv)``.
        mask: optional bool, True = may attend, broadcastable to ``(..., L, S)``.
        chunk_size: queries per chunk (any value >= 1; the last chunk may be shorter).
        is_causal: block keys after the query, top-left aligned like PyTorch.
        scale: multiplies the scores; default ``1 / sqrt(D)``.
    """
    L, S, _, mask, scale = _prepare(q, k, v, mask, scale=scale, names={"chunk_size": chunk_size})
    outputs = []
    for q0 in range(0, L, chunk_size):
        q1 = min(q0 + chunk_size, L)
        allowed = _chunk_allowed(mask, is_causal=is_causal, q0=q0, q1=q1, k0=0, k1=S, device=q.device)
        chunk = q[..., q0:q1, :]  # (..., cq, D)
        # Ordinary (explicit) attention for this chunk: reuse the lesson-01 function.
        outputs.append(scaled_dot_product_attention(chunk, k, v, allowed, scale=scale, fused=False))  # (..., cq, Dv)
    return torch.cat(outputs, dim=-2)  # (..., L, Dv)


# ----------------------------------------------------------------------------------------
# Queries and keys in chunks: the online softmax
#
# Where the time goes (profiled with torch.profiler at B=1, H=8, D=64, float32, N=2048-8192):
# the two matrix products per block are the useful work; everything else is passes over the
# (cq, ck) block of scores, which is too large for the cache, so each pass costs memory
# traffic. The loops below therefore make as few passes as they can, in place on the block
# that the matrix product has just written (no temporaries of the block's size): the forward
# pass reads it for the max, shifts and exponentiates it in place, sums it and multiplies it
# by v; the backward pass recomputes it in place and forms dS in place. A mask is applied only
# to blocks that a mask touches (causal: the blocks that cross the diagonal); blocks entirely
# in the causal future are never computed. Block sizes: see ``chunked_attention``; the small
# (cq, 1) and (cq, Dv) updates of the recurrence are cheap next to the block's passes.


def _blocked(blocked_mask, *, is_causal, q0, q1, k0, k1, device):
    """Boolean ``(..., cq, ck)`` of the pairs to block in one block of scores, or None if none is.

    ``blocked_mask`` is ``~mask`` (computed once); the causal part is top-left aligned.
    """
    blocked = _slice_mask(blocked_mask, q0, q1, k0, k1)
    if is_causal and k1 - 1 > q0:  # some key in this block lies after some query
        query_pos = torch.arange(q0, q1, device=device)[:, None]  # (cq, 1)
        key_pos = torch.arange(k0, k1, device=device)[None, :]  # (1, ck)
        future = key_pos > query_pos  # (cq, ck)
        blocked = future if blocked is None else blocked | future  # (..., cq, ck)
    return blocked


def _online_softmax_forward(q, k, v, blocked_mask, *, is_causal, scale, query_chunk, key_chunk):
    """The FlashAttention forward recurrence (lesson 07). Returns ``out (..., L, Dv)`` and ``lse (..., L, 1)``.

    For each chunk of queries it keeps, per query row, the running max ``row_max`` (m), the
    running sum ``row_sum`` (l) and the running weighted sum ``acc`` (a), and for each key
    chunk rescales the old ones by ``exp(m - m')`` -- :func:`merge_partials`, written out.
    """
    L, S = q.shape[-2], k.shape[-2]
    batch_shape, value_dim = q.shape[:-2], v.shape[-1]
    outputs, log_sum_exps = [], []
    for q0 in range(0, L, query_chunk):
        q1 = min(q0 + query_chunk, L)
        q_chunk = q[..., q0:q1, :] * scale  # (..., cq, D), scaled here: cheaper than scaling each score block
        row_max = q.new_full((*batch_shape, q1 - q0, 1), float("-inf"))  # (..., cq, 1)   m
        row_sum = q.new_zeros((*batch_shape, q1 - q0, 1))  # (..., cq, 1)   l
        acc = q.new_zeros((*batch_shape, q1 - q0, value_dim))  # (..., cq, Dv)  a
        # Top-left causal: query i sees keys 0..i, so key chunks past the last query are skipped.
        key_stop = min(S, q1) if is_causal else S
        for k0 in range(0, key_stop, key_chunk):
            k1 = min(k0 + key_chunk, S)
            scores = torch.matmul(q_chunk, k[..., k0:k1, :].transpose(-2, -1))  # (..., cq, ck), scaled
            blocked = _blocked(blocked_mask, is_causal=is_causal, q0=q0, q1=q1, k0=k0, k1=k1, device=q.device)
            if blocked is not None:
                scores.masked_fill_(blocked, float("-inf"))  # (..., cq, ck)
            new_max = torch.maximum(row_max, scores.detach().amax(dim=-1, keepdim=True))  # (..., cq, 1)   m'
            # A row with no allowed key yet has max -inf: shift it by 0, so exp(-inf - 0) = 0.
            shift = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))  # (..., cq, 1)
            exps = scores.sub_(shift).exp_()  # (..., cq, ck), in place; every exponent <= 0
            rescale = torch.exp(row_max - shift)  # (..., cq, 1), exp(m - m') <= 1: the old sums shrink
            row_sum = row_sum * rescale + exps.sum(dim=-1, keepdim=True)  # (..., cq, 1)
            acc = acc * rescale + torch.matmul(exps, v[..., k0:k1, :])  # (..., cq, Dv)
            row_max = new_max
        # out = a / l; a row with no allowed key has a = 0 and l = 0: divide by 1 (zeros, never NaN).
        empty = row_sum == 0  # (..., cq, 1)
        outputs.append(acc / torch.where(empty, torch.ones_like(row_sum), row_sum))  # (..., cq, Dv)
        log_sum_exps.append(torch.where(empty, torch.full_like(row_max, float("-inf")),
                                        row_max + torch.log(torch.where(empty, torch.ones_like(row_sum), row_sum))))
    return torch.cat(outputs, dim=-2), torch.cat(log_sum_exps, dim=-2)  # (..., L, Dv), (..., L, 1)


class _RecomputingAttention(torch.autograd.Function):
    """Chunked attention whose backward recomputes each block's weights (FlashAttention's backward).

    Saved for backward: q, k, v, the output and one log-sum-exp per row -- never a weight
    matrix. With ``P = exp(S - lse)`` recomputed block by block and ``delta_i = sum(dO_i * O_i)``:
    ``dV += P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - delta)``, ``dQ += dS K scale``,
    ``dK += dS^T Q scale``.
    """

    @staticmethod
    def forward(ctx, q, k, v, blocked_mask, is_causal, scale, query_chunk, key_chunk):
        out, lse = _online_softmax_forward(
            q, k, v, blocked_mask, is_causal=is_causal, scale=scale, query_chunk=query_chunk, key_chunk=key_chunk
        )
        ctx.save_for_backward(q, k, v, out, lse, blocked_mask)
        ctx.options = (is_causal, scale, query_chunk, key_chunk)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, blocked_mask = ctx.saved_tensors
        is_causal, scale, query_chunk, key_chunk = ctx.options
        L, S = q.shape[-2], k.shape[-2]
        grad_out = grad_out.to(out.dtype)
        delta = (grad_out * out).sum(dim=-1, keepdim=True)  # (..., L, 1)
        # Empty rows have lse = -inf; their scores are all -inf too, so use 0: exp(-inf - 0) = 0.
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # (..., L, 1)
        grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        scaled_q = q * scale  # (..., L, D), exactly as in the forward pass
        for q0 in range(0, L, query_chunk):
            q1 = min(q0 + query_chunk, L)
            q_chunk, dout_chunk = scaled_q[..., q0:q1, :], grad_out[..., q0:q1, :]  # (..., cq, D), (..., cq, Dv)
            key_stop = min(S, q1) if is_causal else S
            for k0 in range(0, key_stop, key_chunk):
                k1 = min(k0 + key_chunk, S)
                k_chunk, v_chunk = k[..., k0:k1, :], v[..., k0:k1, :]  # (..., ck, D), (..., ck, Dv)
                weights = torch.matmul(q_chunk, k_chunk.transpose(-2, -1))  # (..., cq, ck), the scores again
                blocked = _blocked(blocked_mask, is_causal=is_causal, q0=q0, q1=q1, k0=k0, k1=k1, device=q.device)
                if blocked is not None:
                    weights.masked_fill_(blocked, float("-inf"))  # (..., cq, ck)
                weights.sub_(lse[..., q0:q1, :]).exp_()  # (..., cq, ck), in place: P = exp(S - lse)
                grad_v[..., k0:k1, :] += torch.matmul(weights.transpose(-2, -1), dout_chunk)  # (..., ck, Dv)
                grad_scores = torch.matmul(dout_chunk, v_chunk.transpose(-2, -1))  # (..., cq, ck), dP
                grad_scores.sub_(delta[..., q0:q1, :]).mul_(weights)  # (..., cq, ck), in place: dS = P (dP - delta)
                grad_q[..., q0:q1, :] += torch.matmul(grad_scores, k_chunk)  # (..., cq, D), times scale below
                grad_k[..., k0:k1, :] += torch.matmul(grad_scores.transpose(-2, -1), q_chunk)  # (..., ck, D)
        grad_q.mul_(scale)  # (..., L, D): dQ = dS K scale, the scale applied once
        return grad_q, grad_k, grad_v, None, None, None, None, None


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    query_chunk_size: int = 512,
    key_chunk_size: int = 1024,
    is_causal: bool = False,
    scale: float | None = None,
    recompute: bool = True,
) -> torch.Tensor:
    """Exact attention with queries and keys in chunks, merged by the online softmax.

    Never holds more than one ``(query_chunk_size, key_chunk_size)`` block of scores per
    batch and head. Equal to dense attention up to rounding (tests: float64, 1e-10).

    Args:
        q, k, v: ``(..., L, D)``, ``(..., S, D)``, ``(..., S, Dv)``.
        mask: optional bool, True = may attend, broadcastable to ``(..., L, S)`` (sliced per
            chunk; a fully-masked row gives zeros).
        query_chunk_size, key_chunk_size: chunk lengths (any value >= 1; the last chunk may
            be shorter). ``>= L`` / ``>= S`` means one chunk. The default 512 x 1024 (the
            blocks of memory-efficient-attention-pytorch, so no more memory per block: ``B H
            cq ck`` floats) measured among the fastest on a 2-core CPU (B=1, H=8, D=64,
            float32, N=2048): on one thread 512 x 512 and 256 x 1024 were within noise of it
            and 1024 x 1024 1.4x slower; on two busy threads larger blocks (fewer operations)
            won, 512 x 512 1.6x slower. Causal attention gains from smaller blocks (less
            wasted work on the diagonal): pass ``key_chunk_size=512`` there.
        is_causal: block keys after the query, top-left aligned like PyTorch; key chunks
            entirely in the future are skipped.
        scale: multiplies the scores; default ``1 / sqrt(D)``.
        recompute: ``True`` (default) uses a custom autograd function that saves no weights
            and recomputes them chunk by chunk in the backward pass (memory ``O(L + S)``
            beyond the inputs); ``False`` lets autograd record every chunk (the same
            gradients, but memory ``O(L S)`` in training -- the lesson shows both).
    """
    L, S, batch_shape, mask, scale = _prepare(
        q, k, v, mask, scale=scale, names={"query_chunk_size": query_chunk_size, "key_chunk_size": key_chunk_size}
    )
    compute = _compute_dtype(q.dtype)
    blocked_mask = None if mask is None else ~mask  # True = blocked, inverted once rather than per block
    with torch.autocast(device_type=q.device.type, enabled=False):
        # Give q, k, v the common batch shape (views), so gradients are reduced by autograd.
        q_c = q.to(compute).expand(*batch_shape, L, q.shape[-1])  # (..., L, D)
        k_c = k.to(compute).expand(*batch_shape, S, k.shape[-1])  # (..., S, D)
        v_c = v.to(compute).expand(*batch_shape, S, v.shape[-1])  # (..., S, Dv)
        if recompute:
            out = _RecomputingAttention.apply(
                q_c, k_c, v_c, blocked_mask, bool(is_causal), scale, query_chunk_size, key_chunk_size
            )  # (..., L, Dv)
        else:
            out, _ = _online_softmax_forward(
                q_c, k_c, v_c, blocked_mask, is_causal=bool(is_causal), scale=scale,
                query_chunk=query_chunk_size, key_chunk=key_chunk_size,
            )  # (..., L, Dv)
    return out.to(q.dtype)
