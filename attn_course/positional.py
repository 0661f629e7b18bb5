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

**Precision.** Positions and angles are always computed in float64 (float32 on MPS, which has
no float64) and only the finished table, or the rotated features, are cast to the inputs'
dtype. Position 3000 does not even exist in float16 or bfloat16 (their integers are exact only
up to 2048 and 256), and an angle ``p * theta`` of a few thousand radians keeps only two or
three correct bits there: computed in the inputs' dtype, the table and the rotation at such
positions would be noise (an error of about 2 on values in [-1, 1]). Float32 angles are not
enough either at long positions: the angle 8192 is only known to 2^-11 in float32, so its sine
is off by about 5e-4, which is ~4000 float32 roundings. The tests hold every dtype to its own
rounding against a float64 reference, up to position 8192.

Shape legend: B batch, H heads, L query length, S key length, D head dim, E model dim.

Taught in lessons 09 (learned positions in the ViT), 10 (relative positions in the
Conformer) and 11 (rotary positions).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ._checks import broadcast_shapes, check_mask, check_positive_int, check_tensor, shape_str
from .multihead import MultiHeadAttention, split_heads

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


def _angle_dtype(device: torch.device) -> torch.dtype:
    """The dtype positions and angles are computed in: float64, or float32 where there is no float64 (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _angles(positions: torch.Tensor, dim: int, *, base: float) -> torch.Tensor:
    """``p * base^(-2i / dim)`` for every position and pair ``i``: ``(...) -> (..., dim/2)``, in float64.

    Integer positions are converted exactly; the result stays in float64 (float32 on MPS) so
    that callers take sine and cosine before rounding to a lower precision.
    """
    dtype = _angle_dtype(positions.device)
    exponents = torch.arange(0, dim, 2, dtype=dtype, device=positions.device) / dim  # (dim/2,)
    frequencies = base**-exponents  # (dim/2,), from 1 down to ~1/base
    return positions.to(dtype)[..., None] * frequencies  # (..., dim/2)


def _check_positions(positions: object) -> torch.Tensor:
    positions = check_tensor("positions", positions, min_dim=0, floating=False)
    if positions.dtype == torch.bool:
        raise TypeError("positions must hold integers (or floats), got dtype torch.bool")
    return positions


# --------------------------------------------------------------------------------------------
# Sinusoidal (absolute) positions
# --------------------------------------------------------------------------------------------


def sinusoidal_encoding(
    positions: torch.Tensor, d_model: int, *, base: float = 10000.0, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The sinusoidal table of Vaswani et al. (2017) at arbitrary (even negative) ``positions``.

        PE[p, 2i]   = sin(p / base^(2i / d_model))
        PE[p, 2i+1] = cos(p / base^(2i / d_model))

    ``positions`` has any shape ``(...)``; pass integers (a float16 position above 2048 is
    already rounded before it gets here). The table is computed in float64 and returned as
    ``(..., d_model)`` in ``dtype`` -- by default ``positions``' float dtype, or PyTorch's
    default dtype for integer positions.
    """
    positions = _check_positions(positions)
    d_model = _check_even("d_model", d_model)
    if dtype is None:
        dtype = positions.dtype if positions.dtype.is_floating_point else torch.get_default_dtype()
    angles = _angles(positions, d_model, base=base)  # (..., E/2), float64
    table = torch.stack((angles.sin(), angles.cos()), dim=-1)  # (..., E/2, 2)
    return table.flatten(-2).to(dtype)  # (..., E), sin and cos interleaved, rounded once


