"""Sparse attention: each query attends to a fixed pattern of keys, computed without the L x L matrix.

Patterns, for self-attention over one sequence of length L (query ``i``, key ``j``):

* ``"block"`` (block-local): the sequence is cut into blocks of ``size``; a query attends to
  the keys of its own block. Cost ``O(L * size)``.
* ``"sliding"`` (sliding window, as in Longformer, Beltagy et al. 2020): ``|i - j| <= size``.
  Computed with blocks of ``size`` where each query block attends to its own and the two
  neighbouring key blocks (just the previous one when causal), then masked to the window.
* ``"strided"`` (Sparse Transformer, Child et al. 2019): the local window ``|i - j| <= size``
  plus every ``size``-th key before and after, ``(i - j) % size == 0`` -- together they
  reach any position in two steps. With ``size ~ sqrt(L)`` the cost is ``O(L sqrt(L))``.
  Computed as two parts: the local window (blocks, as above) and attention inside each
  residue class ``j = i mod size`` (the sequence reshaped to ``(L / size, size)`` and
  transposed), merged with the online softmax of :mod:`attn_course.chunked`.
* ``num_global`` global tokens (Longformer / BigBird style, Zaheer et al. 2020), on top of
  any pattern: the first ``num_global`` positions attend to every key and every query
  attends to them. Put the tokens that need a global view (a ``[CLS]`` token, a task
  token) first.
* ``is_causal=True`` additionally blocks keys after the query (``j <= i``).

:func:`pattern_mask` builds the equivalent boolean ``(L, L)`` mask (True = may attend) for
pictures and tests; :func:`sparse_attention` never builds it. The result equals dense
attention with that mask (tests: float64, 1e-10), for every length: the sequence is padded
up to a multiple of the block, the padded keys are masked, and the output is sliced back.

The source article's ``SparseAttention`` had three bugs fixed here: it never called
``super().__init__()`` (so ``nn.Module`` was never set up: the object is created, but calling
it raises ``AttributeError``), its ``forward`` used an undefined ``block_size`` (not
``self.block_size``), and its ``view(batch, heads, seq_len // block_size, block_size, dim)``
failed for any length that is not a multiple of the block. Lesson 05 reproduces all three.

Shapes: q, k ``(..., L, D)``, v ``(..., L, Dv)`` -> ``(..., L, Dv)``. The optional ``mask``
is a key-padding mask, bool, True = real token, broadcastable to ``(..., 1, L)`` -- the
same ``padding_mask(lengths)[:, None, None, :]`` you would give dense attention.

Taught in lesson 05 (sparse attention).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._checks import check_int, check_key_mask, check_positive_int, check_qkv, shape_str
from .attention import scaled_dot_product_attention
from .chunked import PartialAttention, finish_partial, merge_partials

__all__ = ["PATTERNS", "pattern_mask", "sparse_attention", "SparseAttention"]

PATTERNS = ("block", "sliding", "strided")


def _check_pattern(pattern: object, size: object, num_global: object) -> tuple[str, int, int]:
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
    size = check_positive_int("size", size)
    num_global = check_int("num_global", num_global, minimum=0)
    return pattern, size, num_global


def pattern_mask(
    length: int,
    *,
    pattern: str,
    size: int,
    num_global: int = 0,
    is_causal: bool = False,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The boolean ``(L, L)`` mask (True = may attend) of a sparse pattern; see the module docstring.

    ``scaled_dot_product_attention(q, k, v, pattern_mask(L, ...))`` equals
    ``sparse_attention(q, k, v, ...)`` with the same options. Meant for pictures and tests:
    it is ``O(L^2)`` memory, which is what sparse attention avoids.
    """
    length = check_positive_int("length", length)
    pattern, size, num_global = _check_pattern(pattern, size, num_global)
    query_pos = torch.arange(length, device=device)[:, None]  # (L, 1)
    key_pos = torch.arange(length, device=device)[None, :]  # (1, L)
    offset = query_pos - key_pos  # (L, L), i - j
    if pattern == "block":
        allowed = query_pos // size == key_pos // size  # (L, L)
    elif pattern == "sliding":
        allowed = offset.abs() <= size  # (L, L)
    else:  # strided
        allowed = (offset.abs() <= size) | (offset % size == 0)  # (L, L)
    if num_global:
        allowed = allowed | (key_pos < num_global) | (query_pos < num_global)  # (L, L)
    if is_causal:
        allowed = allowed & (offset >= 0)  # (L, L)
    return allowed


