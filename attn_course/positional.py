"""Positional information for attention: sinusoidal, learned, relative (Transformer-XL) and rotary.

Attention by itself is blind to order: permute the tokens and the outputs permute the same
way. Four ways to tell it where each token sits:

* **sinusoidal** (Vaswani et al., 2017) -- add a fixed ``(L, E)`` table of sines and cosines
  of geometrically spaced frequencies to the token embeddings;
* **learned** -- add a trained ``(max_len, E)`` table (BERT, ViT);
* **relative** (Dai et al., 2019, Transformer-XL) -- leave the tokens alone and add to every
  score a term that depends only on the offset ``i - j`` between query and key, computed for
  all pairs at once with the *rel-shift* trick; the Conformer uses it;
* **rotary** (Su et al., 2021, RoPE) -- rotate each pair of query/key features by an angle
  proportional to the position, so that ``q_m . k_n`` depends on ``m - n`` only.

Shape legend: B batch, H heads, L query length, S key length, D head dim, E model dim.

Taught in lessons 09 (learned positions in the ViT), 10 (relative positions in the
Conformer) and 11 (rotary positions).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ._checks import check_positive_int, check_tensor, shape_str
from .attention import scaled_dot_product_attention
from .multihead import MultiHeadAttention, merge_heads, split_heads

__all__ = [
    "sinusoidal_encoding",
    "SinusoidalPositionalEncoding",
    "LearnedPositionalEmbedding",
    "relative_positions",
    "rel_shift",
    "RelativePositionMultiHeadAttention",
    "rotary_angles",
    "apply_rotary",
    "RotaryEmbedding",
]


def _check_even(name: str, value: int) -> int:
    check_positive_int(name, value)
    if value % 2:
        raise ValueError(f"{name} must be even (features come in sine/cosine pairs), got {value}")
    return value


# --------------------------------------------------------------------------------------------
# Sinusoidal (absolute) positions
# --------------------------------------------------------------------------------------------


def sinusoidal_encoding(positions: torch.Tensor, d_model: int, *, base: float = 10000.0) -> torch.Tensor:
    """The sinusoidal table of Vaswani et al. (2017) at arbitrary (even negative) ``positions``.

        PE[p, 2i]   = sin(p / base^(2i / d_model))
        PE[p, 2i+1] = cos(p / base^(2i / d_model))

    ``positions`` has any shape ``(...)`` (integer or float); the result is ``(..., d_model)``
    in ``positions``' float dtype (float32 for integer positions).
    """
    positions = check_tensor("positions", positions, min_dim=0, floating=False)
    d_model = _check_even("d_model", d_model)
    dtype = positions.dtype if positions.dtype.is_floating_point else torch.get_default_dtype()
    positions = positions.to(dtype)
    exponents = torch.arange(0, d_model, 2, dtype=dtype, device=positions.device) / d_model  # (E/2,)
    frequencies = base**-exponents  # (E/2,), from 1 down to ~1/base
    angles = positions[..., None] * frequencies  # (..., E/2)
    table = torch.stack((angles.sin(), angles.cos()), dim=-1)  # (..., E/2, 2)
    return table.flatten(-2)  # (..., E), sin and cos interleaved


class SinusoidalPositionalEncoding(nn.Module):
    """Adds the fixed sinusoidal table to ``x`` ``(B, L, E)``; no parameters, any length."""

    def __init__(self, d_model: int, *, base: float = 10000.0) -> None:
        super().__init__()
        self.d_model = _check_even("d_model", d_model)
        self.base = base

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, base={self.base}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = check_tensor("x", x, min_dim=3)
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be (B, L, E={self.d_model}), got shape {shape_str(x.shape)}")
        positions = torch.arange(x.shape[1], device=x.device, dtype=x.dtype)  # (L,)
        return x + sinusoidal_encoding(positions, self.d_model, base=self.base)  # (B, L, E)


class LearnedPositionalEmbedding(nn.Module):
    """Adds a trained table ``(max_len, E)`` to ``x`` ``(B, L, E)`` for ``L <= max_len``.

    Initialised with a small normal (std 0.02, as in BERT and ViT). Unlike the sinusoidal
    table it cannot extrapolate: positions beyond ``max_len`` were never trained.
    """

    def __init__(
        self,
        max_len: int,
        d_model: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.max_len = check_positive_int("max_len", max_len)
        self.d_model = check_positive_int("d_model", d_model)
        self.weight = nn.Parameter(torch.empty(max_len, d_model, device=device, dtype=dtype))
        nn.init.trunc_normal_(self.weight, std=0.02)

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, d_model={self.d_model}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = check_tensor("x", x, min_dim=3)
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be (B, L, E={self.d_model}), got shape {shape_str(x.shape)}")
        if x.shape[1] > self.max_len:
            raise ValueError(f"sequence length {x.shape[1]} exceeds max_len={self.max_len} of the learned table")
        return x + self.weight[: x.shape[1]]  # (B, L, E)


# --------------------------------------------------------------------------------------------
# Relative positions, Transformer-XL style
# --------------------------------------------------------------------------------------------


def relative_positions(length: int, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The ``2L - 1`` offsets ``L-1, L-2, ..., 0, ..., -(L-1)`` in the order :func:`rel_shift` expects.

    Column ``c`` of the position scores holds offset ``L - 1 - c``.
    """
    length = check_positive_int("length", length)
    return torch.arange(length - 1, -length, -1, device=device, dtype=dtype)  # (2L-1,)


