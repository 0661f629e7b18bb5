"""Diagnostics for attention models: entropy per head, weight range, gradient norms, NaN hunting.

The source article's ``check_attention`` asks the model to return its weights and computes
``-(w * log(w + 1e-9)).sum(-1).mean()``; its ``monitor_gradients`` prints ``param.grad.norm()``.
Here the same checks work on *any* model, through hooks, without changing its code:

* ``attention_entropy`` / ``attention_stats``: entropy per row and per head, in nats and
  normalised by ``log(number of allowed keys)`` so that rows of different lengths (causal,
  padded) compare on one 0..1 scale. ``0 * log 0`` is taken as 0 exactly, not fudged with
  ``+ 1e-9``; masked keys and fully-masked rows are left out, not averaged in.
* ``capture_attention(model)``: a context manager that records every attention module's
  per-head weights ``(B, H, L, S)`` during a forward pass, by recomputing them in a forward
  hook from the module's own inputs and projections.
* ``gradient_norms(model)`` after ``backward()``, and ``track_gradient_norms(model)``, a
  context manager recording every parameter's gradient norm at every backward pass (so it
  works inside any training loop, e.g. ``attn_course.training.fit``).
* ``find_nonfinite(model)``: a context manager naming the first module (in execution
  order) whose output -- or, optionally, whose input gradient -- holds a NaN or inf.
* ``token_influence(fn, x)``: perturb one input position at a time and record which output
  positions change -- the "token-mixing test" of lesson 02 (it catches heads merged without
  the transpose), the future-leak test of lesson 03 (a causal model's matrix is
  lower-triangular) and the probe that exposes the source article's ViT attention (lesson 09).

Shape legend: B batch, H heads, L query length, S key length. Masks: bool, True = may attend.

Taught in lesson 08 (training & debugging).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._checks import check_mask, check_tensor, shape_str
from .grouped import GroupedQueryAttention, grouped_attention
from .masks import from_blocked_mask, mask_to_bias, with_causal
from .multihead import MultiHeadAttention, split_heads

__all__ = [
    "attention_entropy",
    "attention_stats",
    "AttentionRecord",
    "AttentionCapture",
    "capture_attention",
    "gradient_norms",
    "format_gradient_norms",
    "GradientNormHistory",
    "track_gradient_norms",
    "NonFiniteEvent",
    "NonFiniteError",
    "NonFiniteTracker",
    "find_nonfinite",
    "token_influence",
]


# --------------------------------------------------------------------------- entropy


def _allowed(mask: torch.Tensor | None, *, is_causal: bool, L: int, S: int, device: torch.device) -> torch.Tensor | None:
    """A bool mask (True = may attend) from a bool or additive float mask and ``is_causal``."""
    if mask is not None and mask.dtype != torch.bool:
        mask = ~torch.isneginf(mask)  # additive mask: -inf blocks, anything else is allowed
    return with_causal(mask, L, S, device=device) if is_causal else mask


def attention_entropy(
    weights: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    normalize: bool = False,
) -> torch.Tensor:
    """Entropy of each attention row, in nats: ``-sum_j w_j log w_j`` over the keys. Shape ``(..., L)``.

    Args:
        weights: attention weights ``(..., L, S)``, rows summing to 1 (or 0 for empty rows).
        mask: the mask the weights were computed with (bool, True = may attend, or additive
            float), broadcastable to ``(..., L, S)``; only needed for ``normalize``.
        is_causal: the weights were computed with a (top-left) causal mask.
        normalize: divide by ``log(n)``, ``n`` = the number of keys the row *may* attend to,
            the largest entropy that row can have. 1 means uniform over the allowed keys, 0
            means all weight on one key. Rows with fewer than two allowed keys have no choice
            to make and get 0.

    ``0 log 0`` is taken as exactly 0, so masked keys (weight 0) and fully masked rows (all
    weights 0, entropy 0) need no ``+ 1e-9`` fudge. It is written as ``w * log(w if w > 0
    else 1)`` rather than ``xlogy(w, w)``: the value is the same, and the gradient at ``w = 0``
    is 0 instead of ``0 * -inf = NaN``, so the entropy can also be used as a training penalty.
    """
    check_tensor("weights", weights, min_dim=2)
    safe = torch.where(weights > 0, weights, torch.ones_like(weights))  # log(1) = 0 where w = 0
    entropy = 0.0 - (weights * torch.log(safe)).sum(dim=-1)  # (..., L); "0.0 -" prints 0, not -0
    if not normalize:
        return entropy
    L, S = weights.shape[-2:]
    if mask is not None:
        mask = check_mask(mask, weights.shape, device=weights.device)
    allowed = _allowed(mask, is_causal=is_causal, L=L, S=S, device=weights.device)
    if allowed is None:
        count = torch.full(weights.shape[:-1], float(S), dtype=weights.dtype, device=weights.device)  # (..., L)
    else:
        count = allowed.expand(weights.shape).sum(dim=-1).to(weights.dtype)  # (..., L)
    has_choice = count >= 2
    max_entropy = torch.log(torch.where(has_choice, count, torch.full_like(count, 2.0)))  # (..., L), never log 0 or 1
    return torch.where(has_choice, entropy / max_entropy, torch.zeros_like(entropy))


def attention_stats(
    weights: torch.Tensor, mask: torch.Tensor | None = None, *, is_causal: bool = False
) -> dict[str, torch.Tensor]:
    """Per-head summary of weights ``(B, H, L, S)``: each value is a ``(H,)`` tensor.

    * ``entropy``: mean row entropy in nats, over the rows that may attend to >= 2 keys;
    * ``normalized_entropy``: the same, each row divided by ``log(#allowed keys)`` (0..1);
    * ``min`` / ``max``: the smallest and largest weight on an *allowed* key (masked keys,
      which are 0 by construction, would make every minimum 0).

    A head with no row to average over (e.g. ``L = 1`` with a causal mask) reports NaN.
    """
    check_tensor("weights", weights, min_dim=1)
    if weights.dim() != 4:
        raise ValueError(f"weights must be (B, H, L, S), got shape {shape_str(weights.shape)}")
    B, H, L, S = weights.shape
    if mask is not None:
        mask = check_mask(mask, weights.shape, device=weights.device)
    allowed = _allowed(mask, is_causal=is_causal, L=L, S=S, device=weights.device)
    if allowed is None:
        allowed = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=weights.device)
    allowed = allowed.expand(B, H, L, S)  # (B, H, L, S), a view
    rows = allowed.sum(dim=-1) >= 2  # (B, H, L): rows with a choice to make
    entropy = attention_entropy(weights)  # (B, H, L)
    normalized = attention_entropy(weights, allowed, normalize=True)  # (B, H, L)
    rows_f = rows.to(weights.dtype)
    row_count = rows_f.sum(dim=(0, 2))  # (H,)
    nan = torch.full_like(row_count, float("nan"))

    def row_mean(values: torch.Tensor) -> torch.Tensor:
        total = (values * rows_f).sum(dim=(0, 2))  # (H,)
        return torch.where(row_count > 0, total / row_count.clamp_min(1), nan)

    per_head = weights.transpose(0, 1).reshape(H, -1)  # (H, B * L * S)
    allowed_per_head = allowed.transpose(0, 1).reshape(H, -1)  # (H, B * L * S)
    inf = torch.tensor(float("inf"), dtype=weights.dtype, device=weights.device)
    low = torch.where(allowed_per_head, per_head, inf).amin(dim=-1)  # (H,)
    high = torch.where(allowed_per_head, per_head, -inf).amax(dim=-1)  # (H,)
    has_any = allowed_per_head.any(dim=-1)
    return {
        "entropy": row_mean(entropy),
        "normalized_entropy": row_mean(normalized),
        "min": torch.where(has_any, low, nan),
        "max": torch.where(has_any, high, nan),
    }


# --------------------------------------------------------------------------- tables


def _format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(line, widths)).rstrip() for line in [header, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


# --------------------------------------------------------------------------- capturing weights


@dataclass(frozen=True)
class AttentionRecord:
    """One call of one attention module: its qualified ``name``, the ``call`` index (0 for the
    module's first call inside the capture), per-head ``weights`` ``(B, H, L, S)`` (detached)
    and the ``mask`` it ran with (bool, True = may attend, causal included; None = no mask)."""

    name: str
    call: int
    weights: torch.Tensor
    mask: torch.Tensor | None

    def stats(self) -> dict[str, torch.Tensor]:
        """``attention_stats`` of this call: entropy, normalised entropy, min and max, each ``(H,)``."""
        return attention_stats(self.weights, self.mask)


@dataclass
class AttentionCapture:
    """What ``capture_attention`` recorded: ``records`` in the order the modules ran."""

    records: list[AttentionRecord] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        """Qualified names of the modules that ran, in first-call order, without repeats."""
        return list(dict.fromkeys(record.name for record in self.records))

    def __getitem__(self, name: str) -> torch.Tensor:
        """The weights ``(B, H, L, S)`` of the LAST call of the module called ``name``."""
        for record in reversed(self.records):
            if record.name == name:
                return record.weights
        raise KeyError(f"no attention weights recorded for {name!r}; recorded: {self.names}")

    def __len__(self) -> int:
        return len(self.records)

    def summary(self) -> list[dict[str, object]]:
        """One row per (record, head): name, call, head, entropy, normalized_entropy, min, max."""
        rows = []
        for record in self.records:
            stats = record.stats()
            for head in range(record.weights.shape[1]):
                row = {"name": record.name, "call": record.call, "head": head}
                row.update({key: float(value[head]) for key, value in stats.items()})
                rows.append(row)
        return rows

    def table(self) -> str:
        """``summary()`` as a printable text table."""
        header = ["module", "call", "head", "entropy (nats)", "entropy / log(n)", "min w", "max w"]
        rows = [
            [
                row["name"],
                str(row["call"]),
                str(row["head"]),
                f"{row['entropy']:.3f}",
                f"{row['normalized_entropy']:.3f}",
                f"{row['min']:.3g}",
                f"{row['max']:.3f}",
            ]
            for row in self.summary()
        ]
        return _format_table(header, rows)


def _bind(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, object]:
    """Map a call's positional and keyword arguments to ``forward``'s parameter names."""
    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _course_weights(module: MultiHeadAttention, call: dict[str, object]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Recompute ``MultiHeadAttention`` / ``GroupedQueryAttention`` weights from the call's inputs."""
    query = call["query"]
    key = query if call["key"] is None else call["key"]
    mask, is_causal = call["mask"], call["is_causal"]
    q = split_heads(module.q_proj(query), module.num_heads)  # (B, H, L, D)
    k = split_heads(module.k_proj(key), module.num_kv_heads)  # (B, Hkv, S, D)
    _, weights = grouped_attention(q, k, k, mask, is_causal=is_causal, need_weights=True, fused=False)  # (B, H, L, S)
    return weights, _allowed(mask, is_causal=is_causal, L=q.shape[2], S=k.shape[2], device=q.device)


def _torch_weights(module: nn.MultiheadAttention, call: dict[str, object]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Recompute ``nn.MultiheadAttention`` weights (per head) from the call's inputs.

    Its masks use True = blocked (or are additive floats); ``attn_mask`` is ``(L, S)`` or
    ``(B * H, L, S)``, ``key_padding_mask`` ``(B, S)``.
    """
    query, key = call["query"], call["key"]
    key_padding, attn_mask = call["key_padding_mask"], call["attn_mask"]
    E, H = module.embed_dim, module.num_heads
    if query.dim() == 2:  # unbatched (L, E)
        query, key = query.unsqueeze(0), key.unsqueeze(0)  # (1, L, E), (1, S, E)
        key_padding = None if key_padding is None else key_padding.unsqueeze(0)  # (1, S)
    elif not module.batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)  # (B, L, E), (B, S, E)
    if module._qkv_same_embed_dim:
        w_q, w_k, _ = module.in_proj_weight.split(E, dim=0)  # 3 x (E, E)
    else:
        w_q, w_k = module.q_proj_weight, module.k_proj_weight
    b_q, b_k = (None, None) if module.in_proj_bias is None else module.in_proj_bias.split(E)[:2]
    q = split_heads(F.linear(query, w_q, b_q), H)  # (B, H, L, D)
    k = split_heads(F.linear(key, w_k, b_k), H)  # (B, H, S, D)
    B, _, L, _ = q.shape
    S = k.shape[2]
    masks = []
    if key_padding is not None:
        masks.append(from_blocked_mask(key_padding)[:, None, None, :])  # (B, 1, 1, S)
    if attn_mask is not None:
        converted = from_blocked_mask(attn_mask)
        masks.append(converted.reshape(B, H, L, S) if converted.dim() == 3 else converted)  # (B, H, L, S) or (L, S)
    if not masks:
        mask = None
    elif all(m.dtype == torch.bool for m in masks):
        mask = masks[0] if len(masks) == 1 else masks[0] & masks[1]
    else:  # at least one additive mask: add them up as biases
        mask = sum(m if m.dtype != torch.bool else mask_to_bias(m, q.dtype) for m in masks)
    _, weights = grouped_attention(q, k, k, mask, need_weights=True, fused=False)  # (B, H, L, S)
    return weights, _allowed(mask, is_causal=False, L=L, S=S, device=q.device)


def _forward_weights(module: MultiHeadAttention, call: dict[str, object]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fallback for subclasses that change ``forward``: call it again with ``need_weights=True``.

    The random state is restored afterwards, so active dropout draws the same masks with or
    without the capture. The recorded mask is the call's ``mask`` / ``is_causal``.
    """
    device = module.q_proj.weight.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        _, weights = module.forward(**call, need_weights=True)  # (B, H, L, S)
    mask = call.get("mask")
    mask = mask if isinstance(mask, torch.Tensor) else None
    L, S = weights.shape[-2:]
    return weights, _allowed(mask, is_causal=bool(call.get("is_causal", False)), L=L, S=S, device=weights.device)


def _weights_reader(module: nn.Module):
    """How to read ``module``'s weights, or None if it is not an attention module we know."""
    if callable(getattr(module, "attention_weights", None)):
        return lambda call: module.attention_weights(**call)
    if isinstance(module, MultiHeadAttention):
        kind = type(module)
        if kind.forward is MultiHeadAttention.forward and kind.attend in (
            MultiHeadAttention.attend,
            GroupedQueryAttention.attend,
        ):
            return lambda call: _course_weights(module, call)
        if "need_weights" not in inspect.signature(module.forward).parameters:
            raise TypeError(
                f"{type(module).__name__} overrides forward without a need_weights argument, so capture_attention "
                "cannot read its weights; give it a method "
                "attention_weights(**forward_arguments) -> (weights (B, H, L, S), mask or None)"
            )
        return lambda call: _forward_weights(module, call)
    if isinstance(module, nn.MultiheadAttention):
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError("capture_attention does not support nn.MultiheadAttention with add_bias_kv or add_zero_attn")
        return lambda call: _torch_weights(module, call)
    return None


@contextmanager
def capture_attention(model: nn.Module, *, to_cpu: bool = False) -> Iterator[AttentionCapture]:
    """Record the per-head attention weights of every attention module in ``model``.

    Works without touching the model's code. A forward hook sees each call's arguments and
    recomputes the weights from the module's own projections -- the same numbers
    ``need_weights=True`` returns (before dropout), at the cost of a second ``q @ k^T`` per
    layer -- for ``MultiHeadAttention``, ``GroupedQueryAttention`` and ``nn.MultiheadAttention``.
    A module with a method ``attention_weights(**forward_arguments)`` returning
    ``(weights, mask)`` (as ``DynamicHeadAttention`` has) is asked through it. Any other
    ``MultiHeadAttention`` subclass that overrides ``forward`` or its attention step ``attend``
    (e.g. with position terms in the scores) has its ``forward`` called a second time with
    ``need_weights=True``. For example::

        with capture_attention(model) as captured:
            model(x)
        captured["blocks.0.attn"]   # (B, H, L, S)
        print(captured.table())     # entropy and weight range per layer and head

    Only calls through ``module(...)`` are seen (hooks): PyTorch's fused
    ``nn.TransformerEncoderLayer`` fast path (eval mode) bypasses its attention module.
    ``to_cpu`` moves the recorded tensors to the CPU as they are captured.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    capture = AttentionCapture()
    calls: dict[str, int] = {}
    handles = []

    def make_hook(name: str, reader):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            call = _bind(module, args, kwargs)
            call.pop("need_weights", None)
            call.pop("average_attn_weights", None)
            with torch.no_grad():
                weights, mask = reader(call)
            weights = weights.detach()
            if mask is not None:
                L, S = weights.shape[-2:]
                mask = _allowed(mask.detach(), is_causal=False, L=L, S=S, device=mask.device)
            if to_cpu:
                weights = weights.cpu()
                mask = None if mask is None else mask.cpu()
            index = calls.get(name, 0)
            calls[name] = index + 1
            capture.records.append(AttentionRecord(name=name, call=index, weights=weights, mask=mask))

        return hook

    for name, module in model.named_modules():
        reader = _weights_reader(module)
        if reader is not None:
            handles.append(module.register_forward_hook(make_hook(name or "(model)", reader), with_kwargs=True))
    if not handles:
        warnings.warn(
            f"capture_attention found no attention module in {type(model).__name__}: nothing will be recorded",
            stacklevel=3,
        )
    try:
        yield capture
    finally:
        for handle in handles:
            handle.remove()


# --------------------------------------------------------------------------- gradient norms


def gradient_norms(model: nn.Module, *, norm_type: float = 2.0) -> dict[str, float | None]:
    """Norm of every parameter's ``.grad`` after ``backward()``, by qualified name.

    Parameters that received no gradient map to ``None`` (frozen, unused, or cut off from the
    loss -- itself worth knowing), unlike the article's loop, which skips them silently.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    return {
        name: None if param.grad is None else float(torch.linalg.vector_norm(param.grad.detach(), ord=norm_type))
        for name, param in model.named_parameters()
    }


def _format_norm(value: float | None) -> str:
    if value is None:
        return "no grad"
    if 0 < value < 1e-6:
        # Below 1e-6 a norm is rounding noise (a gradient that is 0 in exact arithmetic, such as a
        # key bias's): its digits change between CPU types, so they are not printed.
        return "< 1e-6"
    return f"{value:.4g}"


def format_gradient_norms(norms: dict[str, float | None]) -> str:
    """A text table of ``gradient_norms`` (lesson 08): name, norm, and a total 2-norm.

    ``None`` prints as ``no grad``, an exact zero as ``0`` and a norm below 1e-6 as ``< 1e-6``
    (rounding noise whose digits differ between machines).
    """
    rows = [[name, _format_norm(value)] for name, value in norms.items()]
    present = [value for value in norms.values() if value is not None]
    rows.append(["(total)", _format_norm(math.sqrt(sum(v * v for v in present))) if present else "no grad"])
    return _format_table(["parameter", "grad norm"], rows)


@dataclass
class GradientNormHistory:
    """Per-parameter gradient 2-norms, one entry per backward pass, filled by ``track_gradient_norms``."""

    _steps: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    @property
    def norms(self) -> dict[str, list[float]]:
        """``{name: [norm at backward 0, norm at backward 1, ...]}``, as Python floats."""
        return {name: [float(value) for value in values] for name, values in self._steps.items()}

    def last(self) -> dict[str, float]:
        """The norms of the most recent backward pass."""
        return {name: float(values[-1]) for name, values in self._steps.items() if values}


@contextmanager
def track_gradient_norms(model: nn.Module) -> Iterator[GradientNormHistory]:
    """Record every parameter's gradient norm at every backward pass, inside any training loop.

    Uses ``Tensor.register_post_accumulate_grad_hook``: the hook runs when a parameter's
    ``.grad`` is ready, so the norms are those *before* any clipping or optimizer step.
    (If a loop accumulates several backward passes without ``zero_grad``, each entry is the
    accumulated gradient so far.) The norms stay on the device until read.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    history = GradientNormHistory()
    handles = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        history._steps[name] = []

        def hook(p: torch.Tensor, name: str = name) -> None:
            history._steps[name].append(torch.linalg.vector_norm(p.grad.detach()))

        handles.append(param.register_post_accumulate_grad_hook(hook))
    try:
        yield history
    finally:
        for handle in handles:
            handle.remove()


# --------------------------------------------------------------------------- NaN / inf hunting


@dataclass(frozen=True)
class NonFiniteEvent:
    """Where a NaN or inf first appeared.

    ``phase`` is ``"forward"`` (the module's output), ``"forward input"`` (the module's input
    was already bad: the code *around* it, in its parent's ``forward`` -- or the data, for the
    model itself -- made it), or ``"backward"`` (the gradient the module passes back to its
    inputs). ``where`` names the tensor, e.g. ``output[0]``.
    """

    phase: str
    name: str
    module_type: str
    where: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nan_count: int
    inf_count: int

    def __str__(self) -> str:
        found = ", ".join(
            text for text, count in (("NaN", self.nan_count), ("inf", self.inf_count)) if count
        )
        text = (
            f"{found} first seen in {self.phase} at module {self.name!r} ({self.module_type}), "
            f"{self.where} of shape {shape_str(self.shape)}, dtype {self.dtype}: "
            f"{self.nan_count} NaN and {self.inf_count} inf values"
        )
        if self.phase == "forward input":
            if self.name == "(model)":
                return text + " -- the data fed to the model is already bad"
            parent = self.name.rpartition(".")[0] or "(model)"
            return text + f" -- no module produced it: look at the code in the forward of {parent!r} before this call"
        return text


class NonFiniteError(RuntimeError):
    """Raised by ``find_nonfinite(..., raise_error=True)`` at the first NaN/inf; ``.event`` says where."""

    def __init__(self, event: NonFiniteEvent) -> None:
        super().__init__(str(event))
        self.event = event


def _tensors(value: object, where: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every floating tensor inside a (possibly nested) tuple / list / dict, with its path."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            yield where, value
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{where}[{index}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{where}[{key!r}]")


@dataclass
class NonFiniteTracker:
    """Filled by ``find_nonfinite``: the first forward and the first backward event (or None)."""

    first: NonFiniteEvent | None = None
    first_backward: NonFiniteEvent | None = None

    @property
    def found(self) -> bool:
        return self.first is not None or self.first_backward is not None


def _first_bad(value: object, where: str) -> tuple[str, torch.Tensor] | None:
    for path, tensor in _tensors(value, where):
        if not torch.isfinite(tensor).all():
            return path, tensor
    return None


def _event(phase: str, name: str, module: nn.Module, path: str, tensor: torch.Tensor) -> NonFiniteEvent:
    return NonFiniteEvent(
        phase=phase,
        name=name,
        module_type=type(module).__name__,
        where=path,
        shape=tuple(tensor.shape),
        dtype=tensor.dtype,
        nan_count=int(torch.isnan(tensor).sum()),
        inf_count=int(torch.isinf(tensor).sum()),
    )


@contextmanager
def find_nonfinite(
    model: nn.Module, *, backward: bool = False, raise_error: bool = False
) -> Iterator[NonFiniteTracker]:
    """Name the first module whose output (or input gradient) contains a NaN or inf. For example::

        with find_nonfinite(model) as tracker:
            loss = model(x).sum()
        print(tracker.first)   # e.g. "inf first seen in forward at module 'blocks.1.ffn.up' ..."

    Forward hooks run when a module *finishes*, innermost first, so the first module to
    report is the one that produced the bad value, not the containers around it nor the
    layers after it. A pre-hook checks each module's inputs too: a bad input no module
    produced was made by plain code in the parent's ``forward`` (or came with the data),
    and is reported as ``"forward input"``. Names are qualified (``model.named_modules()``);
    the model itself is ``"(model)"``.

    ``backward=True`` adds full backward hooks and records the first module, in the order
    backward runs, whose gradient w.r.t. its inputs is not finite (``first_backward``).
    Backward hooks do not work with modules that modify their inputs in place
    (``nn.ReLU(inplace=True)``). ``raise_error=True`` raises ``NonFiniteError`` at the first
    event instead of recording it and carrying on. Checking every output syncs a GPU once per
    module: use it to debug, not on every training step.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    tracker = NonFiniteTracker()
    handles = []

    def record(event: NonFiniteEvent, *, backward_phase: bool) -> None:
        if backward_phase:
            tracker.first_backward = event
        else:
            tracker.first = event
        if raise_error:
            raise NonFiniteError(event)

    def make_hooks(name: str):
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if tracker.first is None:
                bad = _first_bad((args, kwargs), "input")
                if bad is not None:
                    record(_event("forward input", name, module, *bad), backward_phase=False)

        def hook(module: nn.Module, args: tuple, output: object) -> None:
            if tracker.first is None:
                bad = _first_bad(output, "output")
                if bad is not None:
                    record(_event("forward", name, module, *bad), backward_phase=False)

        def backward_hook(module: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
            if tracker.first_backward is None:
                bad = _first_bad(grad_input, "grad_input")
                if bad is not None:
                    record(_event("backward", name, module, *bad), backward_phase=True)

        return pre_hook, hook, backward_hook

    for name, module in model.named_modules():
        pre_hook, hook, backward_hook = make_hooks(name or "(model)")
        handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(module.register_forward_hook(hook))
        if backward:
            handles.append(module.register_full_backward_hook(backward_hook))
    try:
        with warnings.catch_warnings():
            # A module none of whose inputs needs a gradient (the first layer) still reports.
            warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
            yield tracker
    finally:
        for handle in handles:
            handle.remove()


# --------------------------------------------------------------------------- which tokens an output reads


@torch.no_grad()
def token_influence(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    *,
    scale: float = 1.0,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """How much each output position moves when one input position changes: ``(L_out, L_in)``.

    For each input position ``j``, ``x[:, j]`` is changed in every example -- float inputs
    ``(B, L, ...)`` get ``scale`` times one fixed (seeded) random vector added, integer token
    ids ``(B, L)`` become ``(id + 1) % vocab_size`` -- and ``fn`` runs again. Entry ``[i, j]``
    is the largest absolute change of output position ``i`` (``fn`` returns
    ``(B, L_out, ...)``) over examples and features.

    Read ``token_influence(fn, x) > 1e-6`` as "row i reads from columns j": a causal layer
    gives a lower-triangular matrix, a layer that mixes tokens a full one, and one that mixes
    nothing across tokens (e.g. a per-position MLP) the diagonal.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        got = shape_str(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a tensor (B, L, ...) with the sequence on dim 1, got {got}")
    floating = x.dtype.is_floating_point
    if not floating and vocab_size is None:
        raise ValueError("x holds token ids: pass vocab_size so a token can be changed to another valid id")
    base = fn(x)
    if not isinstance(base, torch.Tensor) or base.dim() < 2 or base.shape[0] != x.shape[0]:
        got = shape_str(base.shape) if isinstance(base, torch.Tensor) else type(base).__name__
        raise ValueError(f"fn must return a tensor (B, L_out, ...) with B = {x.shape[0]}, got {got}")
    generator = torch.Generator().manual_seed(0)
    direction = None
    if floating:
        direction = torch.randn(x.shape[2:], generator=generator, dtype=x.dtype).to(x.device) * scale  # (...)
    columns = []
    for j in range(x.shape[1]):
        changed = x.clone()
        if floating:
            changed[:, j] += direction
        else:
            changed[:, j] = (changed[:, j] + 1) % vocab_size
        moved = (fn(changed) - base).abs()  # (B, L_out, ...)
        moved = moved.reshape(moved.shape[0], moved.shape[1], -1)  # (B, L_out, features)
        columns.append(moved.amax(dim=(0, 2)))  # (L_out,)
    return torch.stack(columns, dim=1)  # (L_out, L_in)