def _attend(q, k, v, allowed, *, scale) -> PartialAttention:
    """Scores of q ``(..., n, D)`` against k ``(..., m, D)``, masked by ``allowed`` ``(..., n, m)`` (or None).

    :func:`attn_course.chunked.partial_attention`, done in place on the scores this function has just made (they are
    nobody else's): masking, shifting and exponentiating them allocate nothing of their size.
    """
    scores = torch.matmul(q * scale, k.transpose(-2, -1))  # (..., n, m), q scaled first: cheaper than the scores
    if allowed is not None:
        scores.masked_fill_(~allowed, float("-inf"))  # (..., n, m)
    row_max = scores.detach().amax(dim=-1, keepdim=True)  # (..., n, 1)
    # A row with no allowed key has max -inf; shift it by 0 instead, so exp(-inf) = 0.
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))  # (..., n, 1)
    exps = scores.sub_(shift).exp_()  # (..., n, m), every exponent <= 0: no overflow
    return PartialAttention(acc=torch.matmul(exps, v), row_max=row_max, row_sum=exps.sum(dim=-1, keepdim=True))


def _local_part(q, k, v, key_ok, *, pattern, block, size, is_causal, scale) -> PartialAttention:
    """Each block of ``block`` queries against its own key block (and its neighbours for windows).

    q, k, v are padded to ``Lp = nblocks * block``; ``key_ok`` ``(..., Lp)`` says which keys
    may be used at all. Returns a partial over ``(..., Lp)`` rows. The largest score tensor
    is ``(..., nblocks, block, 3 * block)`` -- never ``(Lp, Lp)``.
    """
    *batch, padded, head_dim = q.shape
    nblocks = padded // block
    device = q.device
    if pattern == "block":
        offsets = [0]
    else:
        offsets = [-1, 0] if is_causal else [-1, 0, 1]
    within = torch.arange(block, device=device)  # (b,)
    starts = torch.arange(nblocks, device=device)[:, None] * block  # (nb, 1)
    query_pos = (starts + within)[:, :, None]  # (nb, b, 1)
    key_pos = torch.cat([starts + off * block + within for off in offsets], dim=-1)  # (nb, nk), nk = len(offsets) * b
    in_range = (key_pos >= 0) & (key_pos < padded)  # (nb, nk)
    gather = key_pos.clamp(0, padded - 1)  # (nb, nk), indices into the padded sequence

    q_blocks = q.reshape(*batch, nblocks, block, head_dim)  # (..., nb, b, D)
    if pattern == "block":  # a query block's keys are its own block: a view, no copy
        k_blocks = k.reshape(*batch, nblocks, block, head_dim)  # (..., nb, b, D)
        v_blocks = v.reshape(*batch, nblocks, block, v.shape[-1])  # (..., nb, b, Dv)
        usable = key_ok.reshape(*key_ok.shape[:-1], nblocks, 1, block)  # (..., nb, 1, b)
    else:  # gather the neighbouring blocks' keys too
        k_blocks = k[..., gather, :]  # (..., nb, nk, D)
        v_blocks = v[..., gather, :]  # (..., nb, nk, Dv)
        usable = (key_ok[..., gather] & in_range)[..., None, :]  # (..., nb, 1, nk)

    offset = query_pos - key_pos[:, None, :]  # (nb, b, nk), i - j
    if pattern == "block":
        relation = torch.ones_like(offset, dtype=torch.bool)  # (nb, b, nk), same block by construction
    elif pattern == "sliding":
        relation = offset.abs() <= size  # (nb, b, nk)
    else:  # the strided pattern's local part: |i - j| < size (the residue part has the rest)
        relation = offset.abs() < size  # (nb, b, nk)
    if is_causal:
        relation = relation & (offset >= 0)  # (nb, b, nk)

    allowed = relation & usable  # (..., nb, b, nk)
    if pattern == "block" and not is_causal and bool(key_ok.all()):
        allowed = None  # nothing is masked: skip the mask (it would cost a full copy of the scores)
    part = _attend(q_blocks, k_blocks, v_blocks, allowed, scale=scale)
    return PartialAttention(
        acc=part.acc.reshape(*batch, padded, part.acc.shape[-1]),  # (..., Lp, Dv)
        row_max=part.row_max.reshape(*batch, padded, 1),  # (..., Lp, 1)
        row_sum=part.row_sum.reshape(*batch, padded, 1),  # (..., Lp, 1)
    )