def rel_shift(scores: torch.Tensor) -> torch.Tensor:
    """Turn position scores indexed by offset into scores indexed by key: ``(..., L, 2L-1) -> (..., L, L)``.

    Input column ``c`` of row ``i`` belongs to offset ``L - 1 - c`` (see
    :func:`relative_positions`); output ``[i, j]`` is the input at offset ``i - j``, i.e.
    ``out[..., i, j] = scores[..., i, L - 1 - i + j]``. Row ``i`` is the input row shifted
    left by ``L - 1 - i``: one zero column, one reshape and one slice do every row at
    once, with no gather (Dai et al., 2019).
    """
    scores = check_tensor("scores", scores, min_dim=2)
    *batch, L, width = scores.shape
    if width != 2 * L - 1:
        raise ValueError(f"rel_shift expects (..., L, 2L-1) scores, got {shape_str(scores.shape)} (L={L})")
    padded = torch.nn.functional.pad(scores, (1, 0))  # (..., L, 2L), a zero column in front
    padded = padded.reshape(*batch, 2 * L, L)  # (..., 2L, L): same memory, rows re-cut
    # Dropping the first re-cut row shifts every original row i left by L - 1 - i.
    shifted = padded[..., 1:, :].reshape(*batch, L, 2 * L - 1)  # (..., L, 2L-1)
    return shifted[..., :L]  # (..., L, L)


class RelativePositionMultiHeadAttention(MultiHeadAttention):
    """Self-attention with Transformer-XL relative positions (Dai et al., 2019), as in the Conformer.

    For query ``i`` and key ``j`` (``R`` the sinusoidal encoding of the offset ``i - j``,
    ``W_r`` a projection, ``u``/``v`` learned per-head biases, scale ``1 / sqrt(D)``)::

        score[i, j] = ( (q_i + u) . k_j            # content: what is at j?
                      + (q_i + v) . W_r R[i - j] )  # position: how far is j?
                      * scale

    The position term is computed for the ``2L - 1`` offsets, mapped to ``(L, L)`` with
    :func:`rel_shift`, and handed to the package's ``scaled_dot_product_attention`` as an
    additive bias (with ``-inf`` where ``mask`` forbids). Reuses ``MultiHeadAttention``'s
    projections, head split/merge and input checks.

    Args:
        d_model, num_heads, dropout, bias, device, dtype: as for ``MultiHeadAttention``.
        base: the sinusoidal base of the offset encoding.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        bias: bool = True,
        dropout: float = 0.0,
        base: float = 10000.0,
        fused: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(d_model, num_heads, bias=bias, dropout=dropout, fused=fused, device=device, dtype=dtype)
        _check_even("d_model", d_model)
        factory = {"device": device, "dtype": dtype}
        self.base = base
        self.pos_proj = nn.Linear(d_model, d_model, bias=False, **factory)  # W_r
        self.pos_bias_u = nn.Parameter(torch.zeros(num_heads, self.head_dim, **factory))  # u: (H, D)
        self.pos_bias_v = nn.Parameter(torch.zeros(num_heads, self.head_dim, **factory))  # v: (H, D)
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)

    def position_scores(self, q: torch.Tensor) -> torch.Tensor:
        """The position term ``(q_i + v) . W_r R[i - j]``, unscaled: q ``(B, H, L, D)`` -> ``(B, H, L, L)``."""
        L = q.shape[-2]
        # Offsets beyond 256 are not exact in bfloat16: build the table in float32 at least.
        exact = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        offsets = relative_positions(L, device=q.device, dtype=exact)  # (2L-1,)
        table = sinusoidal_encoding(offsets, self.d_model, base=self.base).to(self.pos_proj.weight.dtype)  # (2L-1, E)
        r = split_heads(self.pos_proj(table)[None], self.num_heads)[0].to(q.dtype)  # (H, 2L-1, D)
        q_v = q + self.pos_bias_v[:, None, :].to(q.dtype)  # (B, H, L, D)
        by_offset = torch.matmul(q_v, r.transpose(-2, -1))  # (B, H, L, 2L-1)
        return rel_shift(by_offset)  # (B, H, L, L)

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        need_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Self-attention over ``x`` ``(B, L, E)``.

        ``mask``: bool, True = may attend, broadcastable to ``(B, H, L, L)`` (a padding mask
        ``(B, S)`` needs ``[:, None, None, :]``). Returns ``out`` ``(B, L, E)``, or
        ``(out, weights)`` with weights ``(B, H, L, L)``.
        """
        self._check_inputs(x, x, x)
        q = split_heads(self.q_proj(x), self.num_heads)  # (B, H, L, D)
        k = split_heads(self.k_proj(x), self.num_heads)  # (B, H, L, D)
        v = split_heads(self.v_proj(x), self.num_heads)  # (B, H, L, D)
        scale = 1.0 / math.sqrt(self.head_dim)
        bias = self.position_scores(q) * scale  # (B, H, L, L)
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
                got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
                raise TypeError(f"mask must be a bool tensor (True = may attend), got {got}")
            try:
                torch.broadcast_shapes(mask.shape, bias.shape)
            except RuntimeError:
                raise ValueError(
                    f"mask of shape {shape_str(mask.shape)} does not broadcast to (B, H, L, L) = "
                    f"{shape_str(bias.shape)}; a (B, S) padding mask needs mask[:, None, None, :]"
                ) from None
            bias = bias.masked_fill(~mask, float("-inf"))  # (B, H, L, L)
        q_u = q + self.pos_bias_u[:, None, :].to(q.dtype)  # (B, H, L, D)
        attended = scaled_dot_product_attention(
            q_u,
            k,
            v,
            bias,
            scale=scale,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=need_weights,
            fused=None if self.fused else False,
        )
        context, weights = attended if need_weights else (attended, None)  # (B, H, L, D)
        out = self.out_proj(merge_heads(context))  # (B, L, E)
        return (out, weights) if need_weights else out


