"""Input checks shared by ring attention, Ulysses and the sharded runner: shapes, dtypes, positions, the scale.

Each raises with the expected and the actual shapes or dtypes. Taught in lesson 12 (attention
across devices).
"""

from __future__ import annotations

import math

import torch

from .._checks import shape_str

__all__ = ["compute_dtype", "check_shard", "check_block", "resolve_scale", "check_positions"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float16 / bfloat16 are computed in float32, as in lesson 07."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def check_shard(name: str, x: object, *, dims: int = 4) -> torch.Tensor:
    """``x`` must be a floating-point tensor with ``dims`` dimensions (a rank's ``(B, H, L/W, D)`` shard)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dims:
        raise ValueError(f"{name} must be (B, H, L/W, D) with {dims} dims, got shape {shape_str(x.shape)}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x


def check_block(q, k, v, key_padding_mask, *, same_length: bool) -> None:
    """q ``(B, H, Lq, D)``, k ``(B, Hkv, Lk, D)``, v ``(B, Hkv, Lk, Dv)`` of one dtype and device; mask ``(B, Lk)`` bool.

    ``Hkv`` divides ``H``: query head ``h`` reads key/value head ``h // (H / Hkv)`` (grouped-query
    attention, lesson 11; ``Hkv = H`` is ordinary multi-head attention). ``same_length``: a
    rank's own shard, so ``Lq == Lk``.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_shard(name, x)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if (k.shape[0] != q.shape[0] or v.shape[:3] != k.shape[:3] or k.shape[-1] != q.shape[-1]
            or q.shape[1] % k.shape[1]):
        raise ValueError(
            f"expected q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) with the same B and D, and Hkv dividing H "
            f"(Hkv = H: multi-head attention; Hkv < H: grouped-query attention, lesson 11), got q "
            f"{shape_str(q.shape)}, k {shape_str(k.shape)}, v {shape_str(v.shape)}"
        )
    if same_length and k.shape[-2] != q.shape[-2]:
        raise ValueError(
            f"each rank holds the same number of queries and keys (a shard of one sequence), got q "
            f"{shape_str(q.shape)} and k {shape_str(k.shape)}"
        )
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError(
                "key_padding_mask must be a bool tensor (True = a real token that may be attended to), got "
                + (f"dtype {key_padding_mask.dtype}" if isinstance(key_padding_mask, torch.Tensor)
                   else type(key_padding_mask).__name__)
            )
        expected = (k.shape[0], k.shape[-2])
        if tuple(key_padding_mask.shape) != expected:
            raise ValueError(
                f"key_padding_mask must be (B, Lk) = {shape_str(expected)} for this rank's keys, got "
                f"{shape_str(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != k.device:
            raise ValueError(f"key_padding_mask is on {key_padding_mask.device} but k is on {k.device}")


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """The score scale: ``1 / sqrt(D)`` when ``scale`` is None."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    return float(scale)


def check_positions(name: str, positions: object, length: int, device: torch.device) -> torch.Tensor:
    """``positions`` must be an integer ``(length,)`` tensor; returned as int64 on ``device``."""
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be an integer tensor of token positions, got {type(positions).__name__}")
    if tuple(positions.shape) != (length,):
        raise ValueError(f"{name} must have shape ({length},) (one position per token), got {shape_str(positions.shape)}")
    return positions.to(device=device, dtype=torch.int64)