def _strided_part(q, k, v, key_ok, *, stride, is_causal, scale) -> PartialAttention:
    """Attention within each residue class ``j = i (mod stride)``, excluding ``j = i`` (the local part has it).

    Position ``i = a * stride + r`` goes to row ``r``, column ``a`` of an ``(n, stride)`` grid;
    transposing gives ``stride`` sequences of length ``n = Lp / stride``.
    """
    *batch, padded, head_dim = q.shape
    n = padded // stride
    q_classes = q.reshape(*batch, n, stride, head_dim).transpose(-3, -2)  # (..., stride, n, D)
    k_classes = k.reshape(*batch, n, stride, head_dim).transpose(-3, -2)  # (..., stride, n, D)
    v_classes = v.reshape(*batch, n, stride, v.shape[-1]).transpose(-3, -2)  # (..., stride, n, Dv)
    usable = key_ok.reshape(*key_ok.shape[:-1], n, stride).transpose(-2, -1)[..., None, :]  # (..., stride, 1, n)
    a = torch.arange(n, device=q.device)
    relation = a[None, :] < a[:, None] if is_causal else a[None, :] != a[:, None]  # (n, n)
    part = _attend(q_classes, k_classes, v_classes, relation & usable, scale=scale)

    def back(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(-3, -2).reshape(*batch, padded, x.shape[-1])  # (..., Lp, X)

    return PartialAttention(back(part.acc), back(part.row_max), back(part.row_sum))


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    pattern: str,
    size: int,
    num_global: int = 0,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention restricted to a sparse pattern, computed block by block (any length).

    Equals ``scaled_dot_product_attention(q, k, v, pattern_mask(L, ...) & mask)``.

    Args:
        q, k, v: ``(..., L, D)``, ``(..., L, D)``, ``(..., L, Dv)`` (self-attention: one length).
        mask: optional key-padding mask, bool, True = real token, broadcastable to
            ``(..., 1, L)``. A query whose every allowed key is padding gets a zero row.
        pattern: ``"block"``, ``"sliding"`` or ``"strided"`` (see the module docstring).
        size: the block length, the window radius, or the stride.
        num_global: the first ``num_global`` positions become global tokens.
        is_causal: also block keys after the query (``j <= i``).
        scale: multiplies the scores; default ``1 / sqrt(D)``.
    """
    L, S, batch_shape = check_qkv(q, k, v)
    if L != S:
        raise ValueError(
            f"sparse patterns are defined for self-attention, so q and k need the same length: "
            f"q is (..., L, D) = {shape_str(q.shape)}, k is (..., S, D) = {shape_str(k.shape)}"
        )
    pattern, size, num_global = _check_pattern(pattern, size, num_global)
    if mask is not None:
        mask = check_key_mask(
            mask, batch_shape, L=L, S=S, device=q.device, who="sparse attention",
            why="the pattern already says which queries see which keys. For a per-query mask, pass "
            "pattern_mask(...) & your mask to scaled_dot_product_attention",
        )  # (..., 1, L)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    num_global = min(num_global, L)
    # A block never needs to be longer than the sequence (size >= L means one block).
    block = min(size, L)
    padded = math.ceil(L / block) * block
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype

    with torch.autocast(device_type=q.device.type, enabled=False):
        qp, kp, vp = (
            (F.pad(x.to(compute), (0, 0, 0, padded - L)) if padded > L else x.to(compute)).expand(
                *batch_shape, padded, x.shape[-1]
            )  # (..., Lp, D or Dv), zero rows appended
            for x in (q, k, v)
        )
        positions = torch.arange(padded, device=q.device)  # (Lp,)
        key_ok = positions < L  # (Lp,), padded keys are never used
        if mask is not None:
            key_ok = key_ok & F.pad(mask[..., 0, :], (0, padded - L), value=False)  # (..., Lp)
        # Global keys are attended by everyone in their own part below, so the local parts skip them.
        local_ok = key_ok & (positions >= num_global)  # (..., Lp)

        running = _local_part(
            qp, kp, vp, local_ok, pattern=pattern, block=block, size=size, is_causal=is_causal, scale=scale
        )
        if pattern == "strided" and padded > block:
            strided = _strided_part(qp, kp, vp, local_ok, stride=block, is_causal=is_causal, scale=scale)
            running = merge_partials(running, strided)
        if num_global:
            global_ok = key_ok[..., None, :num_global]  # (..., 1, g)
            if is_causal:
                global_ok = global_ok & (positions[:num_global][None, :] <= positions[:, None])  # (..., Lp, g)
            to_global = _attend(qp, kp[..., :num_global, :], vp[..., :num_global, :], global_ok, scale=scale)
            running = merge_partials(running, to_global)
        out = finish_partial(running)[..., :L, :]  # (..., L, Dv)
        if num_global:
            # Global queries see every key: ordinary attention for those few rows.
            rows = scaled_dot_product_attention(
                q[..., :num_global, :].to(compute), k.to(compute), v.to(compute), mask,
                is_causal=is_causal, scale=scale,
            )  # (..., g, Dv)
            out = torch.cat([rows.expand(*batch_shape, *rows.shape[-2:]), out[..., num_global:, :]], dim=-2)  # (..., L, Dv)
    return out.to(q.dtype)


class SparseAttention(nn.Module):
    """The source article's ``SparseAttention`` module, fixed: any length, every pattern, masks.

    ``SparseAttention(pattern="block", size=64)(q, k, v)`` is ``sparse_attention`` with those
    options. It has no parameters; it exists so that a pattern can be a model component.
    """

    def __init__(self, *, pattern: str = "block", size: int = 64, num_global: int = 0, is_causal: bool = False):
        super().__init__()  # the line the article forgot
        self.pattern, self.size, self.num_global = _check_pattern(pattern, size, num_global)
        self.is_causal = bool(is_causal)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return sparse_attention(
            q, k, v, mask, pattern=self.pattern, size=self.size, num_global=self.num_global, is_causal=self.is_causal
        )

    def extra_repr(self) -> str:
        return f"pattern={self.pattern!r}, size={self.size}, num_global={self.num_global}, is_causal={self.is_causal}"