# --------------------------------------------------------------------------------------------
# Rotary positions (RoPE)
# --------------------------------------------------------------------------------------------


def rotary_angles(positions: torch.Tensor, head_dim: int, *, base: float = 10000.0) -> torch.Tensor:
    """Rotation angles ``theta_i * p`` with ``theta_i = base^(-2i / D)``: ``(...) -> (..., D/2)``."""
    positions = check_tensor("positions", positions, min_dim=0, floating=False)
    head_dim = _check_even("head_dim", head_dim)
    dtype = positions.dtype if positions.dtype.is_floating_point else torch.get_default_dtype()
    exponents = torch.arange(0, head_dim, 2, dtype=dtype, device=positions.device) / head_dim  # (D/2,)
    return positions.to(dtype)[..., None] * base**-exponents  # (..., D/2)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, *, base: float = 10000.0) -> torch.Tensor:
    """Rotate feature pairs ``(x[2i], x[2i+1])`` of ``x`` ``(..., L, D)`` by ``theta_i * position``.

    ``positions`` is ``(L,)`` (or broadcastable to ``x.shape[:-1]``). This is RoFormer's
    interleaved pairing (Su et al., 2021); some libraries pair ``x[i]`` with ``x[i + D/2]``
    instead, which is the same idea with the features permuted. Because a rotation by
    ``a`` followed by the inverse of a rotation by ``b`` is a rotation by ``a - b``,
    ``apply_rotary(q, m) . apply_rotary(k, n)`` depends on ``m - n`` only.
    """
    x = check_tensor("x", x, min_dim=2)
    D = x.shape[-1]
    if D % 2:
        raise ValueError(f"the last dim D of x must be even for rotary pairs, got shape {shape_str(x.shape)}")
    positions = check_tensor("positions", positions, min_dim=0, floating=False)
    angles = rotary_angles(positions.to(device=x.device, dtype=x.dtype), D, base=base)  # (..., L, D/2)
    try:
        torch.broadcast_shapes(angles.shape[:-1], x.shape[:-1])
    except RuntimeError:
        raise ValueError(
            f"positions of shape {shape_str(positions.shape)} do not broadcast to x's (..., L) = {shape_str(x.shape[:-1])}"
        ) from None
    cos, sin = angles.cos(), angles.sin()  # (..., L, D/2) each
    pairs = x.unflatten(-1, (D // 2, 2))  # (..., L, D/2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]  # (..., L, D/2) each
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)  # (..., L, D/2, 2)
    return rotated.flatten(-2)  # (..., L, D)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to queries and keys ``(B, H, L, D)`` before attention; no parameters.

    ``forward(q, k, *, offset=0)`` rotates both at positions ``offset, offset+1, ...``
    (with a KV cache, the keys start earlier than the queries: rotate each with its own
    positions using :func:`apply_rotary`).
    """

    def __init__(self, head_dim: int, *, base: float = 10000.0) -> None:
        super().__init__()
        self.head_dim = _check_even("head_dim", head_dim)
        self.base = base

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}"

    def forward(self, q: torch.Tensor, k: torch.Tensor, *, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        for name, t in (("q", q), ("k", k)):
            check_tensor(name, t, min_dim=2)
            if t.shape[-1] != self.head_dim:
                raise ValueError(f"{name} must be (..., L, D={self.head_dim}), got shape {shape_str(t.shape)}")
        q_pos = torch.arange(offset, offset + q.shape[-2], device=q.device)  # (L,)
        k_pos = torch.arange(offset, offset + k.shape[-2], device=k.device)  # (S,)
        return apply_rotary(q, q_pos, base=self.base), apply_rotary(k, k_pos, base=self.base)
