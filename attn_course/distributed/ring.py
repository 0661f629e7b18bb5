"""Ring attention (Liu et al. 2023, after Li et al. 2021): K/V blocks travel around a ring of ranks.

Every rank keeps its queries; the key/value blocks travel around the ring, one hop per step
(:func:`~attn_course.distributed.layout.ring_schedule`). At each of the W steps a rank computes
its queries against the block it holds and merges the result into a running
:class:`~attn_course.chunked.PartialAttention` with lesson 07's online softmax
(:func:`ring_step`). Each step sends one K and one V block to the next rank, and the send of
the next block is posted before the computation on the current one, so the two overlap. With
a causal mask only the blocks that hold an allowed pair are computed
(:func:`~attn_course.distributed.layout.block_plan`), and the zig-zag layout gives every rank
the same work.

The backward pass (:class:`_RingAttention`) saves only q, k, v, the output and one
log-sum-exp per query. It sends the blocks around the ring again, recomputes each block's
weights (FlashAttention's backward, per block: :func:`ring_step_backward`), and sends each
block's gradients dK, dV along with the block, so they collect every rank's share on the way
and arrive home, complete, after W hops.

Shapes: each rank passes its shard q ``(B, H, L/W, D)``, k ``(B, Hkv, L/W, D)``, v ``(B, Hkv,
L/W, Dv)`` and optionally ``key_padding_mask`` ``(B, L/W)`` (bool, True = a real token that
may be attended to) and gets its shard of the output ``(B, H, L/W, Dv)``. ``Hkv = H`` is
multi-head attention; with grouped-query attention (lesson 11, ``Hkv`` dividing ``H``) only the
``Hkv`` key/value heads travel, and each K/V block meets the R = H / Hkv query heads that share
it folded into its rows.

Taught in lesson 12 (attention across devices).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from ..chunked import PartialAttention, finish_partial, log_sum_exp, merge_partials, partial_attention
from ._checks import check_block, check_positions, compute_dtype, resolve_scale
from .exchange import RingExchange, WorkEvent, group_rank_size, record, timed
from .layout import block_plan, check_layout_fits, chunk_length, ring_schedule, sequence_positions

__all__ = ["ring_step", "ring_step_backward", "ring_attention"]


# ----------------------------------------------------------------------------------------
# One ring step, forward and backward


def _empty_partial(rows: torch.Tensor, value_dim: int) -> PartialAttention:
    """The partial result of attending to no key yet, for ``rows`` ``(B, H, Lq, ...)``."""
    shape = rows.shape[:-1]
    return PartialAttention(
        acc=rows.new_zeros(*shape, value_dim),  # (B, H, Lq, Dv)
        row_max=rows.new_full((*shape, 1), float("-inf")),  # (B, H, Lq, 1)
        row_sum=rows.new_zeros(*shape, 1),  # (B, H, Lq, 1)
    )


def _fold(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``(B, H, c, E) -> (B, Hkv, R * c, E)``: the R query heads that share a K/V head become more rows.

    Query head ``h = j R + r`` reads K/V head ``j`` (lesson 11's grouped-query attention), so a
    group's R heads are consecutive and fold into the row axis without touching K or V. With
    ``Hkv = H`` (R = 1) nothing changes.
    """
    B, H, c, E = x.shape
    return x.reshape(B, kv_heads, (H // kv_heads) * c, E)  # (B, Hkv, R * c, E)


def _unfold(x: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`_fold`: ``(B, Hkv, R * c, E) -> (B, H, c, E)``."""
    return x.reshape(x.shape[0], heads, -1, x.shape[-1])  # (B, H, c, E)


def _allowed(key_keep: torch.Tensor | None, ks: slice, causal: torch.Tensor | None, repeats: int = 1):
    """Boolean ``(B, 1, R * cq, ck)`` (or broadcastable) of allowed pairs in one folded block, or None for all."""
    allowed = None if key_keep is None else key_keep[:, None, None, ks]  # (B, 1, 1, ck)
    if causal is not None:
        causal = causal.repeat(repeats, 1) if repeats > 1 else causal  # (R * cq, ck): the same rows for each head
        allowed = causal if allowed is None else allowed & causal  # (B, 1, R * cq, ck)
    return allowed


def _merge_block(running, q_scaled, k, v, plan, key_keep) -> tuple[PartialAttention, int]:
    """Merge the block ``(k, v)`` into ``running`` for the pre-scaled queries; returns (partial, scores computed)."""
    compute = q_scaled.dtype
    heads, kv_heads = q_scaled.shape[1], k.shape[1]
    if running is None:
        running = _empty_partial(q_scaled, v.shape[-1])
    pieces: dict[tuple[int, int], PartialAttention] = {}
    computed = 0
    for qs, ks, causal in plan:
        q_block = _fold(q_scaled[..., qs, :], kv_heads)  # (B, Hkv, R * cq, D)
        scores = torch.matmul(q_block, k[..., ks, :].to(compute).transpose(-2, -1))  # (B, Hkv, R * cq, ck)
        allowed = _allowed(key_keep, ks, causal, heads // kv_heads)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))  # (B, Hkv, R * cq, ck)
        folded = partial_attention(scores, v[..., ks, :].to(compute))  # lesson 07: (acc, max, sum) of this block
        part = PartialAttention(*(_unfold(t, heads) for t in folded))  # (B, H, cq, .)
        key = (qs.start, qs.stop)
        pieces[key] = part if key not in pieces else merge_partials(pieces[key], part)
        computed += scores.numel()
    if not pieces:
        return running, 0
    rows = []
    start = 0
    for (q0, q1), part in sorted(pieces.items()):
        if q0 > start:  # rows no block reached this step keep their running value
            rows.append(PartialAttention(*(t[..., start:q0, :] for t in running)))
        old = PartialAttention(*(t[..., q0:q1, :] for t in running))
        rows.append(merge_partials(old, part))  # the online-softmax merge of lesson 07
        start = q1
    if start < q_scaled.shape[-2]:
        rows.append(PartialAttention(*(t[..., start:, :] for t in running)))
    return PartialAttention(*(torch.cat(parts, dim=-2) for parts in zip(*rows))), computed  # (B, H, Lq, .)


def ring_step(
    running: PartialAttention | tuple | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> PartialAttention:
    """One step of ring attention: merge this rank's queries' attention over one arriving K/V block.

    Args:
        running: the :class:`~attn_course.chunked.PartialAttention` over the blocks seen so
            far (``(acc, row_max, row_sum)``), or None at the first step.
        q: this rank's queries ``(B, H, Lq, D)``; k, v: the block ``(B, Hkv, Lk, D)``, ``(B, Hkv, Lk, Dv)``
            (``Hkv = H``, or fewer K/V heads shared by groups of query heads as in lesson 11).
        q_positions, k_positions: ``(Lq,)``, ``(Lk,)`` global token positions; the causal mask
            compares these (query at position i sees keys at positions <= i), never local indices.
        key_padding_mask: ``(B, Lk)`` bool, True = a real key; it travels with the block.
        is_causal: apply the causal mask; blocks entirely in the future are skipped.
        scale: default ``1 / sqrt(D)``.

    Returns the merged partial ``(B, H, Lq, .)``; :func:`~attn_course.chunked.finish_partial`
    turns it into the output after the last step. A row with no allowed key so far holds no NaN:
    ``acc`` 0, ``row_sum`` 0 and ``row_max`` -inf (lesson 07's empty partial).
    """
    check_block(q, k, v, key_padding_mask, same_length=False)
    q_positions = check_positions("q_positions", q_positions, q.shape[-2], q.device)
    k_positions = check_positions("k_positions", k_positions, k.shape[-2], q.device)
    compute = compute_dtype(q.dtype)
    if running is not None:
        running = PartialAttention(*(t.to(compute) for t in running))
    q_scaled = q.to(compute) * resolve_scale(scale, q.shape[-1])  # (B, H, Lq, D)
    plan = block_plan(q_positions, k_positions, is_causal=bool(is_causal), device=q.device)
    partial, _ = _merge_block(running, q_scaled, k, v, plan, key_padding_mask)
    return partial


def _block_gradients(q, k, v, grad_out, delta, lse, plan, key_keep, scale):
    """Gradient contributions of one block (FlashAttention's backward): (dq, dk, dv, scores computed)."""
    compute = grad_out.dtype
    heads, kv_heads = q.shape[1], k.shape[1]
    grad_q = torch.zeros(q.shape, dtype=compute, device=q.device)  # (B, H, Lq, D)
    grad_k = torch.zeros(k.shape, dtype=compute, device=k.device)  # (B, Hkv, Lk, D)
    grad_v = torch.zeros(v.shape, dtype=compute, device=v.device)  # (B, Hkv, Lk, Dv)
    computed = 0
    for qs, ks, causal in plan:
        # The R query heads of a K/V head folded into the rows (R = 1 for multi-head attention).
        q_block = _fold(q[..., qs, :].to(compute), kv_heads)  # (B, Hkv, R * cq, D)
        dout = _fold(grad_out[..., qs, :], kv_heads)  # (B, Hkv, R * cq, Dv)
        row_lse, row_delta = _fold(lse[..., qs, :], kv_heads), _fold(delta[..., qs, :], kv_heads)  # (B, Hkv, R * cq, 1)
        k_block, v_block = k[..., ks, :].to(compute), v[..., ks, :].to(compute)  # (B, Hkv, ck, D), (B, Hkv, ck, Dv)
        scores = torch.matmul(q_block * scale, k_block.transpose(-2, -1))  # (B, Hkv, R * cq, ck), as in forward
        allowed = _allowed(key_keep, ks, causal, heads // kv_heads)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.exp(scores - row_lse)  # (B, Hkv, R * cq, ck): the final softmax weights of this block
        grad_v[..., ks, :] += torch.matmul(weights.transpose(-2, -1), dout)  # (B, Hkv, ck, Dv), summed over R
        grad_weights = torch.matmul(dout, v_block.transpose(-2, -1))  # (B, Hkv, R * cq, ck)
        grad_scores = weights * (grad_weights - row_delta) * scale  # (B, Hkv, R * cq, ck)
        grad_q[..., qs, :] += _unfold(torch.matmul(grad_scores, k_block), heads)  # (B, H, cq, D)
        grad_k[..., ks, :] += torch.matmul(grad_scores.transpose(-2, -1), q_block)  # (B, Hkv, ck, D), summed over R
        computed += scores.numel()
    return grad_q, grad_k, grad_v, computed


def _safe_lse(lse: torch.Tensor) -> torch.Tensor:
    """Rows with no allowed key have lse = -inf and all scores -inf: use 0, so exp(-inf - 0) = 0."""
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # (B, H, Lq, 1)


def ring_step_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of the gradients: ``(dq_part, dk, dv)`` for queries q against the block (k, v).

    Shapes as in :func:`ring_step` (k and v may have fewer heads, ``Hkv``; dk and dv then sum
    over the query heads that share each K/V head).

    ``out`` ``(B, H, Lq, Dv)`` and ``lse`` ``(B, H, Lq, 1)`` are the *final* output and
    log-sum-exp of the queries over all keys (after the whole ring), ``grad_out`` the
    gradient of the loss with respect to ``out``. With ``P = exp(scores - lse)`` and
    ``delta = rowsum(grad_out * out)``: ``dv = P^T grad_out``, ``dS = P (grad_out v^T - delta)``,
    ``dq_part = dS k scale``, ``dk = dS^T q scale``. Summing ``dq_part`` over all blocks gives
    dq; summing ``dk``, ``dv`` over all ranks' queries gives the block's gradients.
    """
    check_block(q, k, v, key_padding_mask, same_length=False)
    q_positions = check_positions("q_positions", q_positions, q.shape[-2], q.device)
    k_positions = check_positions("k_positions", k_positions, k.shape[-2], q.device)
    compute = compute_dtype(q.dtype)
    grad_out, out = grad_out.to(compute), out.to(compute)
    delta = (grad_out * out).sum(dim=-1, keepdim=True)  # (B, H, Lq, 1)
    plan = block_plan(q_positions, k_positions, is_causal=bool(is_causal), device=q.device)
    dq, dk, dv, _ = _block_gradients(q, k, v, grad_out, delta, _safe_lse(lse.to(compute)), plan,
                                     key_padding_mask, resolve_scale(scale, q.shape[-1]))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------------------
# Ring attention


class _RingAttention(torch.autograd.Function):
    """Ring attention with a recomputing backward pass (saves q, k, v, out and lse; no weights)."""

    @staticmethod
    def forward(ctx, q, k, v, key_keep, is_causal, layout, scale, group):
        rank, world_size = group_rank_size(group)
        positions = sequence_positions(q.shape[-2] * world_size, world_size, layout=layout)  # on the CPU
        chunk = chunk_length(q.shape[-2], layout)
        plans = [block_plan(positions[rank], positions[source], is_causal=is_causal, device=q.device, max_run=chunk)
                 for source in ring_schedule(world_size)[rank]]
        compute = compute_dtype(q.dtype)
        q_scaled = q.to(compute) * scale  # (B, H, L/W, D)
        block = [k, v] + ([key_keep] if key_keep is not None else [])
        what = "k, v" + (", key mask" if key_keep is not None else "")
        running = None
        for step in range(world_size):
            # Post the exchange of the block we hold before computing on it: the transfer of
            # the next block overlaps with this step's arithmetic.
            pending = RingExchange(block, group, what=what, phase="forward", step=step) if step < world_size - 1 else None
            start = timed(q.device)
            running, computed = _merge_block(running, q_scaled, block[0], block[1], plans[step],
                                             block[2] if key_keep is not None else None)
            record(WorkEvent("forward", step, computed, timed(q.device) - start))
            if pending is not None:
                block = pending.wait()
        out = finish_partial(running)  # (B, H, L/W, Dv)
        lse = log_sum_exp(running)  # (B, H, L/W, 1), lesson 07
        ctx.save_for_backward(q, k, v, out, lse, key_keep)
        ctx.options = (plans, scale, group, what)
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, key_keep = ctx.saved_tensors
        plans, scale, group, what = ctx.options
        _, world_size = group_rank_size(group)
        compute = out.dtype
        grad_out = grad_out.to(compute)
        delta = (grad_out * out).sum(dim=-1, keepdim=True)  # (B, H, L/W, 1)
        lse = _safe_lse(lse)
        grad_q = torch.zeros(q.shape, dtype=compute, device=q.device)  # (B, H, L/W, D)
        block = [k, v] + ([key_keep] if key_keep is not None else [])
        incoming = None  # the gradients of the block we hold, summed over the ranks it has visited
        for step in range(world_size):
            pending = RingExchange(block, group, what=what, phase="backward", step=step) if step < world_size - 1 else None
            start = timed(q.device)
            dq, dk, dv, computed = _block_gradients(q, block[0], block[1], grad_out, delta, lse, plans[step],
                                                    block[2] if key_keep is not None else None, scale)
            grad_q += dq
            record(WorkEvent("backward", step, computed, timed(q.device) - start))
            if incoming is not None:
                dk_so_far, dv_so_far = incoming.wait()
                dk, dv = dk_so_far + dk, dv_so_far + dv
            # Pass the block's gradients on with the block: after W hops they are home, complete.
            incoming = RingExchange([dk, dv], group, what="dk, dv", phase="backward", step=step) if world_size > 1 else None
            if pending is not None:
                block = pending.wait()
        if incoming is not None:
            dk, dv = incoming.wait()
        return grad_q.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    layout: str = "zigzag",
    scale: float | None = None,
    group: Any = None,
) -> torch.Tensor:
    """Exact attention over a sequence split across the ranks of ``group``; K/V blocks travel around a ring.

    Call it on every rank with that rank's shard (laid out by
    :func:`~attn_course.distributed.layout.sequence_positions` with the same ``layout``): q ``(B, H, L/W, D)``,
    k ``(B, Hkv, L/W, D)``, v ``(B, Hkv, L/W, Dv)`` (``Hkv`` divides ``H``; ``Hkv = H`` for multi-head
    attention), ``key_padding_mask`` ``(B, L/W)`` (True = real token). Returns this rank's output
    ``(B, H, L/W, Dv)``, equal to the matching rows of single-process attention. The
    backward pass (a collective too: every rank must call it) gives exact gradients.

    Without a running process group it runs as a single process (W = 1): lesson 07's
    online softmax over the whole sequence.
    """
    check_block(q, k, v, key_padding_mask, same_length=True)
    _, world_size = group_rank_size(group)
    check_layout_fits("ring_attention", q.shape[-2], world_size, layout)
    with torch.autocast(device_type=q.device.type, enabled=False):
        out = _RingAttention.apply(q, k, v, key_padding_mask, bool(is_causal), layout,
                                   resolve_scale(scale, q.shape[-1]), group)
    return out

