"""Ulysses (DeepSpeed-Ulysses, Jacobs et al. 2023): swap sequence shards for head shards with two all-to-alls.

Heads are independent, so attention for a group of heads needs all the tokens of those heads
and nothing else. Each rank holds all H heads of its L / W tokens; one all-to-all turns that
into H / W heads of all L tokens, the rank runs ordinary attention for its heads (any kernel),
and a second all-to-all turns the output back. The all-to-all is its own adjoint, so the
backward pass is the same exchange in reverse. The number of query heads must be a multiple
of the world size.

With grouped-query attention (lesson 11: ``Hkv`` key/value heads, each shared by R = H / Hkv
query heads) the K/V heads are split the same way when W divides ``Hkv``; when ``Hkv`` divides
W instead, each K/V head is first copied W / Hkv times, so that every rank gets one
(:func:`ulysses_kv_heads`): more ranks, at the price of sending the copies.

Taught in lesson 12 (attention across devices).
"""

from __future__ import annotations

from typing import Any

import torch

from ..attention import scaled_dot_product_attention
from ..grouped import grouped_attention
from ._checks import check_block, resolve_scale
from .exchange import all_gather, all_to_all, group_rank_size
from .layout import LAYOUTS, check_layout_fits, sequence_positions

__all__ = ["ulysses_attention", "ulysses_kv_heads"]


def ulysses_kv_heads(num_heads: int, num_kv_heads: int, world_size: int) -> int:
    """How many K/V heads Ulysses sends over ``world_size`` ranks: ``num_kv_heads``, or ``world_size`` when copied.

    The H query heads are split into W equal groups, so W must divide H. The ``Hkv`` key/value
    heads are split the same way when W divides ``Hkv``; when ``Hkv`` divides W, each is copied
    ``W / Hkv`` times first (every rank then gets one copy, and its query heads all read it).
    Raises ``ValueError`` naming the world sizes that work otherwise.
    """
    if num_heads % world_size:
        divisors = [w for w in range(1, num_heads + 1) if num_heads % w == 0]
        raise ValueError(
            f"ulysses_attention splits the H = {num_heads} heads over world_size = {world_size} ranks, so H must be a "
            f"multiple of the world size; use {divisors} ranks, or ring_attention"
        )
    if num_kv_heads % world_size == 0:
        return num_kv_heads
    if world_size % num_kv_heads == 0:
        return world_size  # each K/V head copied W / Hkv times: one per rank
    raise ValueError(
        f"ulysses_attention splits the Hkv = {num_kv_heads} key/value heads over world_size = {world_size} ranks: W "
        f"must divide Hkv, or Hkv divide W (then each K/V head is copied W / Hkv times); got neither"
    )


class _AllToAll(torch.autograd.Function):
    """An all-to-all over dim 0; its adjoint is the same all-to-all, so the backward pass is one too."""

    @staticmethod
    def forward(ctx, x, group, what):
        ctx.options = (group, what)
        return all_to_all(x, group, what=what, phase="forward")

    @staticmethod
    def backward(ctx, grad):
        group, what = ctx.options
        return all_to_all(grad, group, what="grad " + what, phase="backward"), None, None


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    layout: str = "contiguous",
    scale: float | None = None,
    fused: bool | None = None,
    group: Any = None,
) -> torch.Tensor:
    """Exact attention over a sequence split across ranks, by head parallelism (DeepSpeed-Ulysses).

    Each rank passes its sequence shard q ``(B, H, L/W, D)``, k ``(B, Hkv, L/W, D)``, v ``(B, Hkv,
    L/W, Dv)`` (``Hkv = H``, or fewer K/V heads as in lesson 11) and ``key_padding_mask`` ``(B,
    L/W)``. An all-to-all hands head group g (``H / W`` query heads and their K/V heads) of every
    shard to rank g, which then holds ``(B, H/W, L, D)``: all tokens of its heads. It runs
    :func:`~attn_course.scaled_dot_product_attention` on them
    (:func:`~attn_course.grouped_attention` when K/V heads are shared; ``fused`` as there), and a
    second all-to-all returns each rank's tokens with all heads: ``(B, H, L/W, Dv)``. W must
    divide H, and divide ``Hkv`` or be a multiple of it (:func:`ulysses_kv_heads`).
    """
    check_block(q, k, v, key_padding_mask, same_length=True)
    _, world_size = group_rank_size(group)
    B, H, local, _ = q.shape
    sent_kv = ulysses_kv_heads(H, k.shape[1], world_size)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    check_layout_fits("ulysses_attention", local, world_size, layout)
    if sent_kv != k.shape[1]:  # fewer K/V heads than ranks: copy each, so that every rank gets one
        copies = sent_kv // k.shape[1]
        k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)  # (B, W, L/W, .)
    seq_len = local * world_size

    def to_heads(x: torch.Tensor, what: str) -> torch.Tensor:
        heads, E = x.shape[1], x.shape[-1]
        group_heads = heads // world_size
        x = x.reshape(B, world_size, group_heads, local, E)  # (B, W, heads/W, L/W, E): heads in W groups
        x = x.permute(1, 0, 2, 3, 4)  # (W, B, heads/W, L/W, E): group g is sent to rank g
        x = _AllToAll.apply(x, group, what)  # (W, B, heads/W, L/W, E): entry w is now rank w's tokens
        return x.permute(1, 2, 0, 3, 4).reshape(B, group_heads, seq_len, E)  # (B, heads/W, L, E) in rank order

    def to_sequence(x: torch.Tensor) -> torch.Tensor:
        group_heads, E = x.shape[1], x.shape[-1]
        x = x.reshape(B, group_heads, world_size, local, E)  # (B, H/W, W, L/W, E): the W ranks' tokens
        x = x.permute(2, 0, 1, 3, 4)  # (W, B, H/W, L/W, E): rank w's tokens go back to rank w
        x = _AllToAll.apply(x, group, "out")  # (W, B, H/W, L/W, E): entry g is head group g
        return x.permute(1, 0, 2, 3, 4).reshape(B, H, local, E)  # (B, H, L/W, E)

    q_heads, k_heads, v_heads = to_heads(q, "q"), to_heads(k, "k"), to_heads(v, "v")  # (B, H/W or Hkv/W, L, .)
    positions = torch.cat(sequence_positions(seq_len, world_size, layout=layout)).to(q.device)  # (L,) rank order
    in_order = bool(torch.equal(positions, torch.arange(seq_len, device=q.device)))
    order = torch.argsort(positions)  # (L,): rank-order index of each position
    if not in_order:  # put the tokens in sequence order, so a causal mask is the usual triangle
        q_heads, k_heads, v_heads = (x.index_select(-2, order) for x in (q_heads, k_heads, v_heads))  # (B, ., L, .)
    mask = None
    if key_padding_mask is not None:
        keep = torch.cat(all_gather(key_padding_mask, group, what="key mask", phase="forward"), dim=-1)  # (B, L)
        mask = keep.index_select(-1, order)[:, None, None, :]  # (B, 1, 1, L) in sequence order
    attend = scaled_dot_product_attention if k_heads.shape[1] == q_heads.shape[1] else grouped_attention
    out = attend(q_heads, k_heads, v_heads, mask, is_causal=bool(is_causal),
                 scale=resolve_scale(scale, q.shape[-1]), fused=fused)  # (B, H/W, L, Dv)
    if not in_order:
        out = out.index_select(-2, positions)  # (B, H/W, L, Dv) back in rank order
    return to_sequence(out)
