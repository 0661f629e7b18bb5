"""Input checks shared by every public attention function.

Each check raises ``TypeError`` / ``ValueError`` with the expected and the actual shape,
dtype or device, plus a hint for the classic mistakes. Shape legend: B batch, H heads,
L query length, S key length, D head dim, E model dim.
"""

from __future__ import annotations

import itertools

import torch

__all__ = [
    "check_int",
    "check_positive_int",
    "check_tensor",
    "check_qkv",
    "check_mask",
    "check_key_mask",
    "shape_str",
    "broadcast_shapes",
]


def broadcast_shapes(*shapes: torch.Size | tuple[int, ...]) -> torch.Size:
    """The shape ``shapes`` broadcast to, as ``torch.broadcast_shapes`` gives it (RuntimeError if none).

    Written out because ``torch.broadcast_shapes`` imports sympy on its first call (measured
    0.7 s idle, several seconds under load), which a learner's first ``check()`` paid for.
    """
    out = []
    for dims in itertools.zip_longest(*(reversed(tuple(shape)) for shape in shapes), fillvalue=1):
        sizes = {int(d) for d in dims if d != 1}
        if len(sizes) > 1:
            raise RuntimeError(f"shapes {[tuple(s) for s in shapes]} cannot be broadcast together")
        out.append(sizes.pop() if sizes else 1)
    return torch.Size(reversed(out))


def shape_str(shape: torch.Size | tuple[int, ...]) -> str:
    return "(" + ", ".join(str(int(n)) for n in shape) + ")"


def check_int(name: str, value: object, *, minimum: int) -> int:
    """``value`` if it is an int >= ``minimum``; TypeError (not an int) or ValueError (too small) otherwise.

    The one integer validator of the package: a ``bool`` is refused although Python counts it
    as an int (``num_heads=True`` is a mistake, not a 1).
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_positive_int(name: str, value: object) -> int:
    """``value`` if it is an int >= 1 (a length, a size, a count); TypeError/ValueError otherwise."""
    return check_int(name, value, minimum=1)


def check_tensor(name: str, x: object, *, min_dim: int = 1, floating: bool = True) -> torch.Tensor:
    """Check that ``x`` is a tensor with at least ``min_dim`` dims (and a float dtype)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dims, got shape {shape_str(x.shape)}")
    if floating and not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}; try {name}.float()")
    return x


def _transpose_hint(q: torch.Tensor, other: torch.Tensor) -> str:
    """Suggest swapping axes 1 and 2 when that would make the shapes line up."""
    if q.dim() == 4 and other.dim() == 4:
        swapped = other.shape[:1] + other.shape[2:3] + other.shape[1:2]
        if swapped == q.shape[:3] or swapped[:2] == q.shape[:2]:
            return (
                " It looks like one tensor is laid out (B, L, H, D) and the other (B, H, L, D): "
                "attention wants heads before the sequence axis, so use x.transpose(1, 2)."
            )
    return ""


def check_qkv(q: object, k: object, v: object) -> tuple[int, int, torch.Size]:
    """Validate q ``(..., L, D)``, k ``(..., S, D)``, v ``(..., S, Dv)``.

    Returns ``(L, S, batch_shape)`` where ``batch_shape`` is the broadcast of the leading
    dims of q, k and v.
    """
    q = check_tensor("q", q, min_dim=2)
    k = check_tensor("k", k, min_dim=2)
    v = check_tensor("v", v, min_dim=2)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}; "
            "cast them with .to(q.dtype)"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}; move them with .to(q.device)"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same last dim D: q is (..., L, D) = {shape_str(q.shape)}, "
            f"k is (..., S, D) = {shape_str(k.shape)}." + _transpose_hint(q, k)
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same number of keys S: k is (..., S, D) = {shape_str(k.shape)}, "
            f"v is (..., S, Dv) = {shape_str(v.shape)}." + _transpose_hint(k, v)
        )
    try:
        batch_shape = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"the leading (batch, head) dims of q {shape_str(q.shape)}, k {shape_str(k.shape)} and "
            f"v {shape_str(v.shape)} do not broadcast together." + _transpose_hint(q, k)
        ) from None
    return q.shape[-2], k.shape[-2], batch_shape