class SinusoidalPositionalEncoding(nn.Module):
    """Adds the fixed sinusoidal table to ``x`` ``(B, L, E)``; no parameters, any length.

    The table is built from integer positions in float64 and cast to ``x.dtype``, so a float16
    or bfloat16 model gets the table to its own precision at every position (see the module
    docstring for what building it in ``x.dtype`` would cost).
    """

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
        positions = torch.arange(x.shape[1], device=x.device)  # (L,), int64: exact at any length
        return x + sinusoidal_encoding(positions, self.d_model, base=self.base, dtype=x.dtype)  # (B, L, E)


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
    left by ``L - 1 - i``: one zero column, two reshapes and two slices do every row at
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
    :func:`rel_shift`, and handed to ``MultiHeadAttention``'s attention step as an additive
    bias (with ``-inf`` where ``mask`` forbids): only :meth:`attend` is overridden; the
    projections, head split/merge and input checks are ``MultiHeadAttention``'s.

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
        offsets = relative_positions(L, device=q.device)  # (2L-1,), int64: exact at any length
        table = sinusoidal_encoding(offsets, self.d_model, base=self.base, dtype=self.pos_proj.weight.dtype)  # (2L-1, E)
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
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool):
            got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise TypeError(f"mask must be a bool tensor (True = may attend), got {got}")
        self._check_inputs(x, x, x, mask)
        return self._project_attend_merge(x, x, x, need_weights=need_weights, mask=mask)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
        mask: torch.Tensor | None = None, is_causal: bool = False, need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``MultiHeadAttention``'s attention step with the two position terms of Transformer-XL.

        The position term :meth:`position_scores` (scaled) becomes an additive bias, ``-inf``
        where the bool ``mask`` forbids; ``u`` is added to the queries for the content term.
        q, k, v ``(B, H, L, D)`` -> ``(context (B, H, L, D), weights (B, H, L, L) or None)``.
        """
        if q.shape[-2] != k.shape[-2]:
            raise ValueError(f"relative positions need self-attention: q {shape_str(q.shape)}, k {shape_str(k.shape)}")
        bias = self.position_scores(q) * (1.0 / math.sqrt(self.head_dim))  # (B, H, L, L), scaled like the scores
        if mask is not None:
            mask = check_mask(mask, bias.shape, device=q.device)  # bool, broadcastable to (B, H, L, L)
            bias = bias.masked_fill(~mask, float("-inf"))  # (B, H, L, L)
        q_u = q + self.pos_bias_u[:, None, :].to(q.dtype)  # (B, H, L, D), the content term's query
        return super().attend(q_u, k, v, mask=bias, is_causal=is_causal, need_weights=need_weights)


# --------------------------------------------------------------------------------------------
# Rotary positions (RoPE)
# --------------------------------------------------------------------------------------------


def rotary_angles(positions: torch.Tensor, head_dim: int, *, base: float = 10000.0) -> torch.Tensor:
    """Rotation angles ``theta_i * p`` with ``theta_i = base^(-2i / D)``: ``(...) -> (..., D/2)``.

    Computed in float64 and returned in ``positions``' float dtype (PyTorch's default dtype for
    integer positions). For plotting and lessons: :func:`apply_rotary` does not go through these
    rounded angles (a float32 angle near 8192 is only known to 2^-11), it takes the cosine and
    sine of the float64 angles.
    """
    positions = _check_positions(positions)
    head_dim = _check_even("head_dim", head_dim)
    dtype = positions.dtype if positions.dtype.is_floating_point else torch.get_default_dtype()
    return _angles(positions, head_dim, base=base).to(dtype)  # (..., D/2)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, *, base: float = 10000.0) -> torch.Tensor:
    """Rotate feature pairs ``(x[2i], x[2i+1])`` of ``x`` ``(..., L, D)`` by ``theta_i * position``.

    ``positions`` is ``(L,)`` (or broadcastable to ``x.shape[:-1]``), integers preferably. The
    angles, their cosines and sines are computed in float64 (float32 on MPS) and the rotation in
    float32 for float16 / bfloat16 ``x`` (in ``x.dtype`` otherwise); only the result is rounded to
    ``x.dtype``. Computing the angles in ``x.dtype`` instead is wrong at long positions: in
    bfloat16 the positions near 1000 are multiples of 4 (1001 becomes 1000, off by up to 2),
    and the fastest angles are then off by radians.

    This is RoFormer's interleaved pairing (Su et al., 2021); some libraries pair ``x[i]`` with ``x[i + D/2]``
    instead, which is the same idea with the features permuted. Because a rotation by
    ``a`` followed by the inverse of a rotation by ``b`` is a rotation by ``a - b``,
    ``apply_rotary(q, m) . apply_rotary(k, n)`` depends on ``m - n`` only.
    """
    x = check_tensor("x", x, min_dim=2)
    D = x.shape[-1]
    if D % 2:
        raise ValueError(f"the last dim D of x must be even for rotary pairs, got shape {shape_str(x.shape)}")
    positions = _check_positions(positions)
    angles = _angles(positions.to(x.device), D, base=base)  # (..., L, D/2), float64 (float32 on MPS)
    try:
        broadcast_shapes(angles.shape[:-1], x.shape[:-1])
    except RuntimeError:
        raise ValueError(
            f"positions of shape {shape_str(positions.shape)} do not broadcast to x's (..., L) = {shape_str(x.shape[:-1])}"
        ) from None
    compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    cos, sin = angles.cos().to(compute), angles.sin().to(compute)  # (..., L, D/2) each
    pairs = x.to(compute).unflatten(-1, (D // 2, 2))  # (..., L, D/2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]  # (..., L, D/2) each
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)  # (..., L, D/2, 2)
    return rotated.flatten(-2).to(x.dtype)  # (..., L, D), rounded once


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