def check_mask(mask: object, target_shape: torch.Size | tuple[int, ...], *, device: torch.device) -> torch.Tensor:
    """Validate a bool (True = may attend) or float (additive) mask against ``(..., L, S)``.

    Any shape that broadcasts to ``target_shape`` is accepted, as the docstrings promise: a
    scalar, a 1-D ``(S,)`` key mask, ``(L, 1)``, ``(B, 1, 1, S)``, ... The mask is returned with
    at least two dims (a view: ``(S,)`` becomes ``(1, S)``, a scalar ``(1, 1)``), so that code
    reading its query axis ``mask.shape[-2]`` or slicing ``mask[..., 0, :]`` works for every one.
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(
            f"mask must be bool (True = may attend) or floating point (added to the scores), got dtype "
            f"{mask.dtype}. For a 0/1 mask where 1 means 'may attend' use mask.bool(); if 1 means "
            "'blocked' (nn.MultiheadAttention's convention) use attn_course.from_blocked_mask(mask.bool())."
        )
    if mask.device != device:
        raise ValueError(f"mask is on {mask.device} but the inputs are on {device}; use mask.to({str(device)!r})")
    target = torch.Size(target_shape)
    try:
        broadcast = broadcast_shapes(mask.shape, target)
    except RuntimeError:
        broadcast = None
    if broadcast != target:
        L, S = target[-2], target[-1]
        hint = ""
        if mask.dim() == 2 and mask.shape[-1] == S and mask.shape[0] != L and len(target) >= 3:
            hint = " A (B, S) padding mask needs mask[:, None, None, :] to become (B, 1, 1, S)."
        elif mask.dim() == 3 and len(target) == 4 and mask.shape[-2:] == target[-2:]:
            hint = " A (B, L, S) mask needs mask[:, None] to become (B, 1, L, S), broadcasting over heads."
        elif mask.shape[-2:] == (S, L) and L != S:
            hint = " The last two dims look swapped: masks are (..., L queries, S keys)."
        raise ValueError(
            f"mask of shape {shape_str(mask.shape)} does not broadcast to the scores' shape "
            f"(..., L, S) = {shape_str(target)}.{hint}"
        )
    if mask.dim() < 2:
        mask = mask.reshape((1,) * (2 - mask.dim()) + tuple(mask.shape))  # (1, S) or (1, 1), a view
    return mask


def check_key_mask(
    mask: object, batch_shape: torch.Size, *, L: int, S: int, device: torch.device, who: str, why: str
) -> torch.Tensor:
    """Validate the key-padding mask of an attention that never forms the ``(L, S)`` matrix.

    Sparse and linear attention take a bool mask (True = real token) broadcastable to
    ``(..., 1, S)``: a scalar, ``(S,)``, ``(1, S)``, ``(B, 1, 1, S)``, ``(B, H, 1, S)``, ``(B, 1, 1, 1)``.
    A mask with a real query axis ``(..., L, S)`` is refused, saying ``why``. Returns the mask
    as ``(..., 1, S)`` (a view: broadcast axes are expanded, nothing is copied).
    """
    if isinstance(mask, torch.Tensor) and mask.dim() >= 2 and mask.shape[-2] == L != 1:
        raise ValueError(
            f"{who} takes a key-padding mask of shape (..., 1, S), got {shape_str(mask.shape)}: {why}. "
            "For padding use padding_mask(lengths)[:, None, None, :] -> (B, 1, 1, S)."
        )
    mask = check_mask(mask, (*batch_shape, 1, S), device=device)
    if mask.dtype != torch.bool:
        raise TypeError(f"{who} takes a boolean key mask (True = real token), got dtype {mask.dtype}")
    return mask.expand(*mask.shape[:-1], S)  # (..., 1, S)
